"""OpenAI Responses -> the chat request vLLM renders: `instructions` and `input` items (messages, reasoning,
function and custom tool calls and their outputs) become chat messages, Responses tools become chat tools,
and a `previous_response_id` puts the stored conversation and reply of that response first. The turn is
captured on the chat side, with the engine's ids; `items.py` writes the reply back as Responses output.

Tools the model is shown: function tools as they are, namespaced functions flattened to `<namespace>__<name>`
(split again in the reply), and custom (free-form) tools as a function of one string, `input`. Hosted tools
(web search, file search, ...) cannot run here and are left out, as vLLM's own Responses endpoint does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.errors import ApiError, joined_text, string_field
from gateway.turns.sampling import ENGINE_FIELDS

CUSTOM_INPUT = "input"
NAMESPACE_SEPARATOR = "__"
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {CUSTOM_INPUT: {"type": "string"}},
    "required": [CUSTOM_INPUT],
}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# Stages of an assistant message that several items make up: an item of an earlier (or, but for tool calls,
# the same) stage than the message has reached starts a new message.
_REASONING, _CONTENT, _CALLS = 0, 1, 2


@dataclass(frozen=True)
class ToolNames:
    """How the model's tool-call names map back to Responses items."""

    custom: frozenset[str] = frozenset()
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Flat name -> (namespace, name)."""


def chat_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], ToolNames]:
    chat: list[dict[str, Any]] = []
    custom: set[str] = set()
    namespaced: dict[str, tuple[str, str]] = {}
    for tool in tools or ():
        kind = tool.get("type")
        if kind == "function":
            chat.append(_function(tool, tool.get("name")))
        elif kind == "custom":
            custom.add(str(tool.get("name")))
            chat.append(_function({**tool, "parameters": _CUSTOM_PARAMETERS}, tool.get("name")))
        elif kind == "namespace":
            for inner in tool.get("tools") or ():
                if inner.get("type") == "function":
                    flat = f"{tool.get('name')}{NAMESPACE_SEPARATOR}{inner.get('name')}"
                    namespaced[flat] = (str(tool.get("name")), str(inner.get("name")))
                    chat.append(_function(inner, flat))
    return chat, ToolNames(frozenset(custom), namespaced)


def _function(tool: dict[str, Any], name: Any) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise ApiError(400, "every function tool needs a name", "invalid_request", "tools")
    function: dict[str, Any] = {"name": name, "parameters": tool.get("parameters") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> tuple[dict[str, Any], ToolNames]:
    """The chat request equivalent to a Responses request whose earlier conversation is `history`."""
    tools, names = chat_tools(body.get("tools"))
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    messages += history
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    else:
        messages += input_messages(items, names)
    if not messages:
        raise ApiError(400, "input: nothing to answer", "invalid_request", "input")
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p", "parallel_tool_calls", *ENGINE_FIELDS):
        if body.get(name) is not None:
            chat[name] = body[name]
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat, names


def previous_conversation(turn: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's conversation and reply, as the next request continues it: without the response's
    own instructions, which do not carry over."""
    messages = list(turn["messages"] or ())
    if (turn.get("request") or {}).get("instructions") and messages and messages[0]["role"] == "system":
        messages = messages[1:]
    reply: dict[str, Any] = {"role": "assistant", "content": turn["content"]}
    if turn["tool_calls"]:
        reply["tool_calls"] = turn["tool_calls"]
    if turn["reasoning"]:
        reply["reasoning"] = turn["reasoning"]
    return [*messages, reply]


def input_messages(items: list[dict[str, Any]], names: ToolNames) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive reasoning, assistant text and tool calls make one assistant
    message, as the model produced them in one reply."""
    messages: list[dict[str, Any]] = []
    stage = -1  # how far the last assistant message has got
    for index, item in enumerate(items):
        where = f"input.{index}"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where}: expected an item object", "invalid_request", where)
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") != "assistant":
            messages.append(
                {
                    "role": _role(item, where),
                    "content": joined_text(item.get("content"), f"{where}.content", "parts", _part_text),
                }
            )
            stage = -1
            continue
        if kind == "function_call_output" or kind == "custom_tool_call_output":
            output = joined_text(item.get("output"), f"{where}.output", "parts", _part_text)
            messages.append(
                {"role": "tool", "tool_call_id": string_field(item, "call_id", where), "content": output}
            )
            stage = -1
            continue
        at = {"reasoning": _REASONING, "message": _CONTENT}.get(kind, _CALLS)
        if at == _CALLS and kind not in ("function_call", "custom_tool_call"):
            raise _unsupported(kind, where)
        if stage < 0 or at < stage or (at == stage and at != _CALLS):
            messages.append({"role": "assistant", "content": None})
        reply, stage = messages[-1], at
        if kind == "reasoning":
            reply["reasoning"] = _reasoning(item)
        elif kind == "message":
            reply["content"] = joined_text(item.get("content"), f"{where}.content", "parts", _part_text)
        else:
            reply.setdefault("tool_calls", []).append(_tool_call(item, kind, where))
    return messages


def _role(item: dict[str, Any], where: str) -> str:
    role = item.get("role")
    if role in ("user", "system"):
        return str(role)
    if role == "developer":  # chat templates know system prompts, not developer messages
        return "system"
    raise ApiError(
        400, f"{where}.role: expected user, system, developer or assistant", "invalid_request", where
    )


def _tool_call(item: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    name = string_field(item, "name", where)
    if kind == "custom_tool_call":
        arguments = orjson.dumps({CUSTOM_INPUT: item.get("input") or ""}).decode()
    else:
        arguments = item.get("arguments") or "{}"
        if item.get("namespace"):
            name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
    function = {"name": name, "arguments": arguments}
    return {"id": string_field(item, "call_id", where), "type": "function", "function": function}


def _reasoning(item: dict[str, Any]) -> str:
    """The reasoning's text (its content, else its summary); encrypted content is another provider's."""
    parts = item.get("content") or item.get("summary") or ()
    return "".join(part.get("text") or "" for part in parts if isinstance(part, dict))


def _part_text(part: Any, where: str) -> str:
    """A text part's text (a refusal's, for a refusal): the served model takes text alone."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
        raise ApiError(
            400,
            f"{where}: {kind!r} parts are not supported: the served model takes text",
            "unsupported_content",
            f"{where}.type",
        )
    text: str = part.get("text") or part.get("refusal") or ""
    return text


def _unsupported(kind: Any, where: str) -> ApiError:
    hint = "; send the item itself or use previous_response_id" if kind == "item_reference" else ""
    return ApiError(
        400,
        f"{where}: {kind!r} items are not supported: the gateway takes messages, reasoning, function and "
        f"custom tool calls and their outputs{hint}",
        "unsupported_content",
        f"{where}.type",
    )


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") in ("function", "custom") and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    return "auto"


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return None
