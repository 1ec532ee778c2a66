"""Exact mode: every turn's prompt is the previous turn's exact ids plus the rendering of what is new, even
under a template that strips earlier thinking; pass-through on that template drifts and cannot merge."""

from __future__ import annotations

import itertools
import json
import uuid

import httpx
import pytest

from testbed.tiny_model import THINK_STRIPPING_CHAT_TEMPLATE
from trainer_client import SampleOptions, TrainerClient

from support import (
    TIMEOUT,
    TOOLS,
    VLLM_HEADERS,
    detokenize,
    stored_rollout,
    streamed_reply,
    sync_agent,
    tokenize_chat,
)

THINK_THEN_CALL = (
    r'<think>[a-z]{2,6}</think><tool_call>\{"name": "ls", "arguments": \{"path": "/tmp"\}\}</tool_call>'
)
TURNS = 5


def run_agent(base_url: str, *, stream: bool) -> list[dict]:
    """Five turns of think + tool call; each tool result is followed by a user message, so the template strips
    the thinking of every earlier answer when it re-renders the history."""
    agent = sync_agent(base_url)
    messages: list[dict] = [
        {"role": "system", "content": "Think, then list /tmp."},
        {"role": "user", "content": "Go."},
    ]
    replies = []
    for _ in range(TURNS):
        kwargs = {
            "model": "tiny",
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": 120,
            "temperature": 1.0,
            "seed": 1,
            "extra_body": {
                "structured_outputs": {"regex": THINK_THEN_CALL},
                "chat_template": THINK_STRIPPING_CHAT_TEMPLATE,
            },
        }
        if stream:
            streamed = streamed_reply(agent.chat.completions.create(**kwargs, stream=True))
            finish = streamed["finish_reason"]
            reply = {
                "role": "assistant",
                "content": streamed["content"],
                "tool_calls": streamed["tool_calls"],
            }
        else:
            choice = agent.chat.completions.create(**kwargs).choices[0]
            finish = choice.finish_reason
            reply = {
                "role": "assistant",
                "content": choice.message.content,
                "tool_calls": [c.model_dump() for c in choice.message.tool_calls or ()],
            }
        replies.append({"finish_reason": finish, **reply})
        messages += [
            dict(reply),
            {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "a.txt"},
            {"role": "user", "content": "Again."},
        ]
    return replies


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_exact_mode_extends_every_turn_token_for_token_and_merges(
    start_gateway, databases, db_kind, vllm, stream
):
    db_url = databases.new(db_kind)
    gateway = start_gateway(db_url, "--mode", "exact")
    rollout = httpx.post(gateway.url + "/rollouts", json={"group_id": "g"}, timeout=TIMEOUT).json()

    replies = run_agent(rollout["base_url"], stream=stream)
    httpx.post(
        f"{gateway.url}/rollouts/{rollout['rollout_id']}/finish", json={"reward": 1.0}, timeout=TIMEOUT
    )

    assert [r["finish_reason"] for r in replies] == ["tool_calls"] * TURNS
    assert all(json.loads(r["tool_calls"][0]["function"]["arguments"]) == {"path": "/tmp"} for r in replies)
    assert all(r["content"].startswith("<think>") and r["content"].endswith("</think>") for r in replies)
    turns = stored_rollout(gateway, rollout["rollout_id"])["turns"]
    assert [t["splice"] for t in turns] == ["render"] + ["exact"] * (TURNS - 1)
    assert [t["parent_turn"] for t in turns] == [None, 0, 1, 2, 3]
    for previous, turn in itertools.pairwise(turns):
        exact = previous["prompt_token_ids"] + previous["completion_token_ids"]
        assert turn["prompt_token_ids"][: len(exact)] == exact
        assert turn["drift_tokens"] > 0  # what the plain render would have lost
    for turn, reply in zip(turns, replies, strict=False):
        assert detokenize(vllm, turn["completion_token_ids"]).startswith(reply["content"] + "<tool_call>")
        assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"])
    with TrainerClient(db_url) as client:
        steps = client.read().samples
        (merged,) = client.read(SampleOptions(merged=True)).samples
    assert merged.turn_indices == [0, 1, 2, 3, 4]
    completions = [t for turn in turns for t in turn["completion_token_ids"]]
    assert merged.input_ids[merged.loss_mask == 1].tolist() == completions
    assert len(steps) == TURNS


