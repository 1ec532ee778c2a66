"""What an operator sees on /metrics: the time each call spends in each stage, the tokens relayed, the calls
queued, and how late the event loop runs."""

from __future__ import annotations

from typing import Any

from support import metric, sync_agent, wait_for

STAGES = ("admission", "queue", "render", "upstream", "relay", "commit")


def stage_counts(gateway: Any) -> dict[str, float]:
    return {stage: metric(gateway, f'gateway_stage_seconds_count{{stage="{stage}"}}') for stage in STAGES}


def test_a_streamed_call_is_timed_in_each_stage_it_passes_and_its_tokens_count_as_relayed(
    start_gateway, databases
):
    gateway = start_gateway(databases.new("sqlite"))
    stream = sync_agent(gateway.agent_url("timed")).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=5,
        stream=True,
        extra_body={"min_tokens": 5},
    )
    finishes = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]

    assert finishes == ["length"]
    assert stage_counts(gateway) == {
        "admission": 1, "queue": 0, "render": 0, "upstream": 1, "relay": 1, "commit": 1,
    }  # fmt: skip
    assert metric(gateway, "gateway_relayed_tokens_total") == 5
    assert metric(gateway, "gateway_calls_queued") == 0


def test_an_exact_mode_call_is_timed_rendering_and_a_whole_reply_relays_no_tokens(start_gateway, databases):
    gateway = start_gateway(databases.new("sqlite"), "--mode", "exact")
    reply = sync_agent(gateway.agent_url("rendered")).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, extra_body={"min_tokens": 3}
    )

    assert reply.usage.completion_tokens == 3
    assert stage_counts(gateway) == {
        "admission": 1, "queue": 0, "render": 1, "upstream": 1, "relay": 0, "commit": 1,
    }  # fmt: skip
    assert metric(gateway, "gateway_relayed_tokens_total") == 0


def test_the_event_loops_lag_is_measured_while_the_gateway_runs(start_gateway, databases):
    gateway = start_gateway(databases.new("sqlite"))

    wait_for(lambda: metric(gateway, "gateway_event_loop_lag_seconds_count") >= 2, "two measures of the lag")
    assert metric(gateway, 'gateway_event_loop_lag_seconds_bucket{le="+Inf"}') >= 2
