"""vLLM's chat reply as a Responses reply: output items (reasoning, message, function and custom tool calls),
the response object, and the Responses event stream built chunk by chunk as vLLM streams.

Item ids derive from the response id and the item's place, so a response fetched again from the store
(`GET .../responses/{id}`) shows the ids the agent was given.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.responses.translate import CUSTOM_INPUT, ToolNames

# What a response echoes of its request, with the Responses API's defaults.
_ECHOED: dict[str, Any] = {
    "instructions": None,
    "tools": [],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "temperature": None,
    "top_p": None,
    "max_output_tokens": None,
    "previous_response_id": None,
    "reasoning": None,
    "text": {"format": {"type": "text"}},
    "truncation": "disabled",
    "metadata": {},
    "user": None,
    "store": True,
}
_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc", "custom_tool_call": "ctc"}
Event = tuple[str, dict[str, Any]]


def item_id(response_id: str, kind: str, index: int) -> str:
    return f"{_PREFIXES[kind]}_{response_id.removeprefix('resp_')}_{index}"


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """(status, incomplete_details) of a reply that ended with `finish_reason`."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


class ResponseShape:
    """What every form of one response shares: its id, the request it echoes, how tool names map back."""

    def __init__(
        self, response_id: str, request: dict[str, Any], names: ToolNames, created_at: float
    ) -> None:
        self.id = response_id
        self.request = request
        self.names = names
        self.created_at = int(created_at)

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        model: str | None,
        incomplete: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        echoed = {key: self.request.get(key, default) for key, default in _ECHOED.items()}
        if echoed["store"] is None:
            echoed["store"] = True
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": model,
            "output": output,
            "usage": _usage(usage) if usage is not None else None,
            **echoed,
        }

    def items(
        self, reasoning: str | None, content: str | None, tool_calls: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        """A whole reply's output items, in the order a reply is written."""
        items: list[dict[str, Any]] = []
        if reasoning:
            items.append(self.reasoning_item(len(items), reasoning))
        if content:
            items.append(self.message_item(len(items), content))
        for call in tool_calls or ():
            function = call.get("function") or {}
            items.append(
                self.call_item(len(items), call.get("id"), function.get("name"), function.get("arguments"))
            )
        return items

    def reasoning_item(self, index: int, text: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}]
        return {
            "type": "reasoning",
            "id": item_id(self.id, "reasoning", index),
            "summary": [],
            "content": content,
        }

    def message_item(self, index: int, text: str, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "message",
            "id": item_id(self.id, "message", index),
            "status": status,
            "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else [],
        }

    def call_item(
        self, index: int, call_id: Any, name: Any, arguments: Any, status: str = "completed"
    ) -> dict[str, Any]:
        """A function call item; a custom tool's call carries its one string as `input`."""
        name, arguments = str(name or ""), str(arguments or "")
        if name in self.names.custom:
            item = {"type": "custom_tool_call", "id": item_id(self.id, "custom_tool_call", index)}
            item.update(
                call_id=call_id, name=name, input=custom_input(arguments) if status == "completed" else ""
            )
            return {**item, "status": status}
        item = {"type": "function_call", "id": item_id(self.id, "function_call", index), "call_id": call_id}
        namespace, name = self.names.namespaced.get(name, (None, name))
        item.update(name=name, arguments=arguments, status=status)
        if namespace is not None:
            item["namespace"] = namespace
        return item


def custom_input(arguments: str) -> str:
    """The string a custom tool's call holds (the model wrote it as a function's one argument)."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    found = value.get(CUSTOM_INPUT) if isinstance(value, dict) else None
    return found if isinstance(found, str) else arguments


def whole_response(shape: ResponseShape, payload: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion as a response."""
    choice = payload["choices"][0]
    message = choice.get("message") or {}
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    output = shape.items(reasoning, message.get("content"), message.get("tool_calls"))
    status, incomplete = status_of(choice.get("finish_reason"))
    return shape.response(status, output, payload.get("usage") or {}, payload.get("model"), incomplete)


def stored_response(shape: ResponseShape, turn: dict[str, Any]) -> dict[str, Any]:
    """A stored turn as the response it answered (a turn that failed, as a failed response)."""
    output = shape.items(turn["reasoning"], turn["content"], turn["tool_calls"])
    usage = {"prompt_tokens": turn["prompt_tokens"], "completion_tokens": turn["completion_tokens"]}
    if turn["status"] != "ok":
        response = shape.response("failed", output, usage, turn["model"])
        return {**response, "error": {"code": f"turn_{turn['status']}", "message": turn["error"]}}
    status, incomplete = status_of(turn["finish_reason"])
    return shape.response(status, output, usage, turn["model"], incomplete)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class _Open:
    """The output item being streamed."""

    def __init__(self, kind: str, index: int, key: int = 0) -> None:
        self.kind, self.index, self.key = kind, index, key
        self.text = ""
        self.call_id: Any = None
        self.name: Any = None


