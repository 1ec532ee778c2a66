"""What a trainer reads (`trainer_client`) of rollouts recorded in process against a scripted engine."""

from __future__ import annotations

import pytest
from fake_engine import chat_reply

from trainer_client import TrainerClient

pytestmark = pytest.mark.anyio


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
