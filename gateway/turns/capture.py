"""Where engine token ids are captured: the fields injected into the request, their collection from the
reply (whole or streamed) into `TurnRecord`s, and their removal from what the agent receives.

vLLM returns the prompt ids it rendered and every sampled id (EOS and tool-call markup included) when asked
with `return_token_ids`, and the sampled tokens' logprobs with `logprobs`. The gateway always asks; the agent
sees them only if it asked itself. A call with `n > 1` gives one record per choice (same prompt, its own ids).
A server with the project's vLLM plugin (`vllm-plugin/`) adds each choice's weight-version spans when the
choice ends; the gateway keeps them and the agent never sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import orjson

from gateway.errors import ApiError
from gateway.store.records import TurnRecord
from rollout_store.tokens import ID_DTYPE, LOGPROB_DTYPE

_REQUEST_PAYLOAD_KEYS = frozenset({"messages", "tools", "prompt"})
RENDERED_BY_VLLM = "fallback: vLLM rendered the messages itself"
"""An exact turn's `splice` when vLLM did not take the prompt given as ids."""
_PROMPT_IDS_KEY = b'"prompt_token_ids":'
_PROMPT_IDS = _PROMPT_IDS_KEY + b"["
_DIGITS_AND_COMMAS = b"0123456789,"
_MAX_ID = np.iinfo(ID_DTYPE).max
SPANS = "weight_versions"
"""The plugin's field on a choice: `[{"version", "start", "end"}]` over its output tokens."""


@dataclass(frozen=True)
class Asked:
    """Which capture fields the agent asked for itself (and therefore receives)."""

    token_ids: bool
    logprobs: bool
    model: str | None = None
    """The model the agent asked for, when vLLM was asked another (a LoRA policy's version): the agent gets
    its own name back."""


@dataclass
class Choice:
    """One choice of the reply as it accumulates (a whole reply's choice, or a stream's deltas)."""

    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    weight_versions: list[dict[str, Any]] | None = None

    def take_spans(self, choice: dict[str, Any]) -> None:
        """The plugin's spans, taken off the choice (the agent gets vLLM's reply as it is without the plugin)
        and kept if they are what the plugin sends: spans of the output tokens, in order, without a gap."""
        spans = choice.pop(SPANS, None)
        if spans is not None:
            self.weight_versions = spans if _contiguous(spans) else None

    def merge_tool_call(self, call: dict[str, Any]) -> None:
        """Whole tool calls arrive at once; streamed ones as pieces keyed by `index`."""
        index = call.get("index", len(self.tool_calls))
        current = self.tool_calls.get(index)
        if current is None:
            function = dict(call.get("function") or {})
            function["arguments"] = function.get("arguments") or ""
            self.tool_calls[index] = {
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": function,
            }
            return
        if call.get("id"):
            current["id"] = call["id"]
        piece = call.get("function") or {}
        if piece.get("name"):
            current["function"]["name"] = piece["name"]
        if piece.get("arguments"):
            current["function"]["arguments"] += piece["arguments"]


