"""Exact mode rendering in the gateway (`--local-render`): the same turns as vLLM's own render, the backend
asked once per model to earn trust, and the backend's render wherever the two would differ."""

from __future__ import annotations

import re
import shlex

import httpx
from test_exact_mode import TURNS, run_agent

from testbed.tiny_model import CHAT_TEMPLATE

from support import TIMEOUT, VLLM_HEADERS, chat, on_store, stored_rollout, sync_agent

pytestmark = on_store("sqlite")  # how a prompt is rendered does not depend on the store

RENDERS = re.compile(r'^http_requests_total\{.*handler="/v1/chat/completions/render".*\} ([0-9.e+]+)$', re.M)


def renders_served(vllm) -> int:
    """How many renders vLLM has answered (its own request counter)."""
    metrics = httpx.get(vllm.url + "/metrics", headers=VLLM_HEADERS, timeout=TIMEOUT).text
    return int(sum(float(count) for count in RENDERS.findall(metrics)))


def local_render(vllm, *more: str) -> tuple[str, str]:
    return "--local-render", shlex.join([*vllm.render_args(), "--trust-request-chat-template", *more])


def rollout_turns(gateway, stream: bool) -> tuple[list[dict], list[dict]]:
    rollout = httpx.post(gateway.url + "/rollouts", json={"group_id": "g"}, timeout=TIMEOUT).json()
    replies = run_agent(rollout["base_url"], stream=stream)
    return replies, stored_rollout(gateway, rollout["rollout_id"])["turns"]


def without_call_ids(replies: list[dict]) -> list[dict]:
    """The replies as the model wrote them (vLLM gives each tool call a random id)."""
    return [
        {**reply, "tool_calls": [{**call, "id": None} for call in reply["tool_calls"]]} for reply in replies
    ]


def kept(turn: dict) -> dict:
    return {key: turn[key] for key in ("prompt_token_ids", "completion_token_ids", "splice", "parent_turn")}


def chat_turns(gateway, reply: str = "[a-z]{3,8}") -> list[dict]:
    """Three turns of answers matching `reply` (short ones by default) on the model's own template; the
    turns stored."""
    rollout_id = httpx.post(gateway.url + "/rollouts", json={}, timeout=TIMEOUT).json()["rollout_id"]
    messages: list[dict] = [{"role": "user", "content": "Hi"}]
    for _ in range(3):
        messages += [chat(gateway, rollout_id, messages, structured_outputs={"regex": reply})]
        messages += [{"role": "user", "content": "More."}]
    return stored_rollout(gateway, rollout_id)["turns"]


def test_local_render_stores_the_turns_the_backends_render_does_and_takes_over_after_one_turn(
    start_gateway, databases, db_kind, vllm
):
    """Tool-calling agents whole and streamed, and replies every one cut by max_tokens (closed as the
    backend's render closes them), through one gateway: the backend renders once, to earn its trust."""
    by_backend = start_gateway(databases.new(db_kind), "--mode", "exact")
    # (a process: it loads vLLM's renderer, which the test process need not, and its log is read)
    here = start_gateway(databases.new(db_kind), "--mode", "exact", *local_render(vllm), process=True)
    endless = "[a-z]{500}"  # longer than the calls' max_tokens: every reply is cut

    expected = [rollout_turns(by_backend, stream) for stream in (False, True)]
    cut = chat_turns(by_backend, endless)
    before = renders_served(vllm)
    local = [rollout_turns(here, stream) for stream in (False, True)]
    local_cut = chat_turns(here, endless)

    for (replies, turns), (local_replies, local_turns) in zip(expected, local, strict=True):
        assert without_call_ids(local_replies) == without_call_ids(replies)
        assert [kept(t) for t in local_turns] == [kept(t) for t in turns]
        assert [t["splice"] for t in local_turns] == ["render"] + ["exact"] * (TURNS - 1)
    assert [kept(t) for t in local_cut] == [kept(t) for t in cut]
    assert [t["finish_reason"] for t in local_cut] == ["length"] * 3
    assert [t["splice"] for t in local_cut] == ["render", "exact", "exact"]
    assert renders_served(vllm) - before == 1  # the first turn, rendered by both to compare
    assert "the gateway's render of tiny matches its backend's" in here.log_path.read_text()


def test_local_render_unlike_the_backends_leaves_rendering_to_the_backend(
    start_gateway, databases, db_kind, vllm, work_dir
):
    other = work_dir / "other-template.jinja"
    other.write_text(CHAT_TEMPLATE.replace("<|im_start|>", "<|im_start|> "))
    by_backend = start_gateway(databases.new(db_kind), "--mode", "exact")
    here = start_gateway(
        databases.new(db_kind),
        "--mode",
        "exact",
        *local_render(vllm, "--chat-template", str(other)),
        process=True,
    )

    turns = chat_turns(by_backend)
    before = renders_served(vllm)
    local_turns = chat_turns(here)

    assert [kept(t) for t in local_turns] == [kept(t) for t in turns]
    assert [t["splice"] for t in local_turns] == ["render", "exact", "exact"]
    assert renders_served(vllm) - before == 3
    log = here.log_path.read_text()
    assert log.count("the gateway's render of tiny differs from its backend's") == 1
    assert "matches its backend's" not in log


def test_a_request_the_local_render_refuses_gets_the_backends_own_answer(
    start_gateway, databases, db_kind, vllm
):
    gateway = start_gateway(databases.new(db_kind), "--mode", "exact", *local_render(vllm), process=True)
    rollout = httpx.post(gateway.url + "/rollouts", json={}, timeout=TIMEOUT).json()
    agent = sync_agent(rollout["base_url"])
    agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    failing = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "chat_template": "{{ raise_exception('this template refuses every conversation') }}",
    }

    response = httpx.post(rollout["base_url"] + "/chat/completions", json=failing, timeout=TIMEOUT)
    direct = httpx.post(
        vllm.url + "/v1/chat/completions/render", json=failing, headers=VLLM_HEADERS, timeout=TIMEOUT
    )

    assert (response.status_code, direct.status_code) == (400, 400)
    assert response.json()["error"]["message"] == direct.json()["error"]["message"]
    assert "this template refuses every conversation" in response.json()["error"]["message"]
