"""Completions calls (prompt given as ids) in process: each turn's parent is found on the ids it extends."""

from __future__ import annotations

from typing import Any

import pytest

from support.fake_engine import FakeReply, json_reply

pytestmark = pytest.mark.anyio


def completion_reply(prompt_ids: list[int], token_ids: list[int]) -> FakeReply:
    """A whole completion as vLLM answers a request with `return_token_ids` and `logprobs`."""
    choice = {
        "index": 0,
        "text": "".join(f"<{t}>" for t in token_ids),
        "finish_reason": "stop",
        "logprobs": {"token_logprobs": [-0.5] * len(token_ids), "tokens": [f"t{t}" for t in token_ids]},
        "token_ids": token_ids,
        "prompt_token_ids": prompt_ids,
    }
    return json_reply(
        {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 1,
            "model": "tiny",
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids)},
        }
    )


async def complete(gw: Any, rollout_id: str, prompt: list[int], completion: list[int]) -> None:
    gw.engine.answer("/v1/completions", completion_reply(prompt, completion))
    answer = await gw.client.post(
        f"/rollouts/{rollout_id}/v1/completions", json={"model": "tiny", "prompt": prompt}
    )
    assert answer.status_code == 200, answer.text


async def test_a_completions_turn_extending_an_older_turn_records_it_as_parent(gw):
    await complete(gw, "r1", [1, 2, 3], [4, 5])  # turn 0
    await complete(gw, "r1", [7, 8], [9])  # turns 1 and 2: other prompts, in between
    await complete(gw, "r1", [7, 8, 9, 6], [9])
    await complete(gw, "r1", [1, 2, 3, 4, 5, 10], [11])  # extends turn 0

    turns = (await gw.rollout("r1"))["turns"]
    placed = [(t["parent_turn"], t["forked_from"], t["prefix_tokens"], t["drift_tokens"]) for t in turns]
    assert placed == [(None, None, 0, None), (None, None, 0, None), (1, None, 3, 0), (0, None, 5, 0)]
    assert turns[3]["prompt_token_ids"] == [1, 2, 3, 4, 5, 10]
