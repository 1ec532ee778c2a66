"""What trains of rollouts recorded in process against a scripted engine: as a trainer reads it
(`trainer_client`) and as the viewer shows it."""

from __future__ import annotations

import math

import pytest

from trainer_client import SampleOptions, TrainerClient

from support.fake_engine import FakeReply, chat_reply, json_reply

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "hi"}]


async def finished_rollout(gw, rollout_id: str, completion: list[int], reward: float) -> None:
    """A rollout of one call in group g, answered with `completion`, finished with `reward`."""
    created = await gw.client.post("/rollouts", json={"rollout_id": rollout_id, "group_id": "g"})
    assert created.status_code == 201, created.text
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3], completion, "ok" if completion else ""))
    assert (await gw.chat(rollout_id)).status_code == 200
    finished = await gw.client.post(f"/rollouts/{rollout_id}/finish", json={"reward": reward})
    assert finished.status_code == 200, finished.text


async def test_batch_metrics_count_the_rollouts_with_samples_and_the_served_ones_apart(gw):
    await finished_rollout(gw, "a", [7, 8], 1.0)
    await finished_rollout(gw, "b", [], 0.0)  # served, but its only call sampled nothing: no sample

    with TrainerClient(gw.db) as client:
        batch = client.read()

    assert [s.rollout_id for s in batch.samples] == ["a"]
    metrics = batch.metrics()
    assert (metrics["rollouts"], metrics["served_rollouts"], metrics["samples"]) == (1.0, 2.0, 1.0)


def choices_reply(prompt_ids: list[int], completions: list[list[int]]) -> FakeReply:
    """A whole chat completion with one choice per completion (a call with `n` > 1)."""
    choices = [
        {
            "index": index,
            "message": {"role": "assistant", "content": f"choice {index}"},
            "logprobs": {"content": [{"token": f"t{t}", "logprob": -0.5, "bytes": None} for t in ids]},
            "finish_reason": "stop",
            "token_ids": ids,
        }
        for index, ids in enumerate(completions)
    ]
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": sum(map(len, completions))}
    return json_reply(
        {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": "tiny",
         "prompt_token_ids": prompt_ids, "choices": choices, "usage": usage}
    )  # fmt: skip


async def call_with_choices(gw, rollout_id: str, completions: list[list[int]], group_id: str = "g") -> None:
    """One call of the rollout's agent with `n` = len(completions) choices."""
    await gw.client.post("/rollouts", json={"rollout_id": rollout_id, "group_id": group_id})
    gw.engine.answer("/v1/chat/completions", choices_reply([1, 2, 3], completions))
    assert (await gw.chat(rollout_id, n=len(completions))).status_code == 200


async def reward(gw, rollout_id: str, value: float, turn_index: int | None = None) -> None:
    body = {"reward": value} if turn_index is None else {"reward": value, "turn_index": turn_index}
    answer = await gw.client.post(f"/rollouts/{rollout_id}/reward", json=body)
    assert answer.status_code == 200, answer.text


def outcomes(batch) -> list[tuple[str, int, float, float]]:
    return [(s.rollout_id, s.turn_index, s.reward, s.advantage) for s in batch.samples]


async def test_choices_rewarded_one_by_one_train_with_advantages_across_their_call(gw):
    await call_with_choices(gw, "a", [[7], [8], [9]])
    for turn, value in [(0, 0.0), (1, 0.0), (2, 0.5), (0, 1.0)]:  # turn 0's latest reward is 1.0
        await reward(gw, "a", value, turn)
    assert (await gw.client.post("/rollouts/a/finish")).status_code == 200  # no rollout reward

    with TrainerClient(gw.db) as client:
        centred = client.read(SampleOptions(normalize_std=False))
        claimed = client.claim("trainer", 0)

    assert outcomes(centred) == [("a", 0, 1.0, 0.5), ("a", 1, 0.0, -0.5), ("a", 2, 0.5, 0.0)]
    scale = math.sqrt(0.5 / 3) + 1e-6  # the std of 1.0, 0.0 and 0.5, plus epsilon
    assert outcomes(claimed) == [("a", 0, 1.0, 0.5 / scale), ("a", 1, 0.0, -0.5 / scale), ("a", 2, 0.5, 0.0)]
    assert claimed.counts == {"groups": 1, "served_rollouts": 1, "masked_rollouts": 0, "dropped_groups": 0}