class TurnCapture:
    """Collects one call's ids, logprobs and reply from vLLM's response or stream chunks."""

    endpoint = ""
    path = ""

    def __init__(self, record: TurnRecord) -> None:
        self.record = record
        self.prompt_ids: list[int] | np.ndarray = []
        self.choices: dict[int, Choice] = {}
        self.sent_prompt: np.ndarray | None = None
        """The prompt exact mode gave vLLM as ids, to check against the one vLLM reports it used."""

    def sampled(self) -> int:
        """Completion tokens captured so far, all choices together."""
        return sum(len(choice.completion_ids) for choice in self.choices.values())

    def choice(self, index: int = 0) -> Choice:
        found = self.choices.get(index)
        if found is None:
            found = self.choices[index] = Choice()
        return found

    @staticmethod
    def request_fields(body: dict[str, Any]) -> dict[str, Any]:
        return {
            "tools": body.get("tools"),
            "params": {k: v for k, v in body.items() if k not in _REQUEST_PAYLOAD_KEYS},
        }

    def inject(self, body: dict[str, Any], parsed: Any) -> tuple[dict[str, Any], Asked]:
        """The request for vLLM (asking for ids and logprobs), and what the agent asked for itself."""
        raise NotImplementedError

    def feed(self, payload: dict[str, Any]) -> None:
        """Take a whole response or one stream chunk (the same shape, `message` vs `delta` aside)."""
        prompt = payload.get("prompt_token_ids")
        if prompt:
            self.prompt_ids = prompt
        for choice in payload.get("choices") or ():
            index = choice.get("index")
            self._feed_choice(self.choice(index if isinstance(index, int) else 0), choice)

    def _feed_choice(self, into: Choice, choice: dict[str, Any]) -> None:
        raise NotImplementedError

    def feed_reply(self, raw: bytes, asked: Asked) -> Any:
        """Take a whole reply as vLLM sent it: its JSON (a 502 if it is not JSON), captured."""
        payload, prompt_ids = _without_prompt_ids(raw) if not asked.token_ids else (None, None)
        if payload is None:
            try:
                payload = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise ApiError(502, "backend sent a reply that is not JSON", "backend_error") from None
        self.feed(payload)
        if prompt_ids is not None:
            self.prompt_ids = prompt_ids
        return payload

    def read_chunk(self, data: bytes, asked: Asked) -> Any:
        """One stream event's JSON. The first event of a stream holds the prompt's ids, most of its bytes:
        read straight from them as a whole reply's are (`_without_prompt_ids`), so that a long prompt costs
        a stream no more than a whole reply."""
        if not asked.token_ids and len(self.prompt_ids) == 0:
            payload, prompt_ids = _without_prompt_ids(data)
            if payload is not None and prompt_ids is not None:
                self.prompt_ids = prompt_ids
                return payload
        return orjson.loads(data)

    def strip(self, payload: dict[str, Any], asked: Asked) -> None:
        """Undo what the gateway injected, so the agent gets what vLLM answers to its own request.

        Without the capture flags vLLM still sends these keys, with null values; so does the gateway.
        """
        if asked.model is not None:
            payload["model"] = asked.model
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

    def take(self, chunk: dict[str, Any], asked: Asked) -> bool:
        """One stream chunk captured and stripped (`feed`, `strip`): whether the agent receives it."""
        self.feed(chunk)
        self.strip(chunk, asked)
        return True

    def finish(self) -> list[TurnRecord]:
        """One record per choice, in choice order (one, empty, if nothing was generated)."""
        prompt = packed(self.prompt_ids)
        if self.sent_prompt is not None and not np.array_equal(prompt, self.sent_prompt):
            # vLLM rendered the messages itself: the turn holds its ids, not the splice.
            self.record.splice = RENDERED_BY_VLLM
            self.record.prompt_completions = None
        return [self._record(index, prompt) for index in sorted(self.choices) or [0]]

    def _record(self, index: int, prompt: np.ndarray) -> TurnRecord:
        choice = self.choice(index)
        record = self.record if index == 0 else replace(self.record, choice_index=index)
        record.prompt_ids = prompt
        record.completion_ids = packed(choice.completion_ids)
        # With `echo` the completions endpoint also returns the prompt's logprobs: keep the sampled ones.
        sampled = (
            choice.logprobs[len(choice.logprobs) - len(choice.completion_ids) :]
            if choice.completion_ids
            else []
        )
        record.completion_logprobs = np.asarray(sampled, dtype=LOGPROB_DTYPE)
        record.content = "".join(choice.content) if choice.content else None
        record.reasoning = "".join(choice.reasoning) if choice.reasoning else None
        record.tool_calls = [choice.tool_calls[i] for i in sorted(choice.tool_calls)] or None
        record.finish_reason = choice.finish_reason
        spans = choice.weight_versions
        # Spans of other tokens than those kept (ids that could not be kept) say nothing of them.
        ends = spans[-1]["end"] if spans else 0
        record.weight_versions = spans if ends == record.completion_ids.shape[0] else None
        return record


def _contiguous(spans: object) -> bool:
    """Spans `[{"version": str, "start": int, "end": int}]` that follow each other from token 0 on."""
    if not isinstance(spans, list):
        return False
    at = 0
    for span in spans:
        if not isinstance(span, dict) or span.keys() != {"version", "start", "end"}:
            return False
        version, start, end = span["version"], span["start"], span["end"]
        if not isinstance(version, str) or type(start) is not int or type(end) is not int:
            return False
        if start != at or end <= start:
            return False
        at = end
    return True


