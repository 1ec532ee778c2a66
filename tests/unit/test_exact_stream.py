"""Exact mode's end-token trimming: derender must not show an EOS or stop token vLLM's chat hides."""

from __future__ import annotations

from typing import Any

from gateway.turns.exact import without_end_token


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
