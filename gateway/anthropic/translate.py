"""Anthropic Messages <-> the chat request vLLM renders: a request becomes a chat body (system prompt, text,
tool_use and tool_result blocks, mid-conversation system messages, tools, tool_choice, stop sequences), and
vLLM's chat reply (whole, or chunk by chunk) becomes a Messages reply. The turn is captured on the chat side,
with the engine's ids.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import orjson

from gateway.errors import ApiError, joined_text, string_field
from gateway.ids import new_id
from gateway.turns.sampling import ENGINE_FIELDS

# vLLM's finish reasons in Messages terms (a stop string vLLM reports as `stop_reason` is `stop_sequence`).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_SAMPLING = ("temperature", "top_p", "top_k", "stream", *ENGINE_FIELDS)
_ATTRIBUTION = "x-anthropic-billing-header"


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request equivalent to a Messages request."""
    messages = _system_message(body.get("system") or "", "system")
    for index, message in enumerate(body["messages"]):
        messages += _chat_messages(message, f"messages.{index}")
    chat: dict[str, Any] = {"model": body["model"], "messages": messages, "max_tokens": body["max_tokens"]}
    chat.update({name: body[name] for name in _SAMPLING if body.get(name) is not None})
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    tools = [_tool(tool) for tool in body.get("tools") or () if not tool.get("defer_loading")]
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
    return chat


def _system_message(content: Any, where: str) -> list[dict[str, Any]]:
    """The system prompt, or a mid-conversation system message, as a chat system message: none when it holds
    no text (nothing but Claude Code's attribution block, say)."""
    text = _system_text(content, where)
    return [{"role": "system", "content": text}] if text else []


def _chat_messages(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    content = message["content"]
    if message["role"] == "system":
        return _system_message(content, f"{where}.content")
    if isinstance(content, str):
        return [{"role": message["role"], "content": content}]
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        kind = block.get("type")
        at = f"{where}.content.{index}"
        if kind == "text":
            texts.append(string_field(block, "text", at))
        elif kind == "thinking":
            reasoning.append(string_field(block, "thinking", at))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            function = {"name": string_field(block, "name", at), "arguments": arguments}
            calls.append({"id": string_field(block, "id", at), "type": "function", "function": function})
        elif kind == "tool_result":
            content_at = f"{at}.content"
            result = joined_text(block.get("content") or "", content_at, "blocks", _text_block)
            results.append(
                {"role": "tool", "tool_call_id": string_field(block, "tool_use_id", at), "content": result}
            )
        else:
            raise ApiError(
                400,
                f"{where}.content.{index}: {kind!r} blocks are not supported: the served model takes text, "
                "tool_use and tool_result blocks",
                "unsupported_content",
                f"{where}.content.{index}.type",
            )
    if message["role"] == "user":
        return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        reply["tool_calls"] = calls
    if reasoning:
        reply["reasoning"] = "".join(reasoning)
    return [reply]


def _system_text(value: Any, where: str) -> str:
    """A system prompt's text without Claude Code's attribution block (`x-anthropic-billing-header: ...`):
    Anthropic's API reads it as a header, vLLM's own Messages endpoint drops it (its hash changes from one
    request to the next), and left in, vLLM's chat renderer cuts it as a line, with the text of the next
    block up to its first newline (Claude Code's first sentence)."""
    return joined_text(value, where, "blocks", partial(_text_block, skip=_ATTRIBUTION))


def _text_block(block: Any, where: str, skip: str | None = None) -> str:
    """A text block's text, none if it starts with `skip`: system prompts and tool results hold text blocks
    alone."""
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise ApiError(400, f"{where}: only text blocks can go here", "unsupported_content", where)
    text: str = block["text"]
    return "" if skip is not None and text.startswith(skip) else text


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> Any:
    kind = str(choice.get("type"))
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(kind, "auto")


def stop_reason(choice: dict[str, Any]) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice."""
    finish = choice.get("finish_reason")
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return (_STOP_REASONS.get(finish, finish), None) if isinstance(finish, str) else (None, None)


def message(payload: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion as a Messages reply."""
    choice = payload["choices"][0]
    reply = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = reply.get("reasoning") or reply.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or ():
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": _input(function),
            }
        )
    reason, sequence = stop_reason(choice)
    usage = payload.get("usage") or {}
    return {
        "id": message_id(payload),
        "type": "message",
        "role": "assistant",
        "model": payload.get("model"),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
        },
    }


def message_id(payload: dict[str, Any]) -> str:
    chat_id = payload.get("id")
    return "msg_" + (chat_id.removeprefix("chatcmpl-") if isinstance(chat_id, str) else new_id())


def _input(function: dict[str, Any]) -> Any:
    """A tool call's arguments as the object Messages carries (text that is not JSON stays text)."""
    try:
        return orjson.loads(function.get("arguments") or "{}")
    except orjson.JSONDecodeError:
        return function.get("arguments")


class StreamTranslator:
    """vLLM's chat chunks as Messages stream events: one content block at a time (thinking, text, each
    tool_use), opened when its first delta arrives and closed when another kind starts or the reply ends."""

    def __init__(self) -> None:
        self._started = False
        self._block: tuple[str, int] | None = None  # (kind, tool index) of the open block
        self._index = -1
        self._reason: tuple[str | None, str | None] = (None, None)
        self._usage: dict[str, Any] = {}

    def chunk(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if not self._started:
            self._started = True
            start: dict[str, Any] = {
                "id": message_id(chunk),
                "type": "message",
                "role": "assistant",
                "model": chunk.get("model"),
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }
            events.append(("message_start", {"type": "message_start", "message": start}))
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                events += self._delta(("thinking", 0), {"type": "thinking_delta", "thinking": reasoning})
            if delta.get("content"):
                events += self._delta(("text", 0), {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or ():
                events += self._tool_delta(call)
            if choice.get("finish_reason"):
                self._reason = stop_reason(choice)
        return events

    def end(self) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        reason, sequence = self._reason
        usage = {
            "input_tokens": self._usage.get("prompt_tokens", 0),
            "output_tokens": self._usage.get("completion_tokens", 0),
        }
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage,
        }
        return [*events, ("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def _delta(self, block: tuple[str, int], delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if self._block != block:
            events += self._close()
            self._block, self._index = block, self._index + 1
            empty = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if block[0] == "thinking"
                else {"type": "text", "text": ""}
            )
            events.append(
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": self._index, "content_block": empty},
                )
            )
        events.append(
            ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
        )
        return events

    def _tool_delta(self, call: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        block = ("tool_use", call.get("index", 0))
        function = call.get("function") or {}
        if self._block != block:
            events += self._close()
            self._block, self._index = block, self._index + 1
            start: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": {},
            }
            events.append(
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": self._index, "content_block": start},
                )
            )
        if function.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events.append(
                ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
            )
        return events

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self._block is None:
            return []
        self._block = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]
