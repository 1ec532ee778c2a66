"""Should the gateway translate agent dialects with LiteLLM's layers or its own? This measures both on the
same inputs: Anthropic Messages <-> chat (LiteLLM's Anthropic adapter, `experimental_pass_through/adapters`,
against `gateway.anthropic.translate`) and OpenAI Responses <-> chat (LiteLLM's
`litellm_completion_transformation` against `gateway.responses`), per call, for a realistic agent request (a
20-turn tool-using conversation with a system prompt, tools, thinking, tool calls and results), a whole reply
and a stream; what loading LiteLLM costs the gateway process; and a table of what each layer keeps of what
training and agents need.

    scripts/dev bench   (or, in scripts/dev shell: python bench/dialect_translation.py; about 20 s, no engine)

LiteLLM's layers take its own objects (`ModelResponse`, `ModelResponseStream`), so their timings include
building those from vLLM's JSON (the gateway holds dicts), and also show the adapter alone. Replies and chunks
are as the gateway's dialect wire receives them: vLLM's, with the ids and logprobs the gateway asked for
already taken out. The end-to-end rows send LiteLLM's full `/v1/messages` path (`hosted_vllm/` provider, the
one that goes through chat) to a local server that records what would reach vLLM.
"""

from __future__ import annotations

import asyncio
import copy
import http.server
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM downloads a price list at import

import litellm
from litellm.llms.anthropic.experimental_pass_through.adapters.streaming_iterator import (
    AnthropicStreamWrapper,
)
from litellm.llms.anthropic.experimental_pass_through.adapters.transformation import (
    LiteLLMAnthropicMessagesAdapter,
)
from litellm.responses.litellm_completion_transformation.transformation import (
    LiteLLMCompletionResponsesConfig,
)
from litellm.types.utils import ModelResponse, ModelResponseStream

from gateway.anthropic import translate as messages_ours
from gateway.errors import ApiError
from gateway.responses import items as responses_items
from gateway.responses import translate as responses_ours

TURNS = 20
REPEATS = 7
Chat = dict[str, Any]
Events = list[Any]


# Inputs --------------------------------------------------------------------------------------------------


def words(seed: int, count: int) -> str:
    """Deterministic filler text, so every run measures the same bytes."""
    return " ".join(f"w{(seed * 31 + k * 7) % 997}" for k in range(count))


def schema(*names: str) -> dict[str, Any]:
    properties = {name: {"type": "string", "description": words(len(name), 6)} for name in names}
    return {"type": "object", "properties": properties, "required": list(names)}


TOOLS = [
    ("bash", "Run a shell command and return its output.", schema("command", "cwd")),
    ("read_file", "Read a file of the repository.", schema("path")),
    ("edit_file", "Replace a string in a file.", schema("path", "old", "new")),
]