def test_pass_through_on_a_think_stripping_template_drifts_and_does_not_merge(
    start_gateway, databases, db_kind, vllm
):
    db_url = databases.new(db_kind)
    gateway = start_gateway(db_url, "--mode", "passthrough")
    rollout = httpx.post(gateway.url + "/rollouts", json={"group_id": "g"}, timeout=TIMEOUT).json()

    run_agent(rollout["base_url"], stream=False)
    httpx.post(
        f"{gateway.url}/rollouts/{rollout['rollout_id']}/finish", json={"reward": 1.0}, timeout=TIMEOUT
    )

    turns = stored_rollout(gateway, rollout["rollout_id"])["turns"]
    assert [t["splice"] for t in turns] == [None] * TURNS
    assert [t["parent_turn"] for t in turns] == [None, 0, 1, 2, 3]
    assert all(t["drift_tokens"] > 0 for t in turns[1:])
    with TrainerClient(db_url) as client:
        assert len(client.read(SampleOptions(merged=True)).samples) == TURNS


def test_rollout_can_choose_exact_mode_and_a_cut_reply_is_spliced_closed_by_the_template(
    gateway, vllm, db_url
):
    group = {"mode": "exact", "group_id": f"cut-{uuid.uuid4().hex[:8]}"}
    rollout = httpx.post(gateway.url + "/rollouts", json=group, timeout=TIMEOUT).json()
    agent = sync_agent(rollout["base_url"])
    messages = [{"role": "user", "content": "Hi"}]
    first = agent.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More"},
    ]
    second = agent.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    httpx.post(
        f"{gateway.url}/rollouts/{rollout['rollout_id']}/finish", json={"reward": 1.0}, timeout=TIMEOUT
    )

    turns = stored_rollout(gateway, rollout["rollout_id"])["turns"]
    assert rollout["mode"] == "exact"
    assert first.choices[0].finish_reason == second.choices[0].finish_reason == "length"
    assert [t["splice"] for t in turns] == ["render", "exact"]
    # The cut reply as sampled, then what the template renders after the reply (its closing first).
    after_reply = tokenize_chat(vllm, messages)[len(tokenize_chat(vllm, messages[:2], open_reply=True)) :]
    assert turns[1]["prompt_token_ids"] == [
        *turns[0]["prompt_token_ids"],
        *turns[0]["completion_token_ids"],
        *after_reply,
    ]
    assert turns[1]["parent_turn"] == 0
    with TrainerClient(db_url) as client:
        (sample,) = client.read_groups([group["group_id"]], SampleOptions(merged=True)).samples
    assert sample.turn_indices == [0, 1]
    assert sample.loss_mask.tolist() == [
        *[0] * len(turns[0]["prompt_token_ids"]),
        *[1] * 5,
        *[0] * len(after_reply),
        *[1] * 5,
    ]


def test_edited_history_in_exact_mode_forks_and_splices_nothing(start_gateway, databases, db_kind, vllm):
    db_url = databases.new(db_kind)
    gateway = start_gateway(db_url, "--mode", "exact")
    rollout = httpx.post(gateway.url + "/rollouts", json={}, timeout=TIMEOUT).json()
    agent = sync_agent(rollout["base_url"])
    history = [{"role": "user", "content": "Tell me about /tmp."}]
    reply = agent.chat.completions.create(
        model="tiny",
        messages=history,
        max_tokens=30,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[a-z]{3}"}},
    )
    history += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "And?"},
    ]
    agent.chat.completions.create(model="tiny", messages=history, max_tokens=5, temperature=0)
    summary = [
        {"role": "user", "content": "Summary: we talked about /tmp."},
        {"role": "user", "content": "And?"},
    ]
    agent.chat.completions.create(model="tiny", messages=summary, max_tokens=5, temperature=0)

    turns = stored_rollout(gateway, rollout["rollout_id"])["turns"]
    assert [t["splice"] for t in turns] == ["render", "exact", "render"]
    assert [(t["parent_turn"], t["forked_from"]) for t in turns] == [(None, None), (0, None), (None, None)]
    assert turns[2]["prompt_token_ids"] == tokenize_chat(vllm, summary)
    exact = turns[0]["prompt_token_ids"] + turns[0]["completion_token_ids"]
    assert turns[1]["prompt_token_ids"][: len(exact)] == exact


