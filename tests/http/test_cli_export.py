"""`trainer-client export --group-id G` and `--since TIME` choose the groups written, as they choose what
`score` scores: one group, or the groups whose rollouts were all created at or after TIME."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from trainer_client.cli import main as trainer_client

from support.fake_engine import chat_reply

pytestmark = pytest.mark.anyio


async def finished_group(gw, group_id: str) -> None:
    """A ready group of two one-call rollouts, rewarded 0 and 1."""
    for reward in (0.0, 1.0):
        rollout_id = f"{group_id}-{reward:g}"
        created = await gw.client.post("/rollouts", json={"rollout_id": rollout_id, "group_id": group_id})
        assert created.status_code == 201, created.text
        gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3], [7, 8], "ok"))
        assert (await gw.chat(rollout_id)).status_code == 200
        finished = await gw.client.post(f"/rollouts/{rollout_id}/finish", json={"reward": reward})
        assert finished.status_code == 200, finished.text


def exported_groups(db: str, out: Path, *argv: str) -> list[str]:
    assert trainer_client(["export", "--db", db, "-o", str(out), *argv]) == 0
    return [json.loads(line)["group_id"] for line in out.read_text().splitlines()]


async def test_export_writes_the_one_group_named_or_the_groups_since_a_time(gw, tmp_path: Path, capsys):
    await finished_group(gw, "early")
    between = time.time()
    await finished_group(gw, "late-1")
    await finished_group(gw, "late-2")
    out = tmp_path / "samples.jsonl"

    assert exported_groups(gw.db, out) == ["early"] * 2 + ["late-1"] * 2 + ["late-2"] * 2
    assert exported_groups(gw.db, out, "--group-id", "late-1") == ["late-1"] * 2
    assert exported_groups(gw.db, out, "--since", str(between)) == ["late-1"] * 2 + ["late-2"] * 2
    assert exported_groups(gw.db, out, "--group-id", "unknown") == []
    assert capsys.readouterr().err.splitlines()[-1] == f"wrote 0 samples to {out}"


async def test_export_takes_one_choice_of_groups_at_a_time(gw, tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as stopped:
        trainer_client(["export", "--db", gw.db, "-o", "-", "--group-id", "g", "--since", "0"])

    assert (stopped.value.code, capsys.readouterr().err) == (
        2,
        "trainer-client export: error: argument --since: not allowed with argument --group-id\n",
    )