def messages_request() -> dict[str, Any]:
    """A Claude-Code-like Messages request: system prompt blocks, three tools, and 20 turns of thinking, text
    and a tool call answered by a tool result (every other one as text blocks), then a question."""
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "Fix the failing test. " + words(0, 30)}
    ]
    for turn in range(TURNS):
        name = TOOLS[turn % len(TOOLS)][0]
        result: Any = words(turn + 100, 28)
        if turn % 2:
            result = [{"type": "text", "text": result[:80]}, {"type": "text", "text": result[80:]}]
        conversation += [
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": words(turn + 200, 12), "signature": "sig"},
                    {"type": "text", "text": words(turn + 300, 8)},
                    {
                        "type": "tool_use",
                        "id": f"toolu_{turn:02d}",
                        "name": name,
                        "input": {"path": f"src/m{turn}.py"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": f"toolu_{turn:02d}", "content": result}],
            },
        ]
    conversation.append({"role": "user", "content": "Now run the tests again."})
    return {
        "model": "tiny",
        "max_tokens": 512,
        "system": [
            {"type": "text", "text": "You are a coding agent. " + words(1, 120)},
            {"type": "text", "text": words(2, 60)},
        ],
        "tools": [
            {"name": name, "description": text, "input_schema": params} for name, text, params in TOOLS
        ],
        "tool_choice": {"type": "auto"},
        "temperature": 1.0,
        "messages": conversation,
    }


def responses_request(messages: dict[str, Any]) -> dict[str, Any]:
    """The same conversation as a Responses request (Codex-like): instructions and input items."""
    items: list[dict[str, Any]] = []
    for message in messages["messages"]:
        content = message["content"]
        if isinstance(content, str):
            items.append(
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": content}]}
            )
            continue
        for block in content:
            items += responses_items_of(block)
    system = "".join(block["text"] for block in messages["system"])
    tools = [
        {
            "type": "function",
            "name": tool["name"],
            "description": tool["description"],
            "parameters": tool["input_schema"],
        }
        for tool in messages["tools"]
    ]
    return {"model": "tiny", "instructions": system, "input": items, "tools": tools, "max_output_tokens": 512}


def responses_items_of(block: dict[str, Any]) -> list[dict[str, Any]]:
    kind = block["type"]
    if kind == "thinking":
        return [
            {
                "type": "reasoning",
                "id": "rs_x",
                "summary": [{"type": "summary_text", "text": block["thinking"]}],
            }
        ]
    if kind == "text":
        part = {"type": "output_text", "text": block["text"], "annotations": []}
        return [{"type": "message", "role": "assistant", "content": [part]}]
    if kind == "tool_use":
        arguments = json.dumps(block["input"])
        return [
            {"type": "function_call", "call_id": block["id"], "name": block["name"], "arguments": arguments}
        ]
    text = (
        block["content"]
        if isinstance(block["content"], str)
        else "".join(b["text"] for b in block["content"])
    )
    return [{"type": "function_call_output", "call_id": block["tool_use_id"], "output": text}]


def chat_reply(
    finish: str = "tool_calls", stop_reason: str | None = None, engine_ids: bool = False
) -> dict[str, Any]:
    """vLLM's whole chat reply with reasoning, text and a tool call; with `engine_ids`, as vLLM sends it to
    the gateway (ids, logprobs), else as the dialect wire receives it (the gateway took them out)."""
    ids = list(range(64))
    logprobs = {"content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []} for _ in ids]}
    call = {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "bash", "arguments": '{"command": "pytest -x"}'},
    }
    message = {"role": "assistant", "content": words(5, 40), "reasoning": words(6, 30), "tool_calls": [call]}
    return {
        "id": "chatcmpl-b1",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs if engine_ids else None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": ids if engine_ids else None,
            }
        ],
        "usage": {"prompt_tokens": 3200, "completion_tokens": 64, "total_tokens": 3264},
        "prompt_token_ids": list(range(3200)) if engine_ids else None,
    }


def chat_chunks(finish: str = "tool_calls", stop_reason: str | None = None) -> list[dict[str, Any]]:
    """vLLM's stream for the same reply, one token a chunk: role, 16 reasoning deltas, 24 text deltas, a tool
    call (id and name with the first argument piece, then 22 pieces), the finish chunk and the usage chunk."""

    def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
            "token_ids": None,
        }
        return {
            "id": "chatcmpl-s1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "tiny",
            "choices": [choice],
            **extra,
        }

    chunks = [chunk({"role": "assistant", "content": ""}, prompt_token_ids=None)]
    chunks += [chunk({"reasoning": f"r{i} "}) for i in range(16)]
    chunks += [chunk({"content": f"t{i} "}) for i in range(24)]
    pieces = ['{"comm', 'and": "', *[f"p{i} " for i in range(20)], '"}']
    first = {
        "index": 0,
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "bash", "arguments": pieces[0]},
    }
    chunks.append(chunk({"tool_calls": [first]}))
    chunks += [
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}) for piece in pieces[1:]
    ]
    end = chunk({"content": ""}, finish)
    end["choices"][0]["stop_reason"] = stop_reason
    usage = {"prompt_tokens": 3200, "completion_tokens": len(chunks), "total_tokens": 3200 + len(chunks)}
    return [*chunks, end, {**chunk({}), "choices": [], "usage": usage}]


STREAM_ARGUMENTS = '{"command": "' + "".join(f"p{i} " for i in range(20)) + '"}'


# The translations under test -----------------------------------------------------------------------------


def litellm_messages_to_chat(body: dict[str, Any]) -> Chat:
    chat, _names = LiteLLMAnthropicMessagesAdapter().translate_anthropic_to_openai(dict(body))
    return dict(chat)


def litellm_chat_to_message(payload: dict[str, Any]) -> dict[str, Any]:
    reply = LiteLLMAnthropicMessagesAdapter().translate_openai_response_to_anthropic(ModelResponse(**payload))
    return dict(reply)


def litellm_chunks(chunks: list[dict[str, Any]]) -> list[ModelResponseStream]:
    """vLLM's chunks as LiteLLM's stream wrapper hands them on: its objects, and a usage chunk with one empty
    choice (vLLM's has none, which the adapter cannot take: see the table)."""
    shaped = [c if c["choices"] else {**c, "choices": [{"index": 0, "delta": {}}]} for c in chunks]
    return [ModelResponseStream(**copy.deepcopy(c)) for c in shaped]


