"""Where engine token ids are captured: the fields injected into the request, their collection from the
reply (whole or streamed) into a `TurnRecord`, and their removal from what the agent receives.

vLLM returns the prompt ids it rendered and every sampled id (EOS and tool-call markup included) when asked
with `return_token_ids`, and the sampled tokens' logprobs with `logprobs`. The gateway always asks; the agent
sees them only if it asked itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.store.records import TurnRecord
from gateway.store.tokens import ID_DTYPE, LOGPROB_DTYPE

_REQUEST_PAYLOAD_KEYS = frozenset({"messages", "tools", "prompt"})


@dataclass(frozen=True)
class Asked:
    """Which capture fields the agent asked for itself (and therefore receives)."""

    token_ids: bool
    logprobs: bool


class TurnCapture:
    """Collects one turn's ids, logprobs and reply from vLLM's response or stream chunks."""

    endpoint = ""
    path = ""

    def __init__(self, record: TurnRecord) -> None:
        self.record = record
        self.prompt_ids: list[int] = []
        self.completion_ids: list[int] = []
        self.logprobs: list[float] = []
        self.content: list[str] = []
        self.finish_reason: str | None = None

    @staticmethod
    def request_fields(body: dict[str, Any]) -> dict[str, Any]:
        return {
            "tools": body.get("tools"),
            "params": {k: v for k, v in body.items() if k not in _REQUEST_PAYLOAD_KEYS},
        }

    def inject(self, body: dict[str, Any]) -> tuple[dict[str, Any], Asked]:
        raise NotImplementedError

    def feed(self, payload: dict[str, Any]) -> None:
        """Take a whole response or one stream chunk (the same shape, `message` vs `delta` aside)."""
        prompt = payload.get("prompt_token_ids")
        if prompt:
            self.prompt_ids = prompt
        for choice in payload.get("choices") or ():
            self._feed_choice(choice)

    def _feed_choice(self, choice: dict[str, Any]) -> None:
        raise NotImplementedError

    def strip(self, payload: dict[str, Any], asked: Asked) -> None:
        """Undo what the gateway injected, so the agent gets what vLLM answers to its own request.

        Without the capture flags vLLM still sends these keys, with null values; so does the gateway.
        """
        choices = payload.get("choices") or ()
        if not asked.token_ids:
            if "prompt_token_ids" in payload:
                payload["prompt_token_ids"] = None
            for choice in choices:
                for key in ("token_ids", "prompt_token_ids"):
                    if key in choice:
                        choice[key] = None
        if not asked.logprobs:
            for choice in choices:
                if "logprobs" in choice:
                    choice["logprobs"] = None

    def finish(self) -> TurnRecord:
        record = self.record
        record.prompt_ids = np.asarray(self.prompt_ids, dtype=ID_DTYPE)
        record.completion_ids = np.asarray(self.completion_ids, dtype=ID_DTYPE)
        # With `echo` the completions endpoint also returns the prompt's logprobs: keep the sampled ones.
        sampled = self.logprobs[len(self.logprobs) - len(self.completion_ids) :] if self.completion_ids else []
        record.completion_logprobs = np.asarray(sampled, dtype=LOGPROB_DTYPE)
        record.content = "".join(self.content) if self.content else None
        record.finish_reason = self.finish_reason
        return record


class ChatCapture(TurnCapture):
    endpoint = "chat"
    path = "/v1/chat/completions"

    def __init__(self, record: TurnRecord) -> None:
        super().__init__(record)
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}

    def inject(self, body: dict[str, Any]) -> tuple[dict[str, Any], Asked]:
        asked = Asked(token_ids=body.get("return_token_ids") is True, logprobs=body.get("logprobs") is True)
        upstream = dict(body)
        upstream["return_token_ids"] = True
        upstream["logprobs"] = True
        return upstream, asked

    def _feed_choice(self, choice: dict[str, Any]) -> None:
        if choice.get("token_ids"):
            self.completion_ids.extend(choice["token_ids"])
        logprobs = choice.get("logprobs")
        if logprobs and logprobs.get("content"):
            self.logprobs.extend(item["logprob"] for item in logprobs["content"])
        message = choice.get("message") or choice.get("delta") or {}
        if message.get("content"):
            self.content.append(message["content"])
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if reasoning:
            self.reasoning.append(reasoning)
        for call in message.get("tool_calls") or ():
            self._merge_tool_call(call)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def _merge_tool_call(self, call: dict[str, Any]) -> None:
        """Whole tool calls arrive at once; streamed ones as pieces keyed by `index`."""
        index = call.get("index", len(self.tool_calls))
        current = self.tool_calls.get(index)
        if current is None:
            function = dict(call.get("function") or {})
            function["arguments"] = function.get("arguments") or ""
            self.tool_calls[index] = {"id": call.get("id"), "type": call.get("type", "function"), "function": function}
            return
        if call.get("id"):
            current["id"] = call["id"]
        piece = call.get("function") or {}
        if piece.get("name"):
            current["function"]["name"] = piece["name"]
        if piece.get("arguments"):
            current["function"]["arguments"] += piece["arguments"]

    def finish(self) -> TurnRecord:
        record = super().finish()
        record.reasoning = "".join(self.reasoning) if self.reasoning else None
        record.tool_calls = [self.tool_calls[i] for i in sorted(self.tool_calls)] or None
        return record


class CompletionCapture(TurnCapture):
    endpoint = "completions"
    path = "/v1/completions"

    def inject(self, body: dict[str, Any]) -> tuple[dict[str, Any], Asked]:
        asked = Asked(token_ids=body.get("return_token_ids") is True, logprobs=body.get("logprobs") is not None)
        upstream = dict(body)
        upstream["return_token_ids"] = True
        if upstream.get("logprobs") is None:
            upstream["logprobs"] = 0
        return upstream, asked

    def _feed_choice(self, choice: dict[str, Any]) -> None:
        if choice.get("prompt_token_ids"):
            self.prompt_ids = choice["prompt_token_ids"]
        if choice.get("token_ids"):
            self.completion_ids.extend(choice["token_ids"])
        logprobs = choice.get("logprobs")
        if logprobs and logprobs.get("token_logprobs"):
            self.logprobs.extend(logprobs["token_logprobs"])
        if choice.get("text"):
            self.content.append(choice["text"])
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
