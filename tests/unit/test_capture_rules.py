"""Token capture: fields injected upstream, their collection into TurnRecords, their removal for the agent."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.errors import ApiError
from gateway.store.records import TurnRecord
from gateway.turns.capture import Asked, ChatCapture, Choice, CompletionCapture


def record(endpoint: str = "chat") -> TurnRecord:
    return TurnRecord(
        rollout_id="r1", endpoint=endpoint, model="tiny", stream=False, policy_version="v0", started_at=1.0
    )


NEITHER = Asked(token_ids=False, logprobs=False)


def parsed(return_token_ids: Any = None, logprobs: Any = None) -> SimpleNamespace:
    return SimpleNamespace(return_token_ids=return_token_ids, logprobs=logprobs)


def summary(turn: TurnRecord) -> dict[str, Any]:
    return {
        "choice_index": turn.choice_index,
        "prompt_ids": turn.prompt_ids.tolist(),
        "completion_ids": turn.completion_ids.tolist(),
        "completion_logprobs": turn.completion_logprobs.tolist(),
        "content": turn.content,
        "reasoning": turn.reasoning,
        "tool_calls": turn.tool_calls,
        "finish_reason": turn.finish_reason,
    }


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
COMPLETION = {"model": "tiny", "prompt": "Once", "max_tokens": 5}


# --- tool calls -----------------------------------------------------------------------------------------


def test_whole_tool_calls_without_index_take_the_next_index():
    choice = Choice()
    choice.merge_tool_call({"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}})
    choice.merge_tool_call({"id": "c2", "function": {"name": "cat", "arguments": None}})
    assert choice.tool_calls == {
        0: {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
        1: {"id": "c2", "type": "function", "function": {"name": "cat", "arguments": ""}},
    }


def test_streamed_tool_call_pieces_are_joined_by_index():
    choice = Choice()
    pieces = [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "ls"}},
        {"index": 1, "id": "c2", "type": "function", "function": {"name": "cat", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"pa'}},
        {"index": 1, "function": {"arguments": '{"file": "a"}'}},
        {"index": 0, "function": {"arguments": 'th": "/"}'}},
    ]
    for piece in pieces:
        choice.merge_tool_call(piece)
    assert choice.tool_calls == {
        0: {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/"}'}},
        1: {"id": "c2", "type": "function", "function": {"name": "cat", "arguments": '{"file": "a"}'}},
    }


def test_later_pieces_set_a_missing_id_and_name():
    choice = Choice()
    choice.merge_tool_call({"index": 0, "function": {"arguments": "{"}})
    choice.merge_tool_call({"index": 0, "id": "c9", "function": {"name": "ls", "arguments": "}"}})
    assert choice.tool_calls == {
        0: {"id": "c9", "type": "function", "function": {"arguments": "{}", "name": "ls"}}
    }


def test_the_first_piece_is_copied_not_kept():
    function = {"name": "ls", "arguments": "{"}
    choice = Choice()
    choice.merge_tool_call({"index": 0, "function": function})
    choice.merge_tool_call({"index": 0, "function": {"arguments": "}"}})
    assert function == {"name": "ls", "arguments": "{"}


# --- inject ---------------------------------------------------------------------------------------------


def test_chat_upstream_always_asks_for_token_ids_and_logprobs():
    upstream, asked = ChatCapture(record()).inject(CHAT, parsed())
    assert upstream == {**CHAT, "return_token_ids": True, "logprobs": True}
    assert asked == Asked(token_ids=False, logprobs=False)
    assert "logprobs" not in CHAT


def test_chat_asked_flags_come_from_the_agents_own_request():
    body = {**CHAT, "return_token_ids": True, "logprobs": True, "top_logprobs": 2}
    upstream, asked = ChatCapture(record()).inject(body, parsed(True, True))
    assert upstream == body
    assert asked == Asked(token_ids=True, logprobs=True)
    assert ChatCapture(record()).inject(CHAT, parsed(False, False))[1] == Asked(False, False)
    assert ChatCapture(record()).inject(CHAT, parsed(True, None))[1] == Asked(True, False)


def test_chat_top_logprobs_without_logprobs_is_refused_in_vllms_words():
    for top in (2, -1):
        with pytest.raises(ApiError) as raised:
            ChatCapture(record()).inject({**CHAT, "top_logprobs": top}, parsed())
        error = raised.value
        assert (error.status_code, error.code, error.param, error.kind) == (
            400,
            400,
            "top_logprobs",
            "BadRequestError",
        )
        assert error.message == (
            "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"
        )


def test_chat_top_logprobs_zero_or_with_logprobs_is_accepted():
    assert ChatCapture(record()).inject({**CHAT, "top_logprobs": 0}, parsed())[0]["top_logprobs"] == 0
    body = {**CHAT, "logprobs": True, "top_logprobs": 3}
    assert ChatCapture(record()).inject(body, parsed(None, True))[0]["top_logprobs"] == 3


def test_chat_logprob_token_ids_without_logprobs_is_refused_in_vllms_words():
    for logprobs in (None, False):
        with pytest.raises(ApiError) as raised:
            ChatCapture(record()).inject({**CHAT, "logprob_token_ids": [5], "logprobs": logprobs}, parsed())
        error = raised.value
        assert (error.status_code, error.code, error.param, error.kind) == (
            400,
            400,
            "logprob_token_ids",
            "BadRequestError",
        )
        assert error.message == (
            "when using `logprob_token_ids`, `logprobs` must be set to true. (parameter=logprob_token_ids)"
        )


def test_completions_upstream_asks_for_token_ids_and_sampled_logprobs():
    upstream, asked = CompletionCapture(record("completions")).inject(COMPLETION, parsed())
    assert upstream == {**COMPLETION, "return_token_ids": True, "logprobs": 0}
    assert asked == Asked(token_ids=False, logprobs=False)
    assert "logprobs" not in COMPLETION


def test_completions_keep_the_agents_logprobs_and_ask_for_them_even_at_zero():
    capture = CompletionCapture(record("completions"))
    upstream, asked = capture.inject({**COMPLETION, "logprobs": 3}, parsed(True, 3))
    assert (upstream["logprobs"], asked) == (3, Asked(token_ids=True, logprobs=True))
    upstream, asked = capture.inject({**COMPLETION, "logprobs": 0}, parsed(None, 0))
    assert (upstream["logprobs"], asked) == (0, Asked(token_ids=False, logprobs=True))


def test_request_fields_split_tools_from_parameters():
    body = {**CHAT, "tools": [{"type": "function"}], "temperature": 0.5}
    assert ChatCapture.request_fields(body) == {
        "tools": [{"type": "function"}],
        "params": {"model": "tiny", "max_tokens": 5, "temperature": 0.5},
    }
    assert CompletionCapture.request_fields(COMPLETION) == {
        "tools": None,
        "params": {"model": "tiny", "max_tokens": 5},
    }


# --- feed and finish: chat ------------------------------------------------------------------------------


def logprobs_content(*values: float) -> dict[str, Any]:
    return {"content": [{"token": f"t{i}", "logprob": v, "top_logprobs": []} for i, v in enumerate(values)]}


CALL = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/"}'}}
WHOLE_CHAT: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "prompt_token_ids": [1, 2, 3],
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Listing.",
                "reasoning": "Use ls.",
                "tool_calls": [CALL],
            },
            "logprobs": logprobs_content(-0.5, -0.25, -0.125),
            "finish_reason": "tool_calls",
            "token_ids": [7, 8, 2],
        }
    ],
}


def test_whole_chat_reply_gives_one_record_with_ids_logprobs_and_reply():
    capture = ChatCapture(record())
    capture.feed(copy.deepcopy(WHOLE_CHAT))
    (turn,) = capture.finish()
    assert turn is capture.record
    assert summary(turn) == {
        "choice_index": 0,
        "prompt_ids": [1, 2, 3],
        "completion_ids": [7, 8, 2],
        "completion_logprobs": [-0.5, -0.25, -0.125],
        "content": "Listing.",
        "reasoning": "Use ls.",
        "tool_calls": [CALL],
        "finish_reason": "tool_calls",
    }
    assert (turn.prompt_ids.dtype.str, turn.completion_logprobs.dtype.str) == ("<i4", "<f4")


def chunk(
    delta: dict[str, Any],
    token_ids: list[int] | None,
    logprobs: dict[str, Any] | None = None,
    *,
    index: int = 0,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "token_ids": token_ids, "logprobs": logprobs}
    return {"choices": [{**choice, "finish_reason": finish_reason}]}


STREAMED_CHAT: list[dict[str, Any]] = [
    {
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}],
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"reasoning_content": "Use "},
                "token_ids": [7],
                "logprobs": logprobs_content(-0.5),
            }
        ]
    },
    chunk({"reasoning": "ls."}, [8], logprobs_content(-1)),
    chunk({"content": "Lis"}, [9], logprobs_content(-3)),
    chunk({"content": "ting."}, [10], logprobs_content(-4)),
    {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "ls"}}]
                },
                "token_ids": [11],
                "logprobs": logprobs_content(-2),
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"path": "/"}'}}]},
                "token_ids": [12, 2],
                "logprobs": logprobs_content(-0.25, -0.125),
                "finish_reason": "tool_calls",
            }
        ]
    },
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}},
]
"""A streamed chat reply with reasoning, text and a tool call, as vLLM sends it with ids and logprobs."""


def test_streamed_chat_chunks_accumulate_into_one_record():
    capture = ChatCapture(record())
    for piece in copy.deepcopy(STREAMED_CHAT):
        capture.take(piece, NEITHER)
    (turn,) = capture.finish()
    assert summary(turn) == {
        "choice_index": 0,
        "prompt_ids": [1, 2, 3],
        "completion_ids": [7, 8, 9, 10, 11, 12, 2],
        "completion_logprobs": [-0.5, -1.0, -3.0, -4.0, -2.0, -0.25, -0.125],
        "content": "Listing.",
        "reasoning": "Use ls.",
        "tool_calls": [CALL],
        "finish_reason": "tool_calls",
    }


@pytest.mark.parametrize("token_ids", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_a_taken_stream_chunk_is_captured_and_stripped_as_feed_and_strip_do(token_ids: bool, logprobs: bool):
    asked = Asked(token_ids=token_ids, logprobs=logprobs)
    empty = chunk({}, [13], logprobs_content(-1.5))
    chunks = [*copy.deepcopy(STREAMED_CHAT), empty, chunk({"content": "z"}, [14], index=1)]
    taken, fed = ChatCapture(record()), ChatCapture(record())
    sent = []
    for piece in chunks:
        mine, theirs = copy.deepcopy(piece), copy.deepcopy(piece)
        sent.append(taken.take(mine, asked))
        fed.feed(theirs)
        fed.strip(theirs, asked)
        assert mine == theirs
    assert [summary(turn) for turn in taken.finish()] == [summary(turn) for turn in fed.finish()]
    assert sent == [True] * len(STREAMED_CHAT) + [token_ids or logprobs, True]


def test_several_choices_give_one_record_each_in_choice_order():
    reply = {
        "prompt_token_ids": [1, 2],
        "choices": [
            {"index": 1, "message": {"content": "B"}, "token_ids": [6, 2], "finish_reason": "stop"},
            {"index": 0, "message": {"content": "A"}, "token_ids": [5, 2], "finish_reason": "stop"},
            {"index": 2, "message": {"content": "C"}, "token_ids": [7], "finish_reason": "length"},
        ],
    }
    capture = ChatCapture(record())
    capture.feed(reply)
    turns = capture.finish()
    assert [(t.choice_index, t.content, t.completion_ids.tolist(), t.finish_reason) for t in turns] == [
        (0, "A", [5, 2], "stop"),
        (1, "B", [6, 2], "stop"),
        (2, "C", [7], "length"),
    ]
    assert [t.prompt_ids.tolist() for t in turns] == [[1, 2], [1, 2], [1, 2]]
    assert turns[0] is capture.record
    assert [(t.rollout_id, t.endpoint, t.started_at) for t in turns[1:]] == [("r1", "chat", 1.0)] * 2


def test_interleaved_stream_chunks_of_several_choices_stay_apart():
    capture = ChatCapture(record())
    capture.take({"prompt_token_ids": [1], **chunk({"content": "a"}, [5])}, NEITHER)
    capture.take(chunk({"content": "x"}, [8], index=1), NEITHER)
    capture.take(chunk({"content": "b"}, [6], finish_reason="stop"), NEITHER)
    capture.take(chunk({"content": "y"}, [9], index=1, finish_reason="stop"), NEITHER)
    assert [(t.choice_index, t.content, t.completion_ids.tolist()) for t in capture.finish()] == [
        (0, "ab", [5, 6]),
        (1, "xy", [8, 9]),
    ]


def test_nothing_generated_finishes_with_one_empty_record():
    (turn,) = ChatCapture(record()).finish()
    assert summary(turn) == {
        "choice_index": 0,
        "prompt_ids": [],
        "completion_ids": [],
        "completion_logprobs": [],
        "content": None,
        "reasoning": None,
        "tool_calls": None,
        "finish_reason": None,
    }


# --- feed and finish: completions -----------------------------------------------------------------------


def test_whole_completion_gives_prompt_ids_from_the_choice():
    reply = {
        "choices": [
            {
                "index": 0,
                "text": " upon a time",
                "prompt_token_ids": [1, 2],
                "token_ids": [7, 8, 9],
                "logprobs": {"tokens": ["a", "b", "c"], "token_logprobs": [-0.5, -0.25, -2.0]},
                "finish_reason": "length",
            }
        ]
    }
    capture = CompletionCapture(record("completions"))
    capture.feed(reply)
    (turn,) = capture.finish()
    assert summary(turn) == {
        "choice_index": 0,
        "prompt_ids": [1, 2],
        "completion_ids": [7, 8, 9],
        "completion_logprobs": [-0.5, -0.25, -2.0],
        "content": " upon a time",
        "reasoning": None,
        "tool_calls": None,
        "finish_reason": "length",
    }


def test_completion_with_echo_keeps_only_the_sampled_logprobs():
    reply = {
        "choices": [
            {
                "index": 0,
                "text": "Once upon",
                "prompt_token_ids": [1, 2],
                "token_ids": [7],
                "logprobs": {"token_logprobs": [None, -3.0, -0.5]},
                "finish_reason": "length",
            }
        ]
    }
    capture = CompletionCapture(record("completions"))
    capture.feed(reply)
    (turn,) = capture.finish()
    assert (turn.completion_ids.tolist(), turn.completion_logprobs.tolist()) == ([7], [-0.5])


def test_streamed_completion_chunks_accumulate():
    chunks = [
        {"choices": [{"index": 0, "text": "", "prompt_token_ids": [1, 2], "token_ids": None}]},
        {"choices": [{"index": 0, "text": " up", "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "text": "on",
                    "token_ids": [8],
                    "logprobs": {"token_logprobs": [-0.25]},
                    "finish_reason": "length",
                }
            ]
        },
    ]
    capture = CompletionCapture(record("completions"))
    for piece in chunks:
        capture.feed(piece)
    (turn,) = capture.finish()
    assert (turn.prompt_ids.tolist(), turn.completion_ids.tolist(), turn.completion_logprobs.tolist()) == (
        [1, 2],
        [7, 8],
        [-0.5, -0.25],
    )
    assert (turn.content, turn.finish_reason) == (" upon", "length")


# --- strip ----------------------------------------------------------------------------------------------


def test_strip_nulls_the_token_ids_and_logprobs_the_agent_did_not_ask_for():
    payload = copy.deepcopy(WHOLE_CHAT)
    ChatCapture(record()).strip(payload, Asked(token_ids=False, logprobs=False))
    expected = copy.deepcopy(WHOLE_CHAT)
    expected["prompt_token_ids"] = None
    expected["choices"][0].update(token_ids=None, logprobs=None)
    assert payload == expected


def test_strip_leaves_what_the_agent_asked_for():
    payload = copy.deepcopy(WHOLE_CHAT)
    ChatCapture(record()).strip(payload, Asked(token_ids=True, logprobs=True))
    assert payload == WHOLE_CHAT


def test_strip_treats_token_ids_and_logprobs_separately():
    only_ids = copy.deepcopy(WHOLE_CHAT)
    ChatCapture(record()).strip(only_ids, Asked(token_ids=True, logprobs=False))
    assert (only_ids["prompt_token_ids"], only_ids["choices"][0]["token_ids"]) == ([1, 2, 3], [7, 8, 2])
    assert only_ids["choices"][0]["logprobs"] is None
    only_logprobs = copy.deepcopy(WHOLE_CHAT)
    ChatCapture(record()).strip(only_logprobs, Asked(token_ids=False, logprobs=True))
    assert (only_logprobs["prompt_token_ids"], only_logprobs["choices"][0]["token_ids"]) == (None, None)
    assert only_logprobs["choices"][0]["logprobs"] == logprobs_content(-0.5, -0.25, -0.125)


def test_strip_nulls_a_completion_choices_prompt_ids_and_adds_no_keys():
    payload = {
        "choices": [
            {"index": 0, "text": "a", "prompt_token_ids": [1], "token_ids": [7], "logprobs": {"x": 1}},
            {"index": 1, "text": "b"},
        ]
    }
    CompletionCapture(record("completions")).strip(payload, Asked(token_ids=False, logprobs=False))
    assert payload == {
        "choices": [
            {"index": 0, "text": "a", "prompt_token_ids": None, "token_ids": None, "logprobs": None},
            {"index": 1, "text": "b"},
        ]
    }


def stripped(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """A chunk as the agent would get it, stripped of the ids and logprobs the gateway asked for."""
    return chunk(delta, None, finish_reason=finish_reason)


def test_an_empty_delta_is_held_back_from_an_agent_that_asked_for_neither_ids_nor_logprobs():
    assert ChatCapture(record()).take(stripped({}), NEITHER) is False


def test_an_empty_delta_is_sent_to_an_agent_that_asked_for_ids_or_logprobs():
    capture = ChatCapture(record())
    assert capture.take(stripped({}), Asked(token_ids=True, logprobs=False)) is True
    assert capture.take(stripped({}), Asked(token_ids=False, logprobs=True)) is True


@pytest.mark.parametrize(
    "sent",
    [
        stripped({"role": "assistant", "content": ""}),
        stripped({"content": "a"}),
        stripped({"reasoning": "b"}),
        stripped({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}),
        stripped({}, finish_reason="stop"),
        {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {"completion_tokens": 3}},
    ],
    ids=["role", "content", "reasoning", "tool_call", "finish", "usage"],
)
def test_a_chunk_with_a_delta_a_finish_or_usage_is_sent(sent: dict[str, Any]):
    assert ChatCapture(record()).take(sent, NEITHER) is True


def test_a_completion_chunk_is_always_sent():
    empty_text = {"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]}
    assert CompletionCapture(record("completions")).take(empty_text, NEITHER) is True