async def _aiter(values: list[Any]) -> AsyncIterator[Any]:
    for value in values:
        yield value


async def litellm_stream_events(objects: list[ModelResponseStream]) -> Events:
    """LiteLLM's Anthropic stream (its async path, the one its proxy serves) over a stream of chunks."""
    return [event async for event in AnthropicStreamWrapper(_aiter(objects), model="tiny")]


def ours_stream_events(chunks: list[dict[str, Any]]) -> Events:
    translator = messages_ours.StreamTranslator()
    events: Events = []
    for chunk in chunks:
        events += translator.chunk(chunk)
    return events + translator.end()


def litellm_responses_to_chat(body: dict[str, Any]) -> Chat:
    params = {k: v for k, v in body.items() if k not in ("model", "input")}
    return LiteLLMCompletionResponsesConfig.transform_responses_api_request_to_chat_completion_request(
        model=body["model"], input=body["input"], responses_api_request=params
    )


def litellm_chat_to_response(body: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    params = {k: v for k, v in body.items() if k not in ("model", "input")}
    response = LiteLLMCompletionResponsesConfig.transform_chat_completion_response_to_responses_api_response(
        request_input=body["input"], responses_api_request=params, chat_completion_response=payload
    )
    return response.model_dump()


def ours_responses_to_chat(body: dict[str, Any]) -> Chat:
    return responses_ours.to_chat(body, [])[0]


def ours_chat_to_response(
    body: dict[str, Any], payload: dict[str, Any], names: responses_ours.ToolNames
) -> dict[str, Any]:
    """Our whole response; `names` (how tool names map back) come from the request's translation."""
    shape = responses_items.ResponseShape("resp_b1", body, names, 1.0)
    return responses_items.whole_response(shape, payload)


def tool_names(body: dict[str, Any]) -> responses_ours.ToolNames:
    return responses_ours.chat_tools(body.get("tools"))[1]


def ours_response_stream(body: dict[str, Any], chunks: list[dict[str, Any]]) -> Events:
    shape = responses_items.ResponseShape("resp_b1", body, responses_ours.ToolNames(), 1.0)
    stream = responses_items.ResponseStream(shape, "tiny")
    events = stream.start()
    for chunk in chunks:
        events += stream.chunk(chunk)
    return events + stream.end()


# Timing ---------------------------------------------------------------------------------------------------


def per_call_us(call: Callable[[Any], object], inputs: list[Any]) -> float:
    """Median over REPEATS runs of the mean time per call, in microseconds, each call on its own fresh copy
    of the input (LiteLLM's adapters pop fields from what they are given)."""
    runs = []
    for _ in range(REPEATS):
        copies = [copy.deepcopy(value) for value in inputs]
        started = time.perf_counter()
        for value in copies:
            call(value)
        runs.append((time.perf_counter() - started) / len(copies) * 1e6)
    return statistics.median(runs)


def per_stream_us(drain: Callable[[list[Any]], object], stream: list[Any], loops: int) -> float:
    """Median over REPEATS runs of the time to translate a whole stream, in microseconds."""
    runs = []
    for _ in range(REPEATS):
        copies = [copy.deepcopy(stream) for _ in range(loops)]
        started = time.perf_counter()
        for chunks in copies:
            drain(chunks)
        runs.append((time.perf_counter() - started) / loops * 1e6)
    return statistics.median(runs)


def litellm_stream_us(chunks: list[dict[str, Any]], loops: int, parse: bool) -> float:
    """LiteLLM's stream per whole stream: building its chunk objects from vLLM's (`parse`) and its adapter,
    run in one event loop as the proxy runs it."""

    async def run() -> float:
        runs = []
        for _ in range(REPEATS):
            prepared = [copy.deepcopy(chunks) if parse else litellm_chunks(chunks) for _ in range(loops)]
            started = time.perf_counter()
            for stream in prepared:
                await litellm_stream_events(litellm_chunks(stream) if parse else stream)
            runs.append((time.perf_counter() - started) / loops * 1e6)
        return statistics.median(runs)

    return asyncio.run(run())


_IMPORT_PROBE = """
import time, gateway.app
def rss():
    return int(next(x for x in open("/proc/self/status") if x.startswith("VmRSS")).split()[1]) / 1024
before, started = rss(), time.perf_counter()
import litellm
from litellm.llms.anthropic.experimental_pass_through.adapters import transformation
from litellm.responses.litellm_completion_transformation import transformation as responses
print(time.perf_counter() - started, rss() - before)
"""


def import_cost() -> tuple[float, float]:
    """Seconds and MB of RSS that importing LiteLLM's layers adds to a process that has loaded the gateway
    (median of three fresh interpreters)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = []
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _IMPORT_PROBE], env=env, capture_output=True, text=True, check=True
        )
        runs.append([float(value) for value in done.stdout.split()])
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


# What each layer keeps ------------------------------------------------------------------------------------

Row = tuple[str, str, str]
LS_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
LS_CHOICE = {"type": "function", "function": {"name": "ls"}}


def compare(name: str, check: Callable[[Any], str], lite: Any, ours: Any) -> Row:
    """One table row: the same check on LiteLLM's output and ours."""
    return name, check(lite), check(ours)


def yes_no(ok: bool, otherwise: str) -> str:
    return "yes" if ok else f"no: {otherwise}"


def first(messages: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return next((m for m in messages if m.get("role") == role), {})


def content_shape(value: Any) -> str:
    """A short description of a message's content: the text, or the types of its parts."""
    if not isinstance(value, list):
        return repr(value)
    kinds = ", ".join(str(part.get("type")) for part in value)
    return f"{len(value)} part{'s' if len(value) != 1 else ''}: {kinds}"


def probe_messages(**extra: Any) -> dict[str, Any]:
    """A small Messages request with every feature the table asks about."""
    assistant = [
        {"type": "thinking", "thinking": "Look first.", "signature": "sig"},
        {"type": "tool_use", "id": "toolu_01", "name": "ls", "input": {"path": "/tmp"}},
    ]
    result = [{"type": "text", "text": "a.txt"}, {"type": "text", "text": "b.txt"}]
    return {
        "model": "tiny",
        "max_tokens": 64,
        "top_k": 5,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        "stop_sequences": ["END"],
        "tool_choice": {"type": "tool", "name": "ls"},
        "tools": [{"name": "ls", "description": "List a directory.", "input_schema": LS_SCHEMA}],
        "messages": [
            {"role": "user", "content": "What is in /tmp?"},
            {"role": "assistant", "content": assistant},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": result}],
            },
        ],
        **extra,
    }


def probe_responses() -> dict[str, Any]:
    """A small Responses request with every feature the table asks about."""
    tool = {"type": "function", "name": "ls", "description": "List a directory.", "parameters": LS_SCHEMA}
    return {
        "model": "tiny",
        "instructions": "Be brief.",
        "max_output_tokens": 64,
        "top_k": 5,
        "min_tokens": 2,
        "temperature": 0.5,
        "tool_choice": {"type": "function", "name": "ls"},
        "tools": [tool],
        "input": [
            {"type": "message", "role": "developer", "content": "Prefer ls."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "What is in /tmp?"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Look first."}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Listing."}],
            },
            {"type": "function_call", "call_id": "call_01", "name": "ls", "arguments": '{"path": "/tmp"}'},
            {"type": "function_call_output", "call_id": "call_01", "output": "a.txt"},
        ],
    }