class ResponseStream:
    """vLLM's chat chunks as Responses events: created and in_progress first, then one output item at a time
    (reasoning, message, each tool call), opened by its first delta and done when another starts or the reply
    ends, then completed (or incomplete) with the whole response. Custom tool calls are sent whole when they
    end: their input is the string inside the arguments the model streams."""

    def __init__(self, shape: ResponseShape, model: str | None) -> None:
        self._shape = shape
        self._model = model
        self._sequence = 0
        self._open: _Open | None = None
        self._output: list[dict[str, Any]] = []
        self._finish: str | None = None
        self._usage: dict[str, Any] = {}

    def start(self) -> list[Event]:
        response = self._shape.response("in_progress", [], None, self._model)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        self._model = chunk.get("model") or self._model
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                events += self._text("reasoning", reasoning)
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    def end(self) -> list[Event]:
        events = self._close()
        status, incomplete = status_of(self._finish)
        response = self._shape.response(status, self._output, self._usage, self._model, incomplete)
        name = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(name, response=response)]

    def error(self, code: str, message: str) -> list[Event]:
        return [self._event("error", code=code, message=message, param=None)]

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        current = self._open
        if current is None or current.kind != kind:
            events += self._close()
            current = self._open = _Open(kind, len(self._output))
            shape = self._shape
            if kind == "message":
                item = shape.message_item(current.index, "", "in_progress")
                events.append(self._added(item))
                events.append(self._part("response.content_part.added", current, _text_part("")))
            else:
                item = {**shape.reasoning_item(current.index, ""), "content": []}
                events.append(self._added(item))
        current.text += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, **self._at(current), content_index=0, delta=text, **extra))
        return events

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        key = call.get("index", 0)
        current = self._open
        function = call.get("function") or {}
        if current is None or current.kind != "call" or current.key != key:
            events += self._close()
            current = self._open = _Open("call", len(self._output), key)
            current.call_id, current.name = call.get("id"), function.get("name")
            item = self._shape.call_item(current.index, current.call_id, current.name, "", "in_progress")
            events.append(self._added(item))
        arguments = function.get("arguments")
        if arguments:
            current.text += arguments
            if current.name not in self._shape.names.custom:
                events.append(
                    self._event(
                        "response.function_call_arguments.delta", **self._at(current), delta=arguments
                    )
                )
        return events

    def _close(self) -> list[Event]:
        current, self._open = self._open, None
        if current is None:
            return []
        shape, at = self._shape, self._at(current)
        if current.kind == "message":
            item = shape.message_item(current.index, current.text)
            events = [
                self._event(
                    "response.output_text.done", **at, content_index=0, text=current.text, logprobs=[]
                ),
                self._part("response.content_part.done", current, _text_part(current.text)),
            ]
        elif current.kind == "reasoning":
            item = shape.reasoning_item(current.index, current.text)
            events = [self._event("response.reasoning_text.done", **at, content_index=0, text=current.text)]
        else:
            item = shape.call_item(current.index, current.call_id, current.name, current.text)
            if item["type"] == "custom_tool_call":
                events = [
                    self._event("response.custom_tool_call_input.delta", **at, delta=item["input"]),
                    self._event("response.custom_tool_call_input.done", **at, input=item["input"]),
                ]
            else:
                events = [
                    self._event(
                        "response.function_call_arguments.done",
                        **at,
                        name=item["name"],
                        arguments=current.text,
                    )
                ]
        self._output.append(item)
        return [*events, self._event("response.output_item.done", output_index=current.index, item=item)]

    def _added(self, item: dict[str, Any]) -> Event:
        return self._event("response.output_item.added", output_index=len(self._output), item=item)

    def _part(self, name: str, current: _Open, part: dict[str, Any]) -> Event:
        return self._event(name, **self._at(current), content_index=0, part=part)

    def _at(self, current: _Open) -> dict[str, Any]:
        return {
            "item_id": item_id(self._shape.id, _kind(current, self._shape.names), current.index),
            "output_index": current.index,
        }

    def _event(self, event: str, /, **fields: Any) -> Event:
        self._sequence += 1
        return event, {"type": event, "sequence_number": self._sequence - 1, **fields}


def _kind(current: _Open, names: ToolNames) -> str:
    if current.kind != "call":
        return current.kind
    return "custom_tool_call" if current.name in names.custom else "function_call"
