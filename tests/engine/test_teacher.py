"""Teacher scores (`trainer-client score`) on rollouts made through the real gateway, scored by a real teacher
vLLM (the tiny model fine-tuned on the toy task, as `scripts/dev demo --distill` makes it), on SQLite and
PostgreSQL, read back through the trainer_client API and the export; and distillation end to end, a student
on the trainable vLLM learning from that teacher."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import pytest
import sqlalchemy as sa

from trainer_client import SampleOptions, TrainerClient
from trainer_client.cli import main

import support
from support import TIMEOUT, VLLM_HEADERS, VLLM_KEY, run_rollout


@pytest.fixture
def store(start_gateway, databases, db_kind):
    """A gateway on an empty database of its own."""
    db_url = databases.new(db_kind)
    return start_gateway(db_url), db_url


class Result(NamedTuple):
    returncode: int
    stderr: str


@pytest.fixture
def score(capsys):
    """`trainer-client score` against a teacher, run in this process (`command=True`: as a command)."""

    def run(
        db_url: str, teacher_url: str, *args: str, model: str = "teacher", command: bool = False
    ) -> Result:
        argv = [
            "score",
            "--db",
            db_url,
            "--teacher",
            teacher_url,
            "--model",
            model,
            "--api-key",
            VLLM_KEY,
            *args,
        ]
        if command:
            done = subprocess.run(
                [sys.executable, "-m", "trainer_client.cli", *argv],
                capture_output=True,
                text=True,
                timeout=300,
            )
            return Result(done.returncode, done.stderr)
        capsys.readouterr()
        try:
            code = main(argv)
        except SystemExit as usage:  # a usage error, as argparse ends one
            code = int(usage.code or 0)
        return Result(code, capsys.readouterr().err)

    return run


def scored_turns(result: Result) -> int:
    assert result.returncode == 0, result.stderr
    match = re.search(r"^scored (\d+) turns", result.stderr, re.MULTILINE)
    assert match, result.stderr
    return int(match.group(1))


def teacher_answer(teacher, ids: np.ndarray) -> np.ndarray:
    """What the teacher returns when asked directly: its prompt logprob of each of `ids` (0 for the first)."""
    body = {"model": "teacher", "prompt": ids.tolist(), "max_tokens": 1, "prompt_logprobs": 0}
    reply = httpx.post(teacher.url + "/v1/completions", json=body, headers=VLLM_HEADERS, timeout=TIMEOUT)
    reply.raise_for_status()
    entries = reply.json()["choices"][0]["prompt_logprobs"]
    return np.array([0.0] + [entries[i][str(int(ids[i]))]["logprob"] for i in range(1, len(ids))], np.float32)


def test_scores_are_the_teachers_own_logprobs_of_the_stored_ids(store, teacher_vllm, score):
    gateway, db_url = store
    for reward in (1.0, 0.0):
        run_rollout(gateway, "multi", reward=reward, turns=3)
    run_rollout(gateway, "single", reward=0.5, turns=1)

    assert scored_turns(score(db_url, teacher_vllm.url, command=True)) == 7

    with TrainerClient(db_url) as client:
        steps = client.read(SampleOptions(teacher="teacher")).samples
        merged = client.read(SampleOptions(teacher="teacher", merged=True)).samples
    assert len(steps) == 7
    for sample in steps:
        assert sample.teacher_logprobs.shape == sample.completion_ids.shape
        assert sample.teacher_logprobs.dtype == np.float32
    # A chain of turns is scored as one sequence: the merged sample's ids, as the teacher answers for them.
    for sample in merged:
        loss = sample.loss_mask.astype(bool)
        direct = teacher_answer(teacher_vllm, sample.input_ids)
        assert sample.token_teacher_logprobs[loss].tolist() == direct[loss].tolist()
        assert not sample.token_teacher_logprobs[~loss].any()
    # Step-wise, each turn's scores sit in the merged sample that holds it, token for token.
    by_turn = {(s.rollout_id, t): s for s in merged for t in s.turn_indices}
    for sample in steps:
        holder = by_turn[(sample.rollout_id, sample.turn_index)]
        start = sample.prompt_length
        stop = start + len(sample.completion_ids)
        assert holder.token_teacher_logprobs[start:stop].tolist() == sample.teacher_logprobs.tolist()


def test_the_exports_with_a_teacher_write_its_logprobs_beside_the_sampling_ones(
    store, teacher_vllm, tmp_path, score, capsys
):
    from trainer_client.hf import samples_dataset

    gateway, db_url = store
    run_rollout(gateway, "g", reward=1.0, turns=2)
    scored_turns(score(db_url, teacher_vllm.url))
    output = tmp_path / "samples.jsonl"

    code = main(["export", "--db", db_url, "--teacher", "teacher", "-o", str(output)])
    rows = samples_dataset(db_url, SampleOptions(teacher="teacher"))

    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    with TrainerClient(db_url) as client:
        samples = client.read(SampleOptions(teacher="teacher")).samples
    assert [r["teacher_logprobs"] for r in records] == [s.teacher_logprobs.tolist() for s in samples]
    assert rows["teacher_logprobs"] == [s.token_teacher_logprobs.tolist() for s in samples]
    assert rows["logprobs"] == [s.token_logprobs.tolist() for s in samples]


def test_scoring_again_scores_only_what_is_new(store, teacher_vllm, score):
    gateway, db_url = store
    run_rollout(gateway, "a", reward=1.0, turns=2)
    run_rollout(gateway, "b", reward=0.0, turns=3)

    assert scored_turns(score(db_url, teacher_vllm.url, "--group-id", "a")) == 2
    assert scored_turns(score(db_url, teacher_vllm.url)) == 3  # an interrupted run resumes the same way
    assert scored_turns(score(db_url, teacher_vllm.url)) == 0
    run_rollout(gateway, "c", reward=1.0, turns=1)
    assert scored_turns(score(db_url, teacher_vllm.url)) == 1


def test_since_scores_only_the_rollouts_created_from_then_on(store, teacher_vllm, score):
    gateway, db_url = store
    run_rollout(gateway, "before", reward=1.0, turns=2)
    moment = time.time()
    run_rollout(gateway, "after", reward=1.0, turns=1)

    assert scored_turns(score(db_url, teacher_vllm.url, "--since", str(moment))) == 1
    with TrainerClient(db_url) as client:
        assert {s.group_id for s in client.read(SampleOptions(teacher="teacher")).samples} == {"after"}


def test_a_group_is_served_with_a_teacher_only_once_the_teacher_has_scored_it(store, teacher_vllm, score):
    gateway, db_url = store
    run_rollout(gateway, "g", reward=1.0, turns=2)
    options = SampleOptions(teacher="teacher")

    with TrainerClient(db_url) as client:
        before = client.read(options)
        scored_turns(score(db_url, teacher_vllm.url))
        after = client.claim("trainer", 0, options)

    assert before.samples == [] and before.counts == {}
    assert len(after.samples) == 2 and after.metrics()["teacher_kl"] > 0


def test_a_trainers_scoring_takes_the_newest_finished_groups_and_leaves_the_rest(store, teacher_vllm):
    from trainer_client.scoring import Scorer, TeacherServer
    from training_data.teacher_scores import ScoreFilter

    gateway, db_url = store
    for group in ("old", "middle", "new"):
        run_rollout(gateway, group, reward=1.0, turns=2)
    run_rollout(gateway, "running", reward=None, turns=1, finish=False)
    scorer = Scorer(db_url, TeacherServer(teacher_vllm.url, "teacher", api_key=VLLM_KEY))
    scorer.check()

    report = scorer.score(ScoreFilter(newest_groups=2))

    assert report.turns == 4  # two turns of "middle" and of "new"; "running" has not finished
    with TrainerClient(db_url) as client:
        served = client.read(SampleOptions(teacher="teacher")).samples
    assert sorted({s.group_id for s in served}) == ["middle", "new"]
    scorer.close()
    scorer.teacher.close()


def test_a_turn_longer_than_the_teachers_context_is_left_unscored_and_said_so(store, teacher_vllm, score):
    gateway, db_url = store
    created = httpx.post(gateway.url + "/rollouts", json={"group_id": "long"}, timeout=TIMEOUT).json()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a b " * 700}], "max_tokens": 4}
    assert (
        httpx.post(created["base_url"] + "/chat/completions", json=body, timeout=TIMEOUT).status_code == 200
    )

    result = score(db_url, teacher_vllm.url)

    assert scored_turns(result) == 0
    rollout = created["rollout_id"]
    assert f"left 1 turns unscored: longer than the teacher's context (first: rollout {rollout} turn 0)" in (
        result.stderr
    )


def test_a_teacher_that_does_not_serve_the_model_is_refused(store, teacher_vllm, score):
    gateway, db_url = store
    run_rollout(gateway, "g", reward=1.0, turns=1)

    result = score(db_url, teacher_vllm.url, model="student")

    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"trainer-client score: error: {teacher_vllm.url} serves ['teacher'], not 'student'"
    )


def test_an_unreachable_teacher_is_a_one_line_error(store, score):
    _gateway, db_url = store

    result = score(db_url, "http://127.0.0.1:9")

    assert result.returncode == 1
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("trainer-client score: error: http://127.0.0.1:9/v1/models: ConnectError")
    )


def test_a_store_without_rollouts_needs_the_policys_server_named(store, teacher_vllm, score):
    _gateway, db_url = store

    result = score(db_url, teacher_vllm.url)

    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "trainer-client score: error: no rollout names its vLLM server: give the policy's server with "
        "--policy URL"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--since", "yesterday"],
            "trainer-client score: error: argument --since: 'yesterday' is neither ISO 8601 nor seconds",
        ),
        (["--batch-tokens", "0"], "trainer-client score: error: argument --batch-tokens: must be at least 1"),
    ],
)
def test_bad_score_arguments_are_one_line_errors(args, message, tmp_path: Path, score):
    result = score(f"sqlite:///{tmp_path / 'x.db'}", "http://127.0.0.1:9", *args)

    assert (result.returncode, result.stderr.strip()) == (2, message)


def test_distillation_through_the_gateway_moves_the_student_to_the_teacher(
    policy_vllm, teacher_vllm, start_gateway, databases
):
    from rollout_store.database import make_engine
    from testbed.demo.train import distill_config
    from trainer_client.reference.loop import run_loop

    db_url = databases.new("postgresql")
    gateway = start_gateway(db_url, backends=[policy_vllm.url])
    config = distill_config(
        policy_vllm.model_dir,
        db_url,
        gateway.url,
        teacher_vllm.url,
        steps=10,
        groups_per_step=2,
        group_size=8,
    )
    distill = dataclasses.replace(config.trainer.distill, api_key=support.VLLM_KEY)
    trainer = dataclasses.replace(config.trainer, distill=distill, max_staleness=1)
    config = dataclasses.replace(config, trainer=trainer, eval_groups=1)

    result = run_loop(config)

    kl = [step.teacher_kl for step in result.steps]
    rewards = result.reward_by_version("training")
    # Measured (2 cores): 12.96 nats a token at the first step, 8.84 at the eighth, and the reward, never
    # trained on, 0.13 at version 0 and 1.0 from version 7 (the demo's 4 groups a step reach 0.01 nats by the
    # eighth step).
    assert kl[-1] < kl[0] - 2.0
    assert rewards["10"] > rewards["0"] + 0.1
    # Every trained turn was scored by the teacher before its group was served (the documented SQL).
    engine = make_engine(db_url)
    with engine.connect() as conn:
        unscored = conn.execute(
            sa.text(
                "SELECT COUNT(*) FROM turns t JOIN rollouts r USING (rollout_id) "
                "LEFT JOIN teacher_scores s ON s.turn_id = t.turn_id AND s.teacher = 'teacher' "
                "WHERE r.claimed_by IS NOT NULL AND r.skip_reason IS NULL AND s.turn_id IS NULL"
            )
        ).scalar()
    engine.dispose()
    assert unscored == 0
