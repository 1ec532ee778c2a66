"""Turns as OpenTelemetry spans (`--otlp-endpoint`): each ended turn reaches a real OTLP/HTTP receiver as one
GenAI inference span that says what the store says of the turn; no endpoint, no exporter."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.settings import Settings
from testbed.process import refusing_port

from support import TIMEOUT, client_of, stored_rollout, streamed_reply, sync_agent
from support.otlp import OtlpReceiver, ReceivedSpan

MESSAGES = [{"role": "user", "content": "hi"}]
UNSET, ERROR = Status.STATUS_CODE_UNSET, Status.STATUS_CODE_ERROR
"""A span's status codes: an answered turn's (the conventions leave it unset) and a failed one's."""


def ns(seconds: float) -> int:
    return round(seconds * 1_000_000_000)


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    found = OtlpReceiver()
    yield found
    found.close()


@pytest.fixture
def traced_gateway(start_gateway, databases, receiver, monkeypatch):
    """A gateway on the session's vLLM that sends its spans to `receiver`, at policy version 7."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # the SDK's batch interval (ms): spans arrive sooner
    return start_gateway(databases.new("sqlite"), "--otlp-endpoint", receiver.url, "--policy-version", "7")


def only_turn(gateway, rollout_id: str) -> dict[str, Any]:
    (turn,) = stored_rollout(gateway, rollout_id)["turns"]
    return turn


def assert_span_times_are_the_turns(span: ReceivedSpan, turn: dict[str, Any]) -> None:
    assert (span.start_ns, span.end_ns) == (ns(turn["started_at"]), ns(turn["finished_at"]))


def error_of(span: ReceivedSpan) -> tuple[Any, ...]:
    """What an error span says of its error: `error.type`, the turn's status, the agent's HTTP status."""
    return tuple(span.attributes[k] for k in ("error.type", "rl_gateway.status", "rl_gateway.http_status"))


def server_of(backend: str) -> dict[str, Any]:
    url = urlsplit(backend)
    return {"server.address": url.hostname, "server.port": url.port}


def test_an_agents_chat_call_becomes_one_span_saying_what_the_store_says(
    traced_gateway, receiver, vllm, rollout_id
):
    agent = sync_agent(traced_gateway.agent_url(rollout_id))

    agent.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0.0, seed=3)

    (span,) = receiver.wait_for(1)
    turn = only_turn(traced_gateway, rollout_id)
    assert (span.name, span.kind, span.status) == ("chat tiny", Span.SPAN_KIND_CLIENT, UNSET)
    assert_span_times_are_the_turns(span, turn)
    assert span.resource["service.name"] == "rl-gateway"
    assert span.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.conversation.id": rollout_id,
        "gen_ai.request.model": turn["model"],
        "gen_ai.request.stream": False,
        "gen_ai.request.max_tokens": 5,
        "gen_ai.request.temperature": 0.0,
        "gen_ai.request.seed": 3,
        "gen_ai.response.finish_reasons": [turn["finish_reason"]],
        "gen_ai.usage.input_tokens": len(turn["prompt_token_ids"]),
        "gen_ai.usage.output_tokens": len(turn["completion_token_ids"]),
        **server_of(vllm.url),
        "rl_gateway.endpoint": "chat",
        "rl_gateway.status": "ok",
        "rl_gateway.http_status": 200,
        "rl_gateway.policy_version": turn["policy_version"],
        "rl_gateway.policy_version_end": turn["policy_version_end"],
        "rl_gateway.choice_index": 0,
        "rl_gateway.attempt": 0,
    }
    assert (turn["model"], turn["policy_version"], turn["backend"]) == ("tiny", "7", vllm.url)


def test_a_streamed_call_gives_a_span_with_its_time_to_first_chunk(traced_gateway, receiver, rollout_id):
    agent = sync_agent(traced_gateway.agent_url(rollout_id))

    streamed_reply(agent.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, stream=True))

    (span,) = receiver.wait_for(1)
    turn = only_turn(traced_gateway, rollout_id)
    assert_span_times_are_the_turns(span, turn)
    assert span.attributes["gen_ai.request.stream"] is True
    first_chunk = turn["first_token_at"] - turn["started_at"]
    assert span.attributes["gen_ai.response.time_to_first_chunk"] == first_chunk
    assert span.attributes["gen_ai.usage.output_tokens"] == len(turn["completion_token_ids"])
    assert span.attributes["gen_ai.response.finish_reasons"] == [turn["finish_reason"]]


def test_a_call_vllm_rejects_gives_an_error_span_with_its_http_status(traced_gateway, receiver, rollout_id):
    agent = sync_agent(traced_gateway.agent_url(rollout_id))

    with pytest.raises(openai.BadRequestError):
        agent.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100_000)

    (span,) = receiver.wait_for(1)
    turn = only_turn(traced_gateway, rollout_id)
    assert (turn["status"], turn["http_status"]) == ("error", 400)
    assert (span.status, span.status_message) == (ERROR, turn["error"])
    assert_span_times_are_the_turns(span, turn)
    assert error_of(span) == ("400", "error", 400)


def test_a_call_refused_by_a_rollout_limit_gives_an_error_span_naming_the_limit(traced_gateway, receiver):
    created = client_of(traced_gateway).post(
        traced_gateway.url + "/rollouts", json={"limits": {"max_turns": 1}}, timeout=TIMEOUT
    )
    rollout_id = created.json()["rollout_id"]
    agent = sync_agent(created.json()["base_url"])

    agent.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        agent.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)

    answered, refused = sorted(receiver.wait_for(2), key=lambda span: span.start_ns)
    turns = stored_rollout(traced_gateway, rollout_id)["turns"]
    assert [t["status"] for t in turns] == ["ok", "refused"]
    assert (answered.status, refused.status) == (UNSET, ERROR)
    assert refused.status_message == turns[1]["error"]
    assert_span_times_are_the_turns(refused, turns[1])
    assert error_of(refused) == ("max_turns", "refused", 400)


def call_unreachable_backend(settings: Settings, rollout_id: str) -> TestClient:
    """Run a gateway whose one backend is down through one call (an error turn, 503) and its shutdown."""
    with TestClient(create_app(settings)) as client:
        response = client.post(
            f"/rollouts/{rollout_id}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}
        )
        assert response.status_code == 503, response.text
        assert [t["status"] for t in client.get(f"/rollouts/{rollout_id}").json()["turns"]] == ["error"]
    return client


def offline_settings(databases, **fields: Any) -> Settings:
    return Settings(db=databases.new("sqlite"), backend=[f"http://127.0.0.1:{refusing_port()}"], **fields)


def test_without_an_endpoint_no_exporter_is_built_and_no_span_is_sent(
    databases, receiver, monkeypatch, rollout_id
):
    # Where an exporter built with the SDK's defaults would send its spans: none is built, none arrives.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)

    client = call_unreachable_backend(offline_settings(databases), rollout_id)

    assert client.app.state.turns.recorder.spans is None
    assert receiver.spans == []


def test_a_gateway_sends_the_spans_it_still_holds_as_it_shuts_down(databases, receiver, rollout_id):
    """The SDK sends in batches, every few seconds: the shutdown sends the last ones before it returns."""
    settings = offline_settings(databases, otlp_endpoint=receiver.url)

    call_unreachable_backend(settings, rollout_id)

    (span,) = receiver.spans
    assert (span.name, span.status) == ("chat tiny", ERROR)
    assert span.attributes["error.type"] == "503"
    assert span.attributes["gen_ai.conversation.id"] == rollout_id


@pytest.mark.engine  # starts the gateway's command line as a process of its own
def test_the_endpoint_without_the_otel_packages_stops_the_start_up_naming_the_extra(tmp_path: Path):
    """An interpreter that finds every installed package but OpenTelemetry's (a view of site-packages
    without them, Python's own `site` off): as an install without the extra."""
    site_packages = Path(httpx.__file__).resolve().parents[1]
    view = tmp_path / "site-packages"
    view.mkdir()
    for entry in site_packages.iterdir():
        if not entry.name.startswith("opentelemetry"):
            (view / entry.name).symlink_to(entry)
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-S", "-m", "gateway", "serve", "--db", f"sqlite:///{tmp_path / 'g.db'}"]

    done = subprocess.run(
        [*command, "--otlp-endpoint", "http://127.0.0.1:4318/v1/traces"],
        env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{view}"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )

    assert (done.returncode, done.stderr) == (
        2,
        "gateway serve: error: --otlp-endpoint: traces need the otel extra (opentelemetry.sdk is missing): "
        "pip install 'rl-gateway[otel]'\n",
    )
