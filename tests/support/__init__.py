"""Helpers for tests: read what the database holds, ask vLLM for its own tokenization, check errors."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import openai
import pytest

from testbed.vllm_server import VLLMServer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "List a directory.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
LS_TMP_CALL = '<tool_call>{"name": "ls", "arguments": {"path": "/tmp"}}</tool_call>'
LS_TMP_REGEX = r'<tool_call>\{"name": "ls", "arguments": \{"path": "/tmp"\}\}</tool_call>'


TEACHER_CONTEXT = 1024
"""The teacher's context, shorter than the policy's 2,048: a turn can be too long for the teacher."""
VLLM_KEY = "vllm-test-key"
"""The session's vLLM requires it (--api-key); gateways send it as --backend-api-key."""
VLLM_HEADERS = {"authorization": f"Bearer {VLLM_KEY}"}

DEADLINE = 600.0
"""The suite's one deadline, in seconds: for a condition to come true, for a client's call (connecting
included), for a process to start. Tests wait for conditions, never for a time; a condition still false
after the deadline means something is broken, not that the machine is slow."""
TIMEOUT = DEADLINE
"""What every client is given as its timeout, for each phase of a call (connecting included): a number, which
httpx and the SDKs (each on its own HTTP library) all take."""
POLL = 0.05
"""Seconds between two looks at a condition."""


def sync_agent(base_url: str, api_key: str = "unused", **options: Any) -> openai.OpenAI:
    """An agent's SDK client as the tests make it: no retries (a retry would be a second turn) and the suite's
    deadline as its timeout, connecting included; `options` (`max_retries`, `http_client`) where a test
    needs other ones."""
    options.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=TIMEOUT, **options)


def async_agent(base_url: str, api_key: str = "unused", **options: Any) -> openai.AsyncOpenAI:
    """An agent's SDK client, as `sync_agent`'s, for tests that start many agents at once: the SDK's default
    gives a connection 5 s, and a loaded machine's test process can take longer to get back to connections
    a whole group opened at the same moment (a group of 64 once failed on a connect timeout)."""
    options.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=TIMEOUT, **options)


def client_of(gateway: Any) -> Any:
    """What to send requests with: an in-process gateway is its own client; a process is reached over HTTP."""
    return gateway if hasattr(gateway, "request") else httpx


def stored_rollout(gateway: Any, rollout_id: str, token: str | None = None) -> dict[str, Any]:
    """The rollout as users read it back (GET /rollouts/{id}), with full token arrays and messages.

    `gateway` is a gateway process or an in-process client; `token` the control token, if it needs one."""
    response = client_of(gateway).get(
        f"{gateway.url}/rollouts/{rollout_id}",
        params={"include_tokens": "true", "include_messages": "true"},
        headers={"authorization": f"Bearer {token}"} if token else None,
        timeout=60,  # a loaded machine (an engine generating) has taken seconds
    )
    assert response.status_code == 200, response.text
    return response.json()