def packed(ids: list[int] | np.ndarray) -> np.ndarray:
    """Ids as the store keeps them (32-bit). The request models bound the agent's ids and vLLM's are its
    vocabulary's; should any still not fit (negative, 2**31 or more, not a number), the turn keeps no ids
    rather than wrapped ones, and its other fields are stored as usual."""
    if isinstance(ids, np.ndarray) and ids.dtype == ID_DTYPE:
        return ids
    try:
        wide = np.asarray(ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        return np.empty(0, dtype=ID_DTYPE)
    if wide.ndim != 1 or (wide.shape[0] and (wide.min() < 0 or wide.max() > _MAX_ID)):
        return np.empty(0, dtype=ID_DTYPE)
    return wide.astype(ID_DTYPE)


def _without_prompt_ids(raw: bytes) -> tuple[dict[str, Any] | None, np.ndarray | None]:
    """A whole chat reply's JSON with `prompt_token_ids` null, and those ids read straight from the bytes;
    (None, None) when in any doubt: the reply is then parsed whole.

    The prompt ids are most of a reply (3,200 ids make 14 KB of a 19 KB reply): parsed into Python ints, then
    into an array, they took twice what numpy's reading of the digits does, and the cost grows with the
    context. The agent did not ask for them, so the rest is parsed with `null` in their place: it gets the
    same reply. The key must be vLLM's top-level one (a chat reply has no other): the only one in the bytes,
    the parsed reply's top-level value is the `null` put in, and the ids are as many as `usage` counts.
    Anything else (spaces, other characters, counts that disagree) and the reply is parsed whole.
    """
    start = raw.find(_PROMPT_IDS)
    end = raw.find(b"]", start)
    if start < 0 or end < 0 or raw.count(_PROMPT_IDS_KEY) != 1:
        return None, None
    ids = _read_ids(raw[start + len(_PROMPT_IDS) : end])
    if ids is None:
        return None, None
    try:
        payload = orjson.loads(raw[:start] + b'"prompt_token_ids":null' + raw[end + 1 :])
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(payload, dict) or payload.get("prompt_token_ids", 0) is not None:
        return None, None
    usage = payload.get("usage")
    counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if counted is not None and counted != ids.shape[0]:
        return None, None
    return payload, ids


def _read_ids(digits: bytes) -> np.ndarray | None:
    """Non-negative ids separated by commas, nothing else, as numpy reads them; None for anything else."""
    if not digits or digits.translate(None, _DIGITS_AND_COMMAS):
        return None
    try:
        # Text mode (only the binary one is deprecated). An empty field stops it early (with a warning,
        # ignored by default, or a ValueError where warnings are errors): the count below catches it.
        ids = np.fromstring(digits, dtype=np.int64, sep=",")
    except ValueError:
        return None
    if ids.shape[0] != digits.count(b",") + 1 or ids.max() > _MAX_ID:
        return None
    return ids.astype(ID_DTYPE)


def _needs_logprobs(body: dict[str, Any]) -> None:
    """vLLM refuses these without `logprobs`; the gateway always sends `logprobs`, so it refuses them itself,
    in vLLM's words, rather than hide the client's mistake."""
    top = body.get("top_logprobs")
    if isinstance(top, int | float) and (top == -1 or top > 0) and not body.get("logprobs"):
        message = "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"
        raise ApiError(400, message, 400, "top_logprobs", "BadRequestError")
    if body.get("logprob_token_ids") and not body.get("logprobs"):
        message = (
            "when using `logprob_token_ids`, `logprobs` must be set to true. (parameter=logprob_token_ids)"
        )
        raise ApiError(400, message, 400, "logprob_token_ids", "BadRequestError")


class ChatCapture(TurnCapture):
    endpoint = "chat"
    path = "/v1/chat/completions"

    def inject(self, body: dict[str, Any], parsed: Any) -> tuple[dict[str, Any], Asked]:
        asked = Asked(token_ids=parsed.return_token_ids is True, logprobs=parsed.logprobs is True)
        _needs_logprobs(body)
        upstream = dict(body)
        upstream["return_token_ids"] = True
        upstream["logprobs"] = True
        return upstream, asked

    def take(self, chunk: dict[str, Any], asked: Asked) -> bool:
        """`feed` and `strip` in one pass over the chunk: every token of every stream comes this way.

        A chunk whose delta is empty is held back from an agent that asked for neither ids nor logprobs:
        while a parser holds text back (a tool call's markup, a think tag) vLLM skips the step unless ids or
        logprobs were asked for, which the gateway always asks. Its ids are captured; the agent would not
        have seen it. A parser may itself emit an empty delta (vLLM's Mistral tool parser does), which vLLM
        sends whatever was asked; in JSON it is the same chunk, so it is held back too: it carries nothing
        either."""
        prompt = chunk.get("prompt_token_ids")
        if prompt:
            self.prompt_ids = prompt
        if prompt is not None and not asked.token_ids:
            chunk["prompt_token_ids"] = None
        if asked.model is not None:
            chunk["model"] = asked.model
        choices = chunk.get("choices")
        if not choices:
            return True
        sent = asked.token_ids or asked.logprobs
        for choice in choices:
            index = choice.get("index")
            into = self.choices.get(index) or self.choice(index if isinstance(index, int) else 0)
            ids = choice.get("token_ids")
            if ids:
                into.completion_ids += ids
            logprobs = choice.get("logprobs")
            if logprobs:
                items = logprobs.get("content")
                if items:
                    for item in items:  # a loop, not a comprehension: that is a call of its own
                        into.logprobs.append(item["logprob"])
            delta = choice.get("delta")
            if delta:
                content = delta.get("content")
                if content and len(delta) == 1:  # most of a stream's deltas: one token of text
                    into.content.append(content)
                else:
                    _take_message(into, delta)
            finish = choice.get("finish_reason")
            if finish:
                into.finish_reason = finish
                into.take_spans(choice)
            if not asked.token_ids:
                if ids is not None:
                    choice["token_ids"] = None
                if "prompt_token_ids" in choice:
                    choice["prompt_token_ids"] = None
            if logprobs is not None and not asked.logprobs:
                choice["logprobs"] = None
            sent = sent or delta != {} or finish is not None
        return sent

    def _feed_choice(self, into: Choice, choice: dict[str, Any]) -> None:
        if choice.get("token_ids"):
            into.completion_ids.extend(choice["token_ids"])
        logprobs = choice.get("logprobs")
        if logprobs and logprobs.get("content"):
            into.logprobs.extend(item["logprob"] for item in logprobs["content"])
        _take_message(into, choice.get("message") or choice.get("delta") or {})
        if choice.get("finish_reason"):
            into.finish_reason = choice["finish_reason"]
        into.take_spans(choice)


def _take_message(into: Choice, message: dict[str, Any]) -> None:
    """A whole reply's message or a stream's delta: its text, reasoning and tool calls."""
    content = message.get("content")
    if content:
        into.content.append(content)
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        into.reasoning.append(reasoning)
    calls = message.get("tool_calls")
    if calls:
        for call in calls:
            into.merge_tool_call(call)


class TokensChatCapture(ChatCapture):
    """A chat call whose prompt the client gave as ids (`/chat/completions/tokens`): the engine generates from
    those ids, its chat path (parsers, streaming, `n`) otherwise as for any chat call."""

    @staticmethod
    def request_fields(body: dict[str, Any]) -> dict[str, Any]:
        fields = ChatCapture.request_fields(body)
        fields["params"].pop("tokens", None)
        return fields

    def inject(self, body: dict[str, Any], parsed: Any) -> tuple[dict[str, Any], Asked]:
        upstream, asked = super().inject(body, parsed)
        self.sent_prompt = np.asarray(upstream.pop("tokens"), dtype=ID_DTYPE)  # `forward` sends it as ids
        return upstream, asked


class CompletionCapture(TurnCapture):
    endpoint = "completions"
    path = "/v1/completions"

    def inject(self, body: dict[str, Any], parsed: Any) -> tuple[dict[str, Any], Asked]:
        asked = Asked(token_ids=parsed.return_token_ids is True, logprobs=parsed.logprobs is not None)
        upstream = dict(body)
        upstream["return_token_ids"] = True
        if upstream.get("logprobs") is None:
            upstream["logprobs"] = 0
        return upstream, asked

    def _feed_choice(self, into: Choice, choice: dict[str, Any]) -> None:
        if choice.get("prompt_token_ids"):
            self.prompt_ids = choice["prompt_token_ids"]
        if choice.get("token_ids"):
            into.completion_ids.extend(choice["token_ids"])
        logprobs = choice.get("logprobs")
        if logprobs and logprobs.get("token_logprobs"):
            into.logprobs.extend(logprobs["token_logprobs"])
        if choice.get("text"):
            into.content.append(choice["text"])
        if choice.get("finish_reason"):
            into.finish_reason = choice["finish_reason"]
        into.take_spans(choice)