async def test_a_call_with_a_choice_left_unrewarded_trains_with_the_rollout_reward(gw):
    await call_with_choices(gw, "a", [[7], [8], [9]])
    await reward(gw, "a", 1.0, 0)
    await reward(gw, "a", 0.0, 1)
    await gw.client.post("/rollouts/a/finish")

    with TrainerClient(gw.db) as client:
        unrewarded = client.read()
        await reward(gw, "a", 0.25)
        rewarded = client.read()

    assert (unrewarded.samples, unrewarded.counts["skipped_no_reward"]) == ([], 1)
    assert outcomes(rewarded) == [("a", 0, 0.25, 0.0), ("a", 1, 0.25, 0.0), ("a", 2, 0.25, 0.0)]


async def test_samples_outside_the_rewarded_choices_need_and_keep_the_rollouts_reward(gw):
    await call_with_choices(gw, "a", [[7], [8]])
    await reward(gw, "a", 3.0, 0)
    await reward(gw, "a", 1.0, 1)
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3, 7, 4], [5], "then"))
    assert (await gw.chat("a")).status_code == 200  # a later call of one choice
    await gw.client.post("/rollouts/a/finish")
    await finished_rollout(gw, "b", [6], 0.0)

    with TrainerClient(gw.db) as client:
        unrewarded = client.read(SampleOptions(normalize_std=False))
        await reward(gw, "a", 1.0)
        rewarded = client.read(SampleOptions(normalize_std=False))

    assert (outcomes(unrewarded), unrewarded.counts["skipped_no_reward"]) == ([("b", 0, 0.0, 0.0)], 1)
    assert outcomes(rewarded) == [
        ("a", 0, 3.0, 1.0),
        ("a", 1, 1.0, -1.0),
        ("a", 2, 1.0, 0.5),
        ("b", 0, 0.0, -0.5),
    ]


async def test_merged_samples_keep_each_choice_apart_with_its_own_advantage(gw):
    await call_with_choices(gw, "a", [[7, 0], [8, 0]])
    await reward(gw, "a", 1.0, 0)
    await reward(gw, "a", 0.0, 1)
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3, 8, 0, 4], [5], "then"))
    went_on = [*HI, {"role": "assistant", "content": "choice 1"}, {"role": "user", "content": "more"}]
    assert (await gw.chat("a", messages=went_on)).status_code == 200  # extends choice 1 exactly
    await gw.client.post("/rollouts/a/finish", json={"reward": 0.5})

    with TrainerClient(gw.db) as client:
        merged = client.read(SampleOptions(merged=True, normalize_std=False)).samples

    assert [(s.turn_indices, s.reward, s.advantage) for s in merged] == [
        ([0], 1.0, 0.5),
        ([1], 0.0, -0.5),
        ([2], 0.5, 0.0),
    ]
    assert merged[2].input_ids.tolist() == [1, 2, 3, 8, 0, 4, 5]
    assert merged[2].loss_mask.tolist() == [0, 0, 0, 0, 0, 0, 1]  # choice 1's ids trained in its own sample


async def test_the_viewer_shows_each_choice_with_the_advantage_the_trainer_gives_it(gw):
    await call_with_choices(gw, "a", [[7], [8]])
    await reward(gw, "a", 1.0, 0)
    await reward(gw, "a", 0.0, 1)
    await gw.client.post("/rollouts/a/finish")

    group = (await gw.client.get("/ui/api/groups/g")).json()
    samples = (await gw.client.get("/ui/api/rollouts/a/samples")).json()

    high, low = 0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)
    [row] = group["rollouts"]
    assert (row["reward"], row["advantage"], row["skip_reason"]) == (None, None, None)
    assert row["choices"] == [
        {"turn_index": 0, "reward": 1.0, "advantage": high},
        {"turn_index": 1, "reward": 0.0, "advantage": low},
    ]
    assert (group["trained"], group["reward_mean"]) == (1, 0.5)
    assert (samples["skip_reason"], samples["advantage"]) == (None, None)
    assert [(s["turn_indices"], s["reward"], s["advantage"]) for s in samples["samples"]] == [
        ([0], 1.0, high),
        ([1], 0.0, low),
    ]
