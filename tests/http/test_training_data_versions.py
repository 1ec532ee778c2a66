"""Each sampled token's version and staleness, as a trainer reads them: the run's versions in the order it
published them, a turn's spans from a server with the vLLM plugin, and the tokens staler than a bound masked
out of the loss, the turn kept (recorded in process against a scripted engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from rollout_store.database import make_engine
from trainer_client import SampleOptions, TrainerClient
from trainer_client.cli import main

from support.fake_engine import chat_reply

pytestmark = pytest.mark.anyio


def spans(*parts: tuple[str, int, int]) -> list[dict[str, Any]]:
    return [{"version": version, "start": start, "end": end} for version, start, end in parts]


async def admin(gw: Any, path: str, body: dict[str, Any]) -> None:
    answer = await gw.client.post(f"/admin/{path}", json=body)
    assert answer.status_code == 200, answer.text


async def finished(
    gw: Any, rollout_id: str, completion: list[int], weight_versions: Any, reward: float
) -> None:
    """A rollout of group g with one call, answered with `completion` and its spans."""
    created = await gw.client.post("/rollouts", json={"rollout_id": rollout_id, "group_id": "g"})
    assert created.status_code == 201, created.text
    reply = chat_reply([1, 2, 3], completion, "ok", spans=weight_versions)
    gw.engine.answer("/v1/chat/completions", reply)
    assert (await gw.chat(rollout_id)).status_code == 200
    done = await gw.client.post(f"/rollouts/{rollout_id}/finish", json={"reward": reward})
    assert done.status_code == 200, done.text


async def a_group_across_two_updates(gw: Any) -> None:
    """Versions 0 (the gateway's first), 1 and 2 published in that order; one reply sampled across 0 -> 1,
    one across 1 -> 2, one from a server without the plugin dispatched at 1."""
    await admin(gw, "policy_version", {"version": "1"})
    await finished(gw, "a", [5, 6, 7, 8, 0], spans(("0", 0, 3), ("1", 3, 5)), 1.0)
    await finished(gw, "c", [9, 0], None, 0.5)
    await admin(gw, "policy_version", {"version": "2"})
    await finished(gw, "b", [10, 11, 12, 0], spans(("1", 0, 2), ("2", 2, 4)), 0.0)


async def test_tokens_past_the_staleness_bound_are_masked_out_of_the_loss_and_their_turns_kept(gw):
    await a_group_across_two_updates(gw)

    with TrainerClient(gw.db) as client:
        batch = client.claim("t", 0, SampleOptions(current_version=2, max_token_staleness=1))

    by_rollout = {s.rollout_id: s for s in batch.samples}
    assert sorted(by_rollout) == ["a", "b", "c"]
    a, b, c = by_rollout["a"], by_rollout["b"], by_rollout["c"]
    assert (a.completion_versions.tolist(), a.completion_staleness.tolist()) == (
        [0, 0, 0, 1, 1],
        [2, 2, 2, 1, 1],
    )
    assert (b.completion_versions.tolist(), b.completion_staleness.tolist()) == ([1, 1, 2, 2], [1, 1, 0, 0])
    # Without spans: every token at the version the call was dispatched at.
    assert (c.completion_versions.tolist(), c.completion_staleness.tolist()) == ([1, 1], [1, 1])
    assert a.loss_mask.tolist() == [0, 0, 0, 0, 0, 0, 1, 1]  # the prompt, then the stale tokens
    assert b.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert c.loss_mask.tolist() == [0, 0, 0, 1, 1]
    tensors = batch.padded()
    row = [s.rollout_id for s in batch.samples].index("a")
    assert tensors["token_staleness"][row].tolist() == [-1, -1, -1, 2, 2, 2, 1, 1]
    assert tensors["token_versions"][row].tolist() == [-1, -1, -1, 0, 0, 0, 1, 1]
    assert tensors["advantages"][row].tolist()[:6] == [0.0] * 6


async def test_without_a_bound_every_token_trains_and_carries_its_staleness(gw):
    await a_group_across_two_updates(gw)

    with TrainerClient(gw.db) as client:
        steps = client.read(SampleOptions(current_version=2)).samples
        merged = client.read(SampleOptions(current_version=2, merged=True, max_token_staleness=0)).samples

    a = next(s for s in steps if s.rollout_id == "a")
    assert a.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert a.to_json()["token_staleness"] == [2, 2, 2, 1, 1]
    merged_b = next(s for s in merged if s.rollout_id == "b")
    assert merged_b.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert merged_b.token_staleness.tolist() == [-1, -1, -1, 1, 1, 0, 0]


async def test_a_current_version_the_run_never_published_leaves_staleness_unknown_and_masks_nothing(gw):
    await a_group_across_two_updates(gw)

    with TrainerClient(gw.db) as client:
        samples = client.read(SampleOptions(current_version=9, max_token_staleness=0)).samples

    for sample in samples:
        assert set(sample.completion_staleness.tolist()) == {-1}
        assert int(sample.loss_mask.sum()) == sample.completion_ids.shape[0]


async def test_a_version_published_again_keeps_its_first_place(gw):
    await admin(gw, "policy_version", {"version": "1"})
    await admin(gw, "policy_version", {"version": "0"})  # back to the first weights (a rollback)
    await finished(gw, "a", [5, 0], spans(("0", 0, 1), ("1", 1, 2)), 1.0)

    with TrainerClient(gw.db) as client:
        (sample,) = client.read(SampleOptions(current_version=1)).samples

    assert sample.completion_versions.tolist() == [0, 1]
    assert np.array_equal(sample.completion_staleness, np.array([1, 0]))


async def test_the_staleness_views_count_each_steps_tokens_by_updates_behind_the_claim(gw):
    await a_group_across_two_updates(gw)
    with TrainerClient(gw.db) as client:
        client.claim("t", 0, SampleOptions())

    engine = make_engine(gw.db)
    try:
        with engine.connect() as conn:
            spans_of_a = conn.execute(
                sa.text(
                    "SELECT policy, version, start_token, end_token, tokens FROM token_versions "
                    "WHERE rollout_id = 'a' ORDER BY start_token"
                )
            ).all()
            order = conn.execute(sa.text("SELECT version, version_index FROM version_order ORDER BY 2")).all()
            by_step = conn.execute(
                sa.text("SELECT step, staleness, turns, tokens FROM staleness_by_step ORDER BY staleness")
            ).all()
    finally:
        engine.dispose()

    assert [tuple(row) for row in spans_of_a] == [(None, "0", 0, 3, 3), (None, "1", 3, 5, 2)]
    assert [tuple(row) for row in order] == [("0", 0), ("1", 1), ("2", 2)]
    # Claimed after version 2: a's first 3 tokens are 2 updates behind; 2 of a's, c's 2 and 2 of b's are 1.
    assert [tuple(row) for row in by_step] == [(0, 0, 1, 2), (0, 1, 3, 6), (0, 2, 1, 3)]


@pytest.mark.parametrize("form", ["jsonl", "parquet", "hf"])
async def test_an_export_carries_each_tokens_version_and_staleness_and_the_mask(gw, tmp_path, form):
    await a_group_across_two_updates(gw)
    out = tmp_path / "samples"

    bound = ["--current-version", "2", "--max-token-staleness", "1"]
    written = main(["export", "--db", gw.db, "--format", form, "-o", str(out), *bound])

    assert written == 0
    records = {r["rollout_id"]: r for r in exported(out, form)}
    assert records["a"]["token_versions"][-5:] == [0, 0, 0, 1, 1]
    assert records["a"]["token_staleness"][-5:] == [2, 2, 2, 1, 1]
    assert records["a"]["loss_mask"][-5:] == [0, 0, 0, 1, 1]
    assert records["b"]["token_staleness"][-4:] == [1, 1, 0, 0]


def exported(out: Path, form: str) -> list[dict[str, Any]]:
    if form == "jsonl":
        return [json.loads(line) for line in out.read_text().splitlines()]
    if form == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_table(out).to_pylist())
    from datasets import load_from_disk

    return list(load_from_disk(str(out)).to_list())


def test_a_staleness_bound_without_a_current_version_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["export", "--db", "sqlite:///unused.db", "-o", "-", "--max-token-staleness", "1"])

    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "trainer-client export: error: --max-token-staleness needs --current-version"
    )