class Recorder(http.server.BaseHTTPRequestHandler):
    """A stand-in for vLLM's chat endpoint: records every request body, answers a canned reply."""

    seen: ClassVar[list[dict[str, Any]]] = []
    reply: ClassVar[bytes] = b""

    def do_POST(self) -> None:
        self.seen.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(self.reply)))
        self.end_headers()
        self.wfile.write(self.reply)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def recording_server(reply: dict[str, Any]) -> Iterator[str]:
    """A local server in place of vLLM; yields its base URL."""
    Recorder.reply = orjson.dumps(reply)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        server.shutdown()


def litellm_messages_end_to_end(body: dict[str, Any], reply: dict[str, Any]) -> tuple[Chat, dict[str, Any]]:
    """LiteLLM's whole `/v1/messages` path for a vLLM served through chat (`hosted_vllm/`; `openai/` models
    go through the Responses API instead): the chat body that would reach vLLM, and the Messages reply
    LiteLLM makes of vLLM's answer."""
    fields = {k: v for k, v in body.items() if k != "model"}
    with recording_server(reply) as base_url:
        answer = litellm.anthropic.messages.create(
            model="hosted_vllm/tiny", api_base=base_url, api_key="unused", **fields
        )
    return Recorder.seen[-1], dict(answer)


