"""Exact-mode streaming helpers: merging generate events that arrive together, and dropping the end token."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway.turns.exact import without_end_token
from gateway.turns.exact_stream import _coalesced, _merge


def event(
    token_ids: list[int],
    logprobs: list[float] | None = None,
    *,
    finish_reason: str | None = None,
    stop_reason: Any = None,
    request_id: str = "gen-1",
) -> dict[str, Any]:
    pairs = zip(token_ids, logprobs or (), strict=False)
    content = [{"logprob": value, "token": f"token_id:{t}"} for t, value in pairs]
    return {
        "request_id": request_id,
        "choices": [
            {
                "index": 0,
                "token_ids": token_ids,
                "logprobs": {"content": content} if logprobs is not None else None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }


def sse(*payloads: dict[str, Any] | str) -> bytes:
    return b"".join(
        b"data: " + (p.encode() if isinstance(p, str) else orjson.dumps(p)) + b"\n\n" for p in payloads
    )


class Reply:
    """The part of a backend reply `_coalesced` reads: its body as network chunks."""

    def __init__(self, *chunks: bytes) -> None:
        self._chunks = chunks

    async def chunks(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


def coalesced(*chunks: bytes) -> list[dict[str, Any] | None]:
    async def main() -> list[dict[str, Any] | None]:
        return [e async for e in _coalesced(Reply(*chunks))]  # type: ignore[arg-type]

    return asyncio.run(main())


# --- _merge ---------------------------------------------------------------------------------------------


def test_a_single_event_is_passed_through_as_is():
    one = event([5], [-0.5])
    assert _merge([one]) is one


def test_merged_events_concatenate_token_ids_and_logprobs():
    events = [event([5, 6], [-0.5, -1.0]), event([7], [-0.25]), event([8, 2], [-2.0, -0.125])]
    merged = _merge(events)
    assert merged["choices"][0]["token_ids"] == [5, 6, 7, 8, 2]
    logprobs = [e["logprob"] for e in merged["choices"][0]["logprobs"]["content"]]
    assert logprobs == [-0.5, -1.0, -0.25, -2.0, -0.125]


def test_merged_event_keeps_the_last_choices_finish_and_stop_reason():
    events = [event([5], [-0.5]), event([6, 2], [-1.0, -0.25], finish_reason="stop", stop_reason=2)]
    assert _merge(events) == {
        "request_id": "gen-1",
        "choices": [
            {
                "index": 0,
                "token_ids": [5, 6, 2],
                "logprobs": {
                    "content": [
                        {"logprob": -0.5, "token": "token_id:5"},
                        {"logprob": -1.0, "token": "token_id:6"},
                        {"logprob": -0.25, "token": "token_id:2"},
                    ]
                },
                "finish_reason": "stop",
                "stop_reason": 2,
            }
        ],
    }


def test_merged_event_keeps_the_first_events_top_level_fields():
    merged = _merge([event([5], request_id="first"), event([6], request_id="second")])
    assert merged["request_id"] == "first"


def test_merged_events_without_logprobs_have_null_logprobs():
    merged = _merge([event([5]), event([6])])
    assert merged["choices"][0]["token_ids"] == [5, 6]
    assert merged["choices"][0]["logprobs"] is None


def test_merging_leaves_the_events_untouched():
    events = [event([5], [-0.5]), event([6], [-1.0], finish_reason="length")]
    before = copy.deepcopy(events)
    _merge(events)
    assert events == before


# --- _coalesced -----------------------------------------------------------------------------------------


def test_token_events_arriving_together_are_merged_and_done_yields_none():
    events = [event([5], [-0.5]), event([6], [-1.0]), event([2], [-0.25], finish_reason="stop")]
    assert coalesced(sse(*events), sse("[DONE]")) == [
        {
            "request_id": "gen-1",
            "choices": [
                {
                    **events[-1]["choices"][0],
                    "token_ids": [5, 6, 2],
                    "logprobs": {"content": [e["choices"][0]["logprobs"]["content"][0] for e in events]},
                }
            ],
        },
        None,
    ]


def test_token_events_arriving_apart_stay_apart():
    assert coalesced(sse(event([5])), sse(event([6])), sse("[DONE]")) == [event([5]), event([6]), None]


def test_events_without_tokens_pass_alone_and_in_order():
    usage = {"choices": [], "usage": {"prompt_tokens": 3}}
    error = {"error": "engine died"}
    chunk = sse(event([5]), event([6]), usage, event([7]), error, event([8]), event([9]))
    assert coalesced(chunk) == [
        _merge([event([5]), event([6])]),
        usage,
        event([7]),
        error,
        _merge([event([8]), event([9])]),
    ]


def test_done_flushes_the_pending_tokens_and_ends_the_stream():
    chunk = sse(event([5]), event([6]), "[DONE]", event([7]))
    assert coalesced(chunk, sse(event([8]))) == [_merge([event([5]), event([6])]), None]


def test_events_split_across_reads_are_merged_with_those_the_read_completes():
    data = sse(event([5]), event([6]), event([7]))
    first = len(sse(event([5]))) + 3  # the first event and the start of the second
    assert coalesced(data[:first], data[first:]) == [event([5]), _merge([event([6]), event([7])])]


def test_a_stream_ending_without_done_yields_no_none():
    assert coalesced(sse(event([5]))) == [event([5])]


# --- without_end_token ----------------------------------------------------------------------------------


def test_final_eos_is_dropped_with_its_logprob():
    generated = event([5, 6, 2], [-0.5, -1.0, -0.25], finish_reason="stop")
    trimmed = without_end_token(generated)
    assert trimmed["choices"][0]["token_ids"] == [5, 6]
    assert trimmed["choices"][0]["logprobs"] == {
        "content": [{"logprob": -0.5, "token": "token_id:5"}, {"logprob": -1.0, "token": "token_id:6"}]
    }
    assert (trimmed["request_id"], trimmed["choices"][0]["finish_reason"]) == ("gen-1", "stop")
    assert generated == event([5, 6, 2], [-0.5, -1.0, -0.25], finish_reason="stop")


def test_final_stop_token_id_is_dropped():
    trimmed = without_end_token(event([5, 151645], [-0.5, -0.1], finish_reason="stop", stop_reason=151645))
    assert trimmed["choices"][0]["token_ids"] == [5]
    assert [e["logprob"] for e in trimmed["choices"][0]["logprobs"]["content"]] == [-0.5]


def test_eos_without_logprobs_is_dropped_and_logprobs_stay_null():
    trimmed = without_end_token(event([5, 2], finish_reason="stop"))
    assert (trimmed["choices"][0]["token_ids"], trimmed["choices"][0]["logprobs"]) == ([5], None)


def test_the_last_token_is_kept_when_a_stop_string_ended_the_reply():
    generated = event([5, 6], [-0.5, -1.0], finish_reason="stop", stop_reason="</answer>")
    assert without_end_token(generated) is generated


def test_the_last_token_is_kept_unless_the_reply_stopped():
    for finish_reason in ("length", None, "abort"):
        generated = event([5, 6], [-0.5, -1.0], finish_reason=finish_reason)
        assert without_end_token(generated) is generated


def test_events_without_tokens_or_choices_are_left_alone():
    empty = event([], [], finish_reason="stop")
    no_choices = {"choices": [], "usage": {"prompt_tokens": 3}}
    assert without_end_token(empty) is empty
    assert without_end_token(no_choices) is no_choices
