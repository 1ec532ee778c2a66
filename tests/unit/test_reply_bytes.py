"""A whole chat reply's prompt ids read from its bytes (`TurnCapture.feed_reply`): the same turn and the same
reply for the agent as parsing it whole, and a whole parse whenever the bytes are not what vLLM writes."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from gateway.errors import ApiError
from gateway.store.records import TurnRecord
from gateway.turns.capture import Asked, ChatCapture, CompletionCapture

NOT_ASKED = Asked(token_ids=False, logprobs=False)
ASKED = Asked(token_ids=True, logprobs=True)


def reply(prompt_ids: Any = (5, 17, 2_000_000, 0, 9), **changes: Any) -> dict[str, Any]:
    """vLLM's chat reply with `return_token_ids` and `logprobs`, top-level fields in vLLM's order."""
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok", "tool_calls": [], "reasoning": None},
                "logprobs": {"content": [{"token": "o", "logprob": -0.5}, {"token": "k", "logprob": -0.25}]},
                "finish_reason": "stop",
                "token_ids": [7, 8],
            }
        ],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 2, "total_tokens": 2},
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt_ids),
    }
    body.update(changes)
    return body


def captured(raw: bytes, asked: Asked, capture_cls: type = ChatCapture) -> tuple[TurnRecord, bytes]:
    """The turn recorded from `raw`, and the reply the agent gets."""
    capture = capture_cls(TurnRecord("r1", "chat", "tiny", False, "v0", 1.0))
    payload = capture.feed_reply(raw, asked)
    turn = capture.finish()[0]
    capture.strip(payload, asked)
    return turn, orjson.dumps(payload)


def parsed_whole(raw: bytes, asked: Asked) -> tuple[TurnRecord, bytes]:
    """What the gateway did before reading ids from the bytes: parse, feed, finish, strip."""
    capture = ChatCapture(TurnRecord("r1", "chat", "tiny", False, "v0", 1.0))
    payload = orjson.loads(raw)
    capture.feed(payload)
    turn = capture.finish()[0]
    capture.strip(payload, asked)
    return turn, orjson.dumps(payload)


def assert_same(raw: bytes, asked: Asked) -> TurnRecord:
    turn, agent_gets = captured(raw, asked)
    expected_turn, expected_reply = parsed_whole(raw, asked)
    assert turn.prompt_ids.dtype == expected_turn.prompt_ids.dtype
    assert turn.prompt_ids.tolist() == expected_turn.prompt_ids.tolist()
    assert turn.completion_ids.tolist() == expected_turn.completion_ids.tolist()
    assert turn.completion_logprobs.tolist() == expected_turn.completion_logprobs.tolist()
    assert (turn.content, turn.finish_reason) == (expected_turn.content, expected_turn.finish_reason)
    assert agent_gets == expected_reply
    return turn


@pytest.mark.parametrize("asked", [NOT_ASKED, ASKED])
def test_a_vllm_reply_gives_the_same_turn_and_reply_as_a_whole_parse(asked):
    turn = assert_same(orjson.dumps(reply()), asked)
    assert turn.prompt_ids.tolist() == [5, 17, 2_000_000, 0, 9]


def test_a_long_prompt_is_read_exactly():
    ids = np.random.default_rng(0).integers(0, 2**31 - 1, 40_000)
    turn = assert_same(orjson.dumps(reply(ids.tolist())), NOT_ASKED)
    assert turn.prompt_ids.tolist() == ids.tolist()


@pytest.mark.parametrize(
    "raw",
    [
        orjson.dumps(reply()).replace(b"[5,17", b"[5, 17"),  # spaces: valid JSON, not vLLM's
        orjson.dumps(reply(usage={"prompt_tokens": 4, "completion_tokens": 2})),  # counts disagree
        orjson.dumps(reply(prompt_ids=[])),  # nothing to read
        orjson.dumps(reply(prompt_ids=[1, 2**31])),  # beyond the stored ids' range
        orjson.dumps(reply(prompt_token_ids=None, extra={"prompt_token_ids": [1, 2, 3, 4, 5]})),  # nested
        orjson.dumps(reply(prompt_token_ids=None)),
    ],
    ids=["spaces", "usage", "empty", "range", "nested", "null"],
)
def test_anything_but_vllm_s_own_bytes_is_parsed_whole(raw):
    try:
        expected = parsed_whole(raw, NOT_ASKED)
    except OverflowError:  # ids beyond int32: the whole parse fails the same way
        with pytest.raises(OverflowError):
            captured(raw, NOT_ASKED)
        return
    turn, agent_gets = captured(raw, NOT_ASKED)
    assert turn.prompt_ids.tolist() == expected[0].prompt_ids.tolist()
    assert agent_gets == expected[1]


def test_a_reply_that_is_not_json_is_a_502_either_way():
    for raw in (orjson.dumps(reply())[:-1], orjson.dumps(reply()).replace(b"[5,17", b"[5,,17")):
        with pytest.raises(ApiError) as caught:
            captured(raw, NOT_ASKED)
        assert caught.value.status_code == 502


def test_completions_replies_keep_their_choice_level_prompt_ids():
    body = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "tiny",
        "choices": [
            {"index": 0, "text": "ok", "finish_reason": "stop", "token_ids": [7], "prompt_token_ids": [1, 2]}
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    }
    turn, _ = captured(orjson.dumps(body), NOT_ASKED, CompletionCapture)
    assert turn.prompt_ids.tolist() == [1, 2]


def stream_chunk(prompt_ids: Any, index: int) -> dict[str, Any]:
    """One event of vLLM's chat stream with `return_token_ids`: the first carries the prompt's ids."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "delta": {"content": "ok"[index]},
                "logprobs": {"content": [{"token": "ok"[index], "logprob": -0.5}]},
                "finish_reason": "stop" if index == 1 else None,
                "token_ids": [7 + index],
            }
        ],
        "usage": None,
        "prompt_token_ids": list(prompt_ids) if index == 0 else None,
    }


@pytest.mark.parametrize("asked", [NOT_ASKED, ASKED])
def test_a_streams_first_event_gives_the_same_turn_and_chunks_as_a_whole_parse(asked):
    ids = np.random.default_rng(1).integers(0, 2**31 - 1, 20_000).tolist()
    events = [orjson.dumps(stream_chunk(ids, index)) for index in range(2)]
    read, whole = (ChatCapture(TurnRecord("r1", "chat", "tiny", True, "v0", 1.0)) for _ in range(2))
    relayed = []
    for data in events:
        chunk, expected = read.read_chunk(data, asked), orjson.loads(data)
        read.feed(chunk)
        whole.feed(expected)
        read.strip(chunk, asked)
        whole.strip(expected, asked)
        relayed.append((orjson.dumps(chunk), orjson.dumps(expected)))
    turn, expected_turn = read.finish()[0], whole.finish()[0]

    assert all(mine == theirs for mine, theirs in relayed)
    assert turn.prompt_ids.tolist() == expected_turn.prompt_ids.tolist() == ids
    assert turn.completion_ids.tolist() == [7, 8]
    assert (turn.content, turn.finish_reason) == ("ok", "stop")