def test_backend_without_token_endpoints_is_reported_and_served_in_pass_through(
    gateway, start_gateway, databases, db_kind, vllm
):
    # Another gateway speaks the OpenAI API but has none of vLLM's render/generate/derender endpoints.
    upstream = gateway.agent_url("chained")[: -len("/v1")]
    db_url = databases.new(db_kind)
    chained = start_gateway(db_url, "--mode", "exact", backends=[upstream], process=True)
    agent = sync_agent(chained.agent_url("r"))
    messages = [{"role": "user", "content": "Hi"}]

    sampling = {"max_tokens": 4, "temperature": 0.0}
    agent.chat.completions.create(model="tiny", messages=messages, **sampling)
    direct = httpx.post(
        vllm.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, **sampling, "return_token_ids": True},
        headers=VLLM_HEADERS,
        timeout=TIMEOUT,
    ).json()

    log = chained.log_path.read_text()
    assert f"backend {upstream} does not serve vLLM's render/generate endpoints" in log
    turn = stored_rollout(chained, "r")["turns"][0]
    assert (turn["splice"], turn["status"]) == (None, "ok")
    assert turn["prompt_token_ids"] == tokenize_chat(vllm, messages) == direct["prompt_token_ids"]
    assert turn["completion_token_ids"] == direct["choices"][0]["token_ids"]


def exact_turns_then_several_choices(gateway, stream: bool) -> tuple[list[dict], list[list[int]]]:
    """A first turn that ends its reply, then a call with 3 choices extending it (streamed or whole): the
    stored turns, and each choice's ids as the agent received them."""
    rollout = httpx.post(gateway.url + "/rollouts", json={"mode": "exact"}, timeout=TIMEOUT).json()
    agent = sync_agent(rollout["base_url"])
    messages = [{"role": "user", "content": "Hi"}]
    answer = {"regex": "[a-z]{3,8}"}
    first = agent.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, extra_body={"structured_outputs": answer}
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More"},
    ]
    body = {"model": "tiny", "messages": messages, "n": 3, "max_tokens": 20, "temperature": 1.0}
    extra = {"structured_outputs": answer, "return_token_ids": True}
    ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
    if stream:
        for chunk in agent.chat.completions.create(**body, stream=True, extra_body=extra):
            for choice in chunk.choices:
                ids[choice.index] += getattr(choice, "token_ids", None) or []
    else:
        ids = {c.index: c.token_ids for c in agent.chat.completions.create(**body, extra_body=extra).choices}
    return stored_rollout(gateway, rollout["rollout_id"])["turns"], [ids[0], ids[1], ids[2]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_several_choices_in_exact_mode_each_extend_the_parent_exactly(
    start_gateway, databases, db_kind, stream
):
    gateway = start_gateway(databases.new(db_kind), "--mode", "exact")

    (first, *choices), received = exact_turns_then_several_choices(gateway, stream)

    exact = first["prompt_token_ids"] + first["completion_token_ids"]
    assert [(t["choice_index"], t["splice"], t["parent_turn"]) for t in choices] == [
        (0, "exact", 0),
        (1, "exact", 0),
        (2, "exact", 0),
    ]
    assert len({tuple(t["prompt_token_ids"]) for t in choices}) == 1
    assert choices[0]["prompt_token_ids"][: len(exact)] == exact
    assert [t["completion_token_ids"] for t in choices] == received
    assert all(len(t["completion_logprobs"]) == len(t["completion_token_ids"]) > 0 for t in choices)


def test_an_exact_reply_is_what_vllms_chat_endpoint_answers_for_the_same_prompt_ids(gateway, vllm):
    rollout = httpx.post(gateway.url + "/rollouts", json={"mode": "exact"}, timeout=TIMEOUT).json()
    agent = sync_agent(rollout["base_url"])
    messages = [{"role": "user", "content": "Hi"}]
    request = {"model": "tiny", "max_tokens": 12, "temperature": 1.0, "seed": 5, "logprobs": True}
    answer = {"structured_outputs": {"regex": "[a-z]{3,8}"}}  # a reply that ends: the next turn splices
    first = agent.chat.completions.create(messages=messages, **request, extra_body=answer)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More"},
    ]
    body = {"messages": messages, **request, "min_tokens": 12, "return_token_ids": True}
    through = httpx.post(rollout["base_url"] + "/chat/completions", json=body, timeout=TIMEOUT).json()
    turn = stored_rollout(gateway, rollout["rollout_id"])["turns"][1]
    kv = {"prompt_token_ids": turn["prompt_token_ids"]}
    direct = httpx.post(
        f"{vllm.url}/v1/chat/completions",
        json={**body, "kv_transfer_params": kv},
        headers=VLLM_HEADERS,
        timeout=TIMEOUT,
    ).json()

    assert turn["splice"] == "exact"
    for reply in (through, direct):
        reply.pop("id"), reply.pop("created")
    assert through["choices"] == direct["choices"]
    assert through["usage"] == direct["usage"]
    assert through["prompt_token_ids"] == direct["prompt_token_ids"] == turn["prompt_token_ids"]