def tokenize_chat(
    vllm: VLLMServer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    open_reply: bool = False,
) -> list[int]:
    """vLLM's own rendering of a chat prompt, as `/tokenize` gives it; `open_reply`: the last message is the
    model's reply, left open (no generation prompt, no closing)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": messages,
        "add_generation_prompt": not open_reply,
        "continue_final_message": open_reply,
    }
    if tools:
        body["tools"] = tools
    response = httpx.post(vllm.url + "/tokenize", json=body, headers=VLLM_HEADERS, timeout=TIMEOUT)
    response.raise_for_status()
    return response.json()["tokens"]


def detokenize(vllm: VLLMServer, ids: list[int]) -> str:
    response = httpx.post(
        vllm.url + "/detokenize", json={"model": "tiny", "tokens": ids}, headers=VLLM_HEADERS, timeout=TIMEOUT
    )
    response.raise_for_status()
    return response.json()["prompt"]


def run_rollout(
    gateway,
    group_id: str,
    *,
    reward: float | None,
    turns: int = 2,
    status: str = "completed",
    finish: bool = True,
    failing_turn: bool = False,
    tags: list[str] | None = None,
    task_id: str | None = None,
) -> str:
    """A rollout through the real gateway: `turns` chat calls of a growing conversation, then finish."""
    body = {"group_id": group_id, "tags": tags, "task_id": task_id}
    created = httpx.post(gateway.url + "/rollouts", json=body, timeout=TIMEOUT).json()
    rollout_id = created["rollout_id"]
    messages = [{"role": "user", "content": f"Start {group_id}."}]
    for turn in range(turns):
        body = {"model": "tiny", "messages": messages, "max_tokens": 4, "min_tokens": 4, "seed": turn}
        reply = httpx.post(created["base_url"] + "/chat/completions", json=body, timeout=TIMEOUT).json()
        answer = {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
        messages = [*messages, answer, {"role": "user", "content": "More."}]
    if failing_turn:  # a request vLLM refuses: stored as an error turn
        httpx.post(
            created["base_url"] + "/chat/completions", json={**body, "max_tokens": 100_000}, timeout=TIMEOUT
        )
    if finish:
        finish_body = {"status": status} if reward is None else {"status": status, "reward": reward}
        httpx.post(
            f"{gateway.url}/rollouts/{rollout_id}/finish", json=finish_body, timeout=TIMEOUT
        ).raise_for_status()
    return rollout_id


def admin(gateway, path: str, *, timeout: float = 60, **kwargs: Any) -> httpx.Response:
    """A call to the gateway's admin API: GET /admin/state, POST the rest."""
    method = httpx.get if path == "/state" else httpx.post
    return method(f"{gateway.url}/admin{path}", timeout=timeout, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The OpenAI-format error of `response`, checked for its status, code and shape."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["message"]
    return error


def streamed_reply(chunks: Iterable[Any]) -> dict[str, Any]:
    """A streamed chat completion (OpenAI SDK chunks) put together as an agent does: content, reasoning, tool
    calls and finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning", None) or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(
                piece.index, {"id": piece.id, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["function"]["name"] += piece.function.name or ""
            call["function"]["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "tool_calls": list(calls.values()),
        "finish_reason": finish,
    }


def chat(gateway: Any, rollout_id: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """One agent call through the gateway (greedy); the assistant message a harness sends back. With `extra`
    (vLLM sampling fields) the call offers `TOOLS`."""
    agent = sync_agent(gateway.agent_url(rollout_id))
    reply = agent.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=60,
        temperature=0.0,
        extra_body=extra or None,
        tools=TOOLS if extra else openai.NOT_GIVEN,
    )
    return sent_back(reply.choices[0].message)


def sent_back(message: Any) -> dict[str, Any]:
    """An SDK reply's message as a harness sends it back in the next request's history."""
    if message.tool_calls:
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump() for c in message.tool_calls],
        }
    return {"role": "assistant", "content": message.content}


METRIC_SUFFIXES = ("", "_total", "_count", "_sum", "_bucket", "_created")


def scraped(text: str) -> dict[str, float]:
    """Every sample of a /metrics answer, by its name and labels as Prometheus writes them."""
    from prometheus_client.parser import text_string_to_metric_families

    def named(name: str, labels: dict[str, str]) -> str:
        return name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")

    return {
        named(sample.name, sample.labels): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


"""What Prometheus appends to a family's name in its samples (counters, histograms)."""


def metric(gateway: Any, sample: str) -> float:
    """One sample of the gateway's /metrics, named with its labels as Prometheus writes them; 0 if its family
    is there without that sample yet (labels appear with their first value). A family the gateway does not
    export fails the test at once: a renamed metric must not wait out the deadline or pass as 0."""
    lines = httpx.get(f"{gateway.url}/metrics", timeout=TIMEOUT).text.splitlines()
    name = sample.partition("{")[0]
    families = {line.split()[2] for line in lines if line.startswith("# TYPE ")}
    exported = any(name.removesuffix(end) in families for end in METRIC_SUFFIXES if name.endswith(end))
    assert exported, f"/metrics exports no {name}"
    found = next((line for line in lines if line.startswith(sample + " ")), None)
    return float(found.rpartition(" ")[2]) if found is not None else 0.0


def engine_metric(server: Any, family: str) -> float:
    """A vLLM server's samples named `family` in its /metrics, summed over their labels (vLLM labels each by
    engine and model). A name the server does not export fails the test at once, as `metric` does."""
    samples = scraped(httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text)
    found = [value for name, value in samples.items() if name.partition("{")[0] == family]
    assert found, f"vLLM exports no {family}"
    return sum(found)


def wait_for(condition: Callable[[], object], what: str = "the condition") -> None:
    """Return once `condition()` is true; fail after the suite's deadline."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"{what} was still not met after {DEADLINE:.0f} s"
        time.sleep(POLL)


async def until(condition: Callable[[], object], what: str = "the condition") -> None:
    """`wait_for` for the event loop: return once `condition()` is true (awaited, if it is a coroutine)."""
    deadline = time.monotonic() + DEADLINE
    while not await _value(condition()):
        assert time.monotonic() < deadline, f"{what} was still not met after {DEADLINE:.0f} s"
        await asyncio.sleep(POLL)


async def _value(result: object) -> object:
    return await result if inspect.isawaitable(result) else result


def on_store(kind: str) -> pytest.MarkDecorator:
    """A module's `pytestmark` for behaviour that does not depend on the store: its tests run on `kind` alone
    (the store's own behaviour is tested on both)."""
    return pytest.mark.parametrize("db_kind", [kind], indirect=True, scope="session")


def carries_something(chunk: dict[str, Any]) -> bool:
    return not chunk["choices"] or any(c["delta"] or c["finish_reason"] for c in chunk["choices"])


def coalesced(chunks: list[dict[str, Any]], *, call_text: bool = True) -> list[dict[str, Any]]:
    """The chunks with each run of one kind of text (content, reasoning, one tool call) joined into one, and
    a finish chunk's text moved into the run before it, and a chunk of empty text left out. vLLM sends a chunk
    per engine step, and a step brings several tokens when the stream's reader lags, so where a run breaks
    depends on timing, and so does whether a parser writes an empty text for a step of markup alone (seen:
    DeepSeek's, before a tool call). A key without a value does not count: a tool call's chunk from vLLM's
    Hermes parser (Qwen3) carries `content: null`, and its arguments break where the steps fell. Without
    `call_text`, tool calls' text is left out: vLLM's Mistral parser writes a call's arguments differently as
    a step brings one token or several (seen: a leading ': ')."""
    joined: list[dict[str, Any]] = []
    for piece in (piece for chunk in chunks for piece in _finish_apart(chunk)):
        kind = _text_kind(piece)
        if kind is not None and kind[0] != "tool_calls" and not piece["choices"][0]["delta"][kind[0]]:
            continue
        if kind is not None and joined and _text_kind(joined[-1]) == kind:
            _join(joined[-1]["choices"][0]["delta"], piece["choices"][0]["delta"])
        else:
            joined.append(piece)
    if not call_text:
        for chunk in joined:
            for choice in chunk["choices"]:
                for call in (choice.get("delta") or {}).get("tool_calls") or ():
                    call["function"] = dict.fromkeys(call.get("function") or {}, "-")
    return joined


def _finish_apart(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    """A copy of the chunk; a finish chunk with text as two: the text, then the finish with an empty delta."""
    chunk = json.loads(json.dumps(chunk))
    if (
        len(chunk["choices"]) != 1
        or not chunk["choices"][0]["finish_reason"]
        or not chunk["choices"][0]["delta"]
    ):
        return [chunk]
    text, finish = chunk, json.loads(json.dumps(chunk))
    text["choices"][0]["finish_reason"] = None
    finish["choices"][0]["delta"] = {}
    return [text, finish]


def _text_kind(chunk: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a chunk writes if it is one piece of text and nothing else, else None."""
    if len(chunk["choices"]) != 1:
        return None
    choice = chunk["choices"][0]
    delta = {key: value for key, value in choice["delta"].items() if value is not None}
    if choice["finish_reason"] or choice.get("logprobs") or len(delta) != 1:
        return None
    ((key, value),) = delta.items()
    if key in ("content", "reasoning") and isinstance(value, str):
        return (key,)
    if key == "tool_calls" and len(value) == 1:
        return (key, value[0]["index"])
    return None


def _join(into: dict[str, Any], delta: dict[str, Any]) -> None:
    if "tool_calls" not in into:
        ((key, text),) = ((key, value) for key, value in delta.items() if value is not None)
        into[key] += text
        return
    (call,), (piece,) = into["tool_calls"], delta["tool_calls"]
    for key, value in piece.items():
        if key == "function":
            function = call.setdefault("function", {})
            for name, text in (value or {}).items():
                function[name] = (function.get(name) or "") + (text or "")
        elif call.get(key) is None:
            call[key] = value