def messages_request_rows() -> list[Row]:
    body = probe_messages()
    adapter, ours = litellm_messages_to_chat(copy.deepcopy(body)), messages_ours.to_chat(copy.deepcopy(body))
    wire, _ = litellm_messages_end_to_end(copy.deepcopy(body), chat_reply())
    image_body = probe_messages(messages=[{"role": "user", "content": [IMAGE]}])
    image_adapter = litellm_messages_to_chat(copy.deepcopy(image_body))
    try:
        image_ours = content_shape(
            first(messages_ours.to_chat(image_body)["messages"], "user").get("content")
        )
    except ApiError as error:
        image_ours = f"400 {error.code}"

    def ids(chat: Chat) -> str:
        call = (first(chat["messages"], "assistant").get("tool_calls") or [{}])[0]
        return yes_no(
            call.get("id") == first(chat["messages"], "tool").get("tool_call_id") == "toolu_01", "lost"
        )

    def thinking(chat: Chat) -> str:
        reply = first(chat["messages"], "assistant")
        if reply.get("reasoning") == "Look first.":
            return "yes"
        return (
            "no: `thinking_blocks`"
            if "thinking_blocks" in reply
            else f"no: {content_shape(reply['content'])}"
        )

    def stop(chat: Chat) -> str:
        return yes_no(
            chat.get("stop") == ["END"], f"sent as {[k for k in chat if 'stop' in k]}, vLLM ignores it"
        )

    def choice(chat: Chat) -> str:
        return yes_no(chat.get("tool_choice") == LS_CHOICE, repr(chat.get("tool_choice")))

    return [
        compare("tool_use id -> call id, tool_call_id", ids, wire, ours),
        (
            "thinking block -> assistant `reasoning`",
            f"adapter {thinking(adapter)}; wire {thinking(wire)}",
            thinking(ours),
        ),
        compare("tool_choice {type: tool} -> that function", choice, wire, ours),
        compare("stop_sequences -> `stop`", stop, wire, ours),
        compare(
            "system prompt blocks ->",
            lambda c: content_shape(first(c["messages"], "system")["content"]),
            wire,
            ours,
        ),
        compare(
            "tool_result blocks ->",
            lambda c: content_shape(first(c["messages"], "tool")["content"]),
            wire,
            ours,
        ),
        ("image block ->", content_shape(first(image_adapter["messages"], "user")["content"]), image_ours),
        compare("top_k passed on", lambda c: yes_no(c.get("top_k") == 5, "dropped"), wire, ours),
    ]


def stop_mapping(translate: Callable[[dict[str, Any]], dict[str, Any]]) -> str:
    """What finish reasons stop, length, tool_calls and stop on the string 'END' become."""
    results = []
    for finish, matched in (("stop", None), ("length", None), ("tool_calls", None), ("stop", "END")):
        reply = translate(chat_reply(finish, matched))
        results.append(
            " ".join(str(reply[key]) for key in ("stop_reason", "stop_sequence") if reply.get(key))
        )
    return " / ".join(results)


def messages_reply_rows() -> list[Row]:
    lite = litellm_chat_to_message(chat_reply(engine_ids=True))
    ours = messages_ours.message(chat_reply(engine_ids=True))
    _, end_to_end = litellm_messages_end_to_end(probe_messages(), chat_reply())

    def call_id(reply: dict[str, Any]) -> str:
        uses = [b for b in reply["content"] if b["type"] == "tool_use"]
        return yes_no(bool(uses) and uses[0].get("id") == "chatcmpl-tool-1", "lost")

    def thinking(reply: dict[str, Any]) -> str:
        return yes_no(any(b["type"] == "thinking" and b.get("thinking") for b in reply["content"]), "dropped")

    def carried(reply: dict[str, Any]) -> str:
        text = json.dumps(reply, default=str)
        return "yes" if "token_ids" in text or "logprob" in text else "no (Messages has no field)"

    return [
        compare("tool-call id kept", call_id, lite, ours),
        (
            "stop, length, tool_calls, stop on 'END' ->",
            stop_mapping(litellm_chat_to_message),
            stop_mapping(messages_ours.message),
        ),
        (
            "vLLM `reasoning` -> thinking block",
            f"adapter {thinking(lite)}; hosted_vllm path {thinking(end_to_end)}",
            thinking(ours),
        ),
        compare("engine token ids / logprobs in the reply", carried, lite, ours),
        compare("message id", lambda reply: str(reply["id"]), lite, ours),
    ]


def event_dicts(events: Events) -> list[dict[str, Any]]:
    """Events as Messages event objects (ours are (name, data) pairs)."""
    return [event[1] if isinstance(event, tuple) else event for event in events]


_DELTA_KEYS = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
_BLOCK_OF = {"text": "text", "thinking": "thinking", "partial_json": "tool_use"}


def stream_summary(events: Events) -> dict[str, Any]:
    """What an Anthropic client assembles from a Messages event stream, and how many deltas came in a block
    of another type."""
    blocks: dict[int, dict[str, Any]] = {}
    summary: dict[str, Any] = {"text": "", "thinking": "", "partial_json": "", "misplaced": 0, "final": {}}
    for event in event_dicts(events):
        if event["type"] == "content_block_start":
            blocks[event["index"]] = event["content_block"]
            if event["content_block"]["type"] == "tool_use":
                summary["tool_id"] = event["content_block"].get("id")
        elif event["type"] == "content_block_delta":
            key = _DELTA_KEYS[event["delta"]["type"]]
            summary[key] += event["delta"][key]
            summary["misplaced"] += blocks.get(event["index"], {}).get("type") != _BLOCK_OF[key]
        elif event["type"] == "message_delta":
            summary["final"] = {**event["delta"], **(event.get("usage") or {})}
    summary["stopped"] = bool(events) and event_dicts(events)[-1]["type"] == "message_stop"
    return summary


def litellm_events(chunks: list[dict[str, Any]]) -> Events:
    return asyncio.run(litellm_stream_events(litellm_chunks(chunks)))


def litellm_event_steps(chunks: list[dict[str, Any]]) -> Iterator[Any]:
    """LiteLLM's async stream stepped one event at a time, so two can run interleaved."""
    wrapper = AnthropicStreamWrapper(_aiter(litellm_chunks(chunks)), model="tiny")
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(wrapper.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.close()


def ours_event_steps(chunks: list[dict[str, Any]]) -> Iterator[Any]:
    yield from event_dicts(ours_stream_events(chunks))


def without_message_id(events: list[Any]) -> list[str]:
    """Events comparable across streams (message ids are random)."""
    return [json.dumps(e, sort_keys=True, default=str) for e in events if e.get("type") != "message_start"]


def kept_apart(steps: Callable[[list[dict[str, Any]]], Iterator[Any]], chunks: list[dict[str, Any]]) -> str:
    """Whether two streams translated at the same time, event by event, each give what one alone gives."""
    alone = without_message_id(list(steps(chunks)))
    streams: list[tuple[Iterator[Any], list[Any]]] = [(steps(chunks), []), (steps(chunks), [])]
    for _ in range(len(alone) + 1):
        for iterator, got in streams:
            got.extend(event for event in [next(iterator, None)] if event is not None)
    return yes_no(all(without_message_id(got) == alone for _, got in streams), "events cross streams")


def messages_stream_rows() -> list[Row]:
    chunks = chat_chunks()
    lite, ours = stream_summary(litellm_events(chunks)), stream_summary(ours_stream_events(chunks))
    lite_stop = stream_summary(litellm_events(chat_chunks("stop", "END")))
    ours_stop = stream_summary(ours_stream_events(chat_chunks("stop", "END")))
    raw_usage = [ModelResponseStream(**copy.deepcopy(c)) for c in chunks]  # vLLM's usage chunk as it is
    try:
        raw = yes_no(
            stream_summary(asyncio.run(litellm_stream_events(raw_usage)))["stopped"], "no message_stop"
        )
    except Exception as error:  # what the agent's stream would end with
        raw = f"no: {type(error).__name__}"

    def tool(summary: dict[str, Any]) -> str:
        if summary["partial_json"] != STREAM_ARGUMENTS:
            return f"no: input {summary['partial_json'][:16]!r}..."
        return yes_no(summary.get("tool_id") == "chatcmpl-tool-1", "id lost")

    def thinking(summary: dict[str, Any]) -> str:
        text = "".join(f"r{i} " for i in range(16))
        return yes_no(
            summary["thinking"] == text and not summary["misplaced"],
            f"{summary['misplaced']} in a text block",
        )

    def text(summary: dict[str, Any]) -> str:
        return yes_no(summary["text"] == "".join(f"t{i} " for i in range(24)), "differs")

    def stop(summary: dict[str, Any]) -> str:
        return " ".join(str(summary["final"].get(key)) for key in ("stop_reason", "stop_sequence"))

    return [
        compare("tool_use id and the arguments vLLM streamed", tool, lite, ours),
        compare("reasoning deltas in a thinking block", thinking, lite, ours),
        compare("text deltas = vLLM's text", text, lite, ours),
        compare("stop on 'END' -> message_delta", stop, lite_stop, ours_stop),
        compare("output_tokens in message_delta", lambda s: str(s["final"].get("output_tokens")), lite, ours),
        ("vLLM's usage chunk (no choices) taken", raw, yes_no(ours["stopped"], "no message_stop")),
        (
            "two streams at once kept apart",
            kept_apart(litellm_event_steps, chunks),
            kept_apart(ours_event_steps, chunks),
        ),
    ]


def responses_request_rows() -> list[Row]:
    body = probe_responses()
    lite, ours = litellm_responses_to_chat(copy.deepcopy(body)), ours_responses_to_chat(copy.deepcopy(body))

    def ids(chat: Chat) -> str:
        calls = [call for m in chat["messages"] for call in m.get("tool_calls") or ()]
        kept = (
            bool(calls)
            and calls[0].get("id") == first(chat["messages"], "tool").get("tool_call_id") == "call_01"
        )
        return yes_no(kept, "lost")

    def reasoning(chat: Chat) -> str:
        return yes_no(any(m.get("reasoning") == "Look first." for m in chat["messages"]), "dropped")

    def choice(chat: Chat) -> str:
        return yes_no(chat.get("tool_choice") == LS_CHOICE, repr(chat.get("tool_choice")))

    return [
        compare("call_id -> call id, tool_call_id", ids, lite, ours),
        compare("reasoning item -> assistant `reasoning`", reasoning, lite, ours),
        compare("tool_choice {type: function, name} -> that function", choice, lite, ours),
        compare(
            "roles (a developer message first)",
            lambda c: ", ".join(m["role"] for m in c["messages"]),
            lite,
            ours,
        ),
        compare(
            "vLLM's top_k, min_tokens passed on",
            lambda c: yes_no("top_k" in c and "min_tokens" in c, "dropped"),
            lite,
            ours,
        ),
        compare(
            "max_output_tokens -> max_tokens",
            lambda c: yes_no(c.get("max_tokens") == 64, "dropped"),
            lite,
            ours,
        ),
    ]


def responses_reply_rows() -> list[Row]:
    body, names = probe_responses(), tool_names(probe_responses())
    lite = litellm_chat_to_response(body, chat_reply(engine_ids=True))
    ours = ours_chat_to_response(body, chat_reply(engine_ids=True), names)
    cut_lite = litellm_chat_to_response(body, chat_reply("length"))
    cut_ours = ours_chat_to_response(body, chat_reply("length"), names)

    def call_id(response: dict[str, Any]) -> str:
        return yes_no(any(item.get("call_id") == "chatcmpl-tool-1" for item in response["output"]), "lost")

    def reasoning(response: dict[str, Any]) -> str:
        return yes_no(any(item["type"] == "reasoning" for item in response["output"]), "dropped")

    def echoed(response: dict[str, Any]) -> str:
        kept = response.get("instructions") == "Be brief." and response.get("temperature") == 0.5
        return yes_no(kept and bool(response.get("tools")), f"instructions {response.get('instructions')!r}")

    def logprobs(response: dict[str, Any]) -> str:
        parts = [p for item in response["output"] if item["type"] == "message" for p in item["content"]]
        return "yes" if any(p.get("logprobs") for p in parts) else "no"

    return [
        compare("function_call call_id kept", call_id, lite, ours),
        compare("vLLM `reasoning` -> reasoning item", reasoning, lite, ours),
        compare(
            "finish length ->", lambda r: f"{r['status']}, {r.get('incomplete_details')}", cut_lite, cut_ours
        ),
        compare("object, id", lambda r: f"{r['object']}, {r['id']}", lite, ours),
        compare("request echoed (instructions, tools, temperature)", echoed, lite, ours),
        compare("engine logprobs in output_text", logprobs, lite, ours),
    ]


# Report ---------------------------------------------------------------------------------------------------


def timing_line(label: str, lite: float | None, ours: float | None, unit: str = "us/call") -> str:
    cells = [f"{value:9.1f}" if value is not None else f"{'-':>9}" for value in (lite, ours)]
    ratio = f"{lite / ours:7.1f}x" if lite is not None and ours else f"{'-':>8}"
    return f"  {label:<50} {cells[0]} {cells[1]} {ratio}   {unit}"


def print_table(title: str, rows: list[Row], *notes: str) -> None:
    widths = [max(len(row[column]) for row in rows) for column in (0, 1)]
    print(f"\n{title}\n  {'':<{widths[0]}}  {'LiteLLM':<{widths[1]}}  ours")
    for name, lite, ours in rows:
        print(f"  {name:<{widths[0]}}  {lite:<{widths[1]}}  {ours}")
    for note in notes:
        print(f"  * {note}")


def adapter_alone_us(reply: dict[str, Any]) -> float:
    """LiteLLM's Messages reply adapter on ModelResponse objects built beforehand."""
    adapter = LiteLLMAnthropicMessagesAdapter()
    runs = []
    for _ in range(REPEATS):
        parsed = [ModelResponse(**copy.deepcopy(reply)) for _ in range(300)]
        started = time.perf_counter()
        for response in parsed:
            adapter.translate_openai_response_to_anthropic(response)
        runs.append((time.perf_counter() - started) / len(parsed) * 1e6)
    return statistics.median(runs)


def print_timings() -> None:
    body = messages_request()
    responses = responses_request(body)
    names = tool_names(responses)
    reply, chunks = chat_reply(), chat_chunks()
    n = len(chunks)
    print(f"\n{f'Per call, median of {REPEATS} runs':<52} {'LiteLLM':>9} {'ours':>9} {'ratio':>8}")
    print(f"Anthropic Messages: a {TURNS}-turn tool-using request of {len(orjson.dumps(body)) / 1024:.1f} KB")
    print(
        timing_line(
            "request Messages -> chat",
            per_call_us(litellm_messages_to_chat, [body] * 100),
            per_call_us(messages_ours.to_chat, [body] * 100),
        )
    )
    ours_whole = per_call_us(messages_ours.message, [reply] * 300)
    print(
        timing_line(
            "whole reply chat -> Messages", per_call_us(litellm_chat_to_message, [reply] * 300), ours_whole
        )
    )
    print(
        timing_line("  LiteLLM's adapter alone (objects built before)", adapter_alone_us(reply), ours_whole)
    )
    ours_chunk = per_stream_us(ours_stream_events, chunks, 50) / n
    print(
        timing_line(
            f"stream chat -> Messages ({n} chunks)",
            litellm_stream_us(chunks, 20, parse=True) / n,
            ours_chunk,
            "us/chunk",
        )
    )
    print(
        timing_line(
            "  LiteLLM's adapter alone (objects built before)",
            litellm_stream_us(chunks, 20, parse=False) / n,
            ours_chunk,
            "us/chunk",
        )
    )
    size = len(orjson.dumps(responses)) / 1024
    print(f"OpenAI Responses: the same conversation as {len(responses['input'])} input items, {size:.1f} KB")
    print(
        timing_line(
            "request Responses -> chat",
            per_call_us(litellm_responses_to_chat, [responses] * 100),
            per_call_us(ours_responses_to_chat, [responses] * 100),
        )
    )
    print(
        timing_line(
            "whole reply chat -> Responses",
            per_call_us(lambda payload: litellm_chat_to_response(responses, payload), [reply] * 300),
            per_call_us(lambda payload: ours_chat_to_response(responses, payload, names), [reply] * 300),
        )
    )
    ours_responses_chunk = per_stream_us(lambda c: ours_response_stream(responses, c), chunks, 50) / n
    print(timing_line(f"stream chat -> Responses ({n} chunks)", None, ours_responses_chunk, "us/chunk"))
    print(
        "  LiteLLM's request timings are its translation alone: its full path then maps the parameters again"
    )
    print("  in litellm.completion. Its Responses stream iterator needs a live litellm.completion stream:")
    print("  not run.")


def main() -> int:
    seconds, megabytes = import_cost()
    version = importlib.metadata.version("litellm")
    print(f"LiteLLM {version}: importing its layers into a process that has loaded")
    print(f"the gateway takes {seconds:.2f} s and adds {megabytes:.0f} MB of RSS")
    print_timings()
    print_table(
        "Messages request -> chat (LiteLLM: on the wire through hosted_vllm/, and its adapter's output)",
        messages_request_rows(),
        "vLLM reads a `thinking` content part as text (TEXT_PART_TYPES in vllm/renderers/chat_utils.py): the",
        "  model would see its earlier thinking as answer text, not as reasoning.",
        "Text part lists are left to vLLM's renderer, which joins them with a newline for templates that",
        "  take string content; ours joins the blocks without one, as vLLM's own /v1/messages does a system",
        "  prompt.",
    )
    print_table("chat reply -> Messages, whole", messages_reply_rows())
    print_table(
        "chat stream -> Messages events (LiteLLM: its async stream wrapper, as its proxy serves it)",
        messages_stream_rows(),
        "LiteLLM drops the chunk that opens a block (the tool call's first argument piece here) and keeps",
        "  its event queue in a class attribute that every stream shares.",
    )
    print_table("Responses request -> chat", responses_request_rows())
    print_table("chat reply -> Responses, whole", responses_reply_rows())
    return 0


if __name__ == "__main__":
    sys.exit(main())
