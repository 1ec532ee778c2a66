"""trainer_client on rollouts produced through the real gateway and vLLM, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from trainer_client import SampleOptions, TrainerClient

from support import TIMEOUT, admin, run_rollout, stored_rollout, wait_for


@pytest.fixture
def store(start_gateway, databases, db_kind):
    """A gateway on an empty database of its own: claims in one test never see another test's rollouts."""
    db_url = databases.new(db_kind)
    gateway = start_gateway(db_url)
    client = TrainerClient(db_url)
    yield gateway, client, db_url
    client.close()


def test_samples_are_the_stored_turns_token_for_token(store):
    gateway, client, _db_url = store
    ids = [run_rollout(gateway, "g", reward=r, turns=3) for r in (1.0, 0.0)]

    batch = client.read()

    assert [(s.rollout_id, s.step, s.turn_index, s.is_last_step) for s in batch.samples] == [
        (rid, step, step, step == 2) for rid in ids for step in range(3)
    ]
    for sample in batch.samples:
        turn = stored_rollout(gateway, sample.rollout_id)["turns"][sample.turn_index]
        assert sample.prompt_ids.tolist() == turn["prompt_token_ids"]
        assert sample.completion_ids.tolist() == turn["completion_token_ids"]
        assert sample.logprobs.tolist() == turn["completion_logprobs"]
        assert sample.loss_mask.tolist() == [0] * len(turn["prompt_token_ids"]) + [1] * 4
        assert (sample.group_id, sample.policy_version, sample.finish_reason) == ("g", "0", "length")
        assert sample.reward == (1.0 if sample.rollout_id == ids[0] else 0.0)
    assert batch.counts == {"groups": 1, "served_rollouts": 2, "masked_rollouts": 0, "dropped_groups": 0}


def test_advantages_are_group_normalised_rewards_broadcast_to_every_step(store):
    gateway, client, _ = store
    ids = [run_rollout(gateway, "g", reward=r, turns=2) for r in (1.0, 0.0, 0.5)]
    run_rollout(gateway, "solo", reward=0.7, turns=1)

    normalised = {s.rollout_id: s.advantage for s in client.read().samples}
    centred = {s.rollout_id: s.advantage for s in client.read(SampleOptions(normalize_std=False)).samples}

    std = math.sqrt((0.25 + 0.25 + 0.0) / 3)
    assert [normalised[i] for i in ids] == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.0])
    assert [centred[i] for i in ids] == pytest.approx([0.5, -0.5, 0.0])
    assert len(normalised) == 4 and min(normalised.values()) < 0 < max(normalised.values())
    solo = [s for s in client.read().samples if s.group_id == "solo"]
    assert [s.advantage for s in solo] == [0.0]


def test_padded_and_packed_tensors_lay_out_each_sample_exactly(store):
    gateway, client, _ = store
    run_rollout(gateway, "g", reward=1.0, turns=2)
    run_rollout(gateway, "g", reward=0.0, turns=1)
    batch = client.read()
    samples = batch.samples

    padded = batch.padded(pad_id=-1)
    packed = batch.packed()

    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    assert padded["input_ids"].shape == (3, max(lengths))
    assert packed["cu_seqlens"].tolist() == [0, *np.cumsum(lengths).tolist()]
    for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
        prompt = len(sample.prompt_ids)
        assert padded["input_ids"][row, :length].tolist() == sample.input_ids.tolist()
        assert padded["input_ids"][row, length:].tolist() == [-1] * (max(lengths) - length)
        assert padded["attention_mask"][row].tolist() == [1] * length + [0] * (max(lengths) - length)
        assert padded["loss_mask"][row].tolist() == [0.0] * prompt + [1.0] * 4 + [0.0] * (
            max(lengths) - length
        )
        assert padded["old_logprobs"][row, prompt:length].tolist() == sample.logprobs.tolist()
        assert padded["old_logprobs"][row, :prompt].abs().sum() == 0
        assert torch.allclose(padded["advantages"][row], padded["loss_mask"][row] * sample.advantage)
        start, end = packed["cu_seqlens"][row].item(), packed["cu_seqlens"][row + 1].item()
        assert packed["input_ids"][0, start:end].tolist() == sample.input_ids.tolist()
        assert packed["position_ids"][0, start:end].tolist() == list(range(length))
        assert packed["loss_mask"][0, start:end].tolist() == sample.loss_mask.tolist()
        assert packed["old_logprobs"][0, start + prompt : end].tolist() == sample.logprobs.tolist()
    assert padded["input_ids"].dtype == torch.int64 and packed["cu_seqlens"].dtype == torch.int32


def test_incomplete_groups_wait_until_finished_or_timed_out(store):
    gateway, client, _ = store
    done = run_rollout(gateway, "g", reward=1.0, turns=1)
    running = run_rollout(gateway, "g", reward=None, turns=1, finish=False)

    assert len(client.claim("t", 0)) == 0
    timed_out = client.claim("t", 1, SampleOptions(group_timeout=0.0))

    assert [s.rollout_id for s in timed_out.samples] == [done]
    assert timed_out.counts["skipped_late"] == 1
    httpx.post(f"{gateway.url}/rollouts/{running}/finish", json={"reward": 0.0}, timeout=TIMEOUT)
    assert len(client.claim("t", 2)) == 0


def test_group_whose_rollouts_all_failed_is_dropped_and_counted(store):
    gateway, client, _ = store
    for _ in range(2):
        run_rollout(gateway, "bad", reward=None, turns=1, status="failed")
    good = run_rollout(gateway, "good", reward=1.0, turns=1)

    batch = client.claim("t", 0)

    assert [s.rollout_id for s in batch.samples] == [good]
    assert batch.counts["dropped_groups"] == 1
    assert batch.counts["skipped_failed"] == 2
    assert len(client.claim("t", 1)) == 0


def test_rollouts_with_error_turns_are_excluded_or_kept_masked(store):
    gateway, client, _ = store
    clean = run_rollout(gateway, "g", reward=1.0, turns=1)
    broken = run_rollout(gateway, "g", reward=0.0, turns=1, failing_turn=True)

    default = client.read()
    kept = client.read(SampleOptions(include_errors=True))

    assert [s.rollout_id for s in default.samples] == [clean]
    assert default.counts["skipped_error_turns"] == 1
    assert [s.rollout_id for s in kept.samples] == [clean, broken]
    masked = kept.samples[1]
    assert masked.masked and masked.loss_mask.sum() == 0
    assert kept.counts["masked_rollouts"] == 1
    assert kept.padded()["loss_mask"][1].sum() == 0


def test_stale_rollouts_are_skipped_and_counted(start_gateway, databases, db_kind):
    db_url = databases.new(db_kind)
    gateway = start_gateway(db_url, "--policy-version", "1")
    stale = run_rollout(gateway, "g", reward=1.0, turns=1)
    admin(gateway, "/policy_version", json={"version": "4"}).raise_for_status()
    fresh = run_rollout(gateway, "g", reward=0.0, turns=1)

    with TrainerClient(db_url) as client:
        batch = client.claim("t", 0, SampleOptions(current_version=5, max_staleness=2))

    assert [s.rollout_id for s in batch.samples] == [fresh]
    assert batch.samples[0].policy_version == "4"
    assert batch.counts["skipped_stale"] == 1
    assert stored_rollout(gateway, stale)["skip_reason"] == "stale"


def test_release_makes_claimed_rollouts_claimable_again(store):
    gateway, client, _ = store
    rollout = run_rollout(gateway, "g", reward=1.0, turns=1)

    first = client.claim("a", 7)
    assert len(client.claim("b", 0)) == 0
    assert client.release("a", step=7) == 1
    again = client.claim("b", 1)

    assert [s.rollout_id for s in first.samples] == [s.rollout_id for s in again.samples] == [rollout]


CLAIMER = """
import json, sys
from trainer_client import SampleOptions, TrainerClient
client = TrainerClient(sys.argv[1])
taken, step = [], 0
while True:
    batch = client.claim(sys.argv[2], step, SampleOptions(max_groups=1))
    if not batch.samples:
        break
    taken += batch.rollout_ids
    step += 1
print(json.dumps(taken))
"""


def test_two_trainer_processes_claim_every_rollout_exactly_once(store):
    gateway, _client, db_url = store
    rollouts = {run_rollout(gateway, f"g{i}", reward=float(i % 2), turns=1) for i in range(16)}

    trainers = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER, db_url, f"trainer-{n}"], stdout=subprocess.PIPE, text=True
        )
        for n in range(2)
    ]
    taken = [json.loads(trainer.communicate(timeout=120)[0]) for trainer in trainers]

    assert sorted(taken[0] + taken[1]) == sorted(rollouts)
    assert not set(taken[0]) & set(taken[1])


def test_export_jsonl_writes_documented_fields_and_claims_nothing(store, tmp_path):
    gateway, client, db_url = store
    rollout = run_rollout(gateway, "g", reward=1.0, turns=2)
    output = tmp_path / "samples.jsonl"

    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer_client.cli",
            "export",
            "--db",
            db_url,
            "--format",
            "jsonl",
            "-o",
            str(output),
        ],
        check=True,
    )

    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [(line["rollout_id"], line["step"], line["is_last_step"]) for line in lines] == [
        (rollout, 0, False),
        (rollout, 1, True),
    ]
    for field in (
        "group_id",
        "prompt_ids",
        "completion_ids",
        "loss_mask",
        "logprobs",
        "reward",
        "advantage",
        "policy_version",
    ):
        assert field in lines[0]
    assert lines[1]["loss_mask"] == [0] * len(lines[1]["prompt_ids"]) + [1] * 4
    assert stored_rollout(gateway, rollout)["claimed_by"] is None
    assert len(client.claim("t", 0)) == 2


def test_export_to_standard_output_streams_the_same_lines(store, tmp_path):
    gateway, _, db_url = store
    run_rollout(gateway, "g", reward=1.0, turns=2)
    export = [sys.executable, "-m", "trainer_client.cli", "export", "--db", db_url, "--format", "jsonl"]

    piped = subprocess.run([*export, "-o", "-"], check=True, capture_output=True)
    subprocess.run([*export, "-o", str(tmp_path / "samples.jsonl")], check=True, capture_output=True)

    assert piped.stdout == (tmp_path / "samples.jsonl").read_bytes()
    assert len(piped.stdout.splitlines()) == 2
    assert piped.stderr.decode().strip().endswith("wrote 2 samples to standard output")


def test_export_parquet_holds_the_same_samples(store, tmp_path):
    import pyarrow.parquet as pq

    gateway, client, db_url = store
    run_rollout(gateway, "g", reward=1.0, turns=2)
    output = tmp_path / "samples.parquet"

    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer_client.cli",
            "export",
            "--db",
            db_url,
            "--format",
            "parquet",
            "-o",
            str(output),
        ],
        check=True,
    )

    table = pq.read_table(output).to_pylist()
    assert [row["prompt_ids"] for row in table] == [s.prompt_ids.tolist() for s in client.read().samples]


def test_stats_counts_rollouts_turns_errors_and_claims(store):
    gateway, client, db_url = store
    run_rollout(gateway, "g", reward=1.0, turns=2)
    run_rollout(gateway, "g", reward=0.0, turns=1, failing_turn=True)
    client.claim("t", 0)

    report = json.loads(
        subprocess.run(
            [sys.executable, "-m", "trainer_client.cli", "stats", "--db", db_url, "--json"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )

    assert report["rollouts"] == [{"status": "completed", "rollouts": 2}]
    assert {row["status"]: row["turns"] for row in report["turns"]} == {"error": 1, "ok": 3}
    assert {row["state"]: row["rollouts"] for row in report["claims"]} == {
        "skipped: error_turns": 1,
        "trained": 1,
    }
    assert report["policy_versions"][0]["policy_version"] == "0"
    assert report["policy_versions"][0]["error_turns"] == 1


def test_tail_prints_groups_as_they_finish(store):
    gateway, _client, db_url = store
    run_rollout(gateway, "before", reward=1.0, turns=1)
    tail = subprocess.Popen(
        [sys.executable, "-m", "trainer_client.cli", "tail", "--db", db_url, "--interval", "0.2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        header, first = tail.stdout.readline(), tail.stdout.readline()
        run_rollout(gateway, "after", reward=0.5, turns=1)
        second = tail.stdout.readline()
    finally:
        tail.kill()
    assert "reward mean" in header
    assert first.split()[2:4] == ["before", "1"]
    assert second.split()[2:5] == ["after", "1", "0.5000"]


def exact_completions_rollout(gateway, vllm, turns: int) -> str:
    """A token-in agent that sends back exactly what the model produced, plus an environment token each
    turn."""
    from support import tokenize_chat

    created = httpx.post(gateway.url + "/rollouts", json={"group_id": "exact"}, timeout=TIMEOUT).json()
    prompt = tokenize_chat(vllm, [{"role": "user", "content": "Count."}])
    for _ in range(turns):
        reply = httpx.post(
            created["base_url"] + "/completions",
            json={
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 3,
                "min_tokens": 3,
                "return_token_ids": True,
            },
            timeout=TIMEOUT,
        ).json()["choices"][0]
        prompt = reply["prompt_token_ids"] + reply["token_ids"] + [198]
    httpx.post(
        f"{gateway.url}/rollouts/{created['rollout_id']}/finish", json={"reward": 1.0}, timeout=TIMEOUT
    )
    return created["rollout_id"]


def test_merged_sample_joins_an_exact_chain_and_keeps_every_completion_token(store, vllm):
    gateway, client, _db_url = store
    rollout = exact_completions_rollout(gateway, vllm, turns=3)

    steps = client.read().samples
    merged = client.read(SampleOptions(merged=True)).samples

    assert len(steps) == 3 and len(merged) == 1
    sample = merged[0]
    assert sample.turn_indices == [0, 1, 2]
    assert sample.input_ids.tolist() == steps[-1].input_ids.tolist()
    kept = sample.input_ids[sample.loss_mask == 1]
    assert kept.tolist() == [t for s in steps for t in s.completion_ids.tolist()]
    assert sample.token_logprobs[sample.loss_mask == 1].tolist() == [
        x for s in steps for x in s.logprobs.tolist()
    ]
    assert sample.token_logprobs[sample.loss_mask == 0].tolist() == [0.0] * int((sample.loss_mask == 0).sum())
    batch = client.read(SampleOptions(merged=True))
    assert batch.metrics()["tokens"] == len(sample.input_ids) < sum(len(s.input_ids) for s in steps)
    assert batch.padded()["loss_mask"][0].sum() == 9
    assert stored_rollout(gateway, rollout)["turns"][2]["drift_tokens"] == 0


def test_merging_refuses_turns_that_drift(store):
    gateway, client, _db_url = store
    rollout = run_rollout(gateway, "g", reward=1.0, turns=3)
    drifts = [t["drift_tokens"] for t in stored_rollout(gateway, rollout)["turns"]]

    merged = client.read(SampleOptions(merged=True)).samples

    expected_samples = 1 + sum(1 for d in drifts[1:] if d != 0)
    assert len(merged) == expected_samples
    assert sum(len(m.turn_indices) for m in merged) == 3


def test_export_merged_writes_one_line_per_chain(store, vllm, tmp_path):
    gateway, _client, db_url = store
    exact_completions_rollout(gateway, vllm, turns=2)
    output = tmp_path / "merged.jsonl"

    subprocess.run(
        [sys.executable, "-m", "trainer_client.cli", "export", "--db", db_url, "--merged", "-o", str(output)],
        check=True,
    )

    (line,) = [json.loads(text) for text in output.read_text().splitlines()]
    assert line["turn_indices"] == [0, 1]
    assert sum(line["loss_mask"]) == 6
    assert len(line["logprobs"]) == len(line["input_ids"]) == len(line["loss_mask"])


def export_hf(db_url: str, output: Any, *more: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trainer_client.cli", "export", "--db", db_url, "--format", "hf"]
    return subprocess.run([*command, "-o", str(output), *more], capture_output=True, text=True)


def test_export_hf_is_a_dataset_whose_rows_are_the_stored_turns_id_for_id(store, tmp_path):
    from datasets import load_from_disk

    gateway, client, db_url = store
    rollouts = [run_rollout(gateway, "g", reward=r, turns=3) for r in (1.0, 0.0)]

    exported = export_hf(db_url, tmp_path / "samples")
    rows = load_from_disk(str(tmp_path / "samples")).to_list()
    advantages = {s.rollout_id: s.advantage for s in client.read().samples}

    assert (exported.returncode, exported.stderr.splitlines()[-1]) == (
        0,
        f"wrote 6 samples to {tmp_path}/samples",
    )
    assert [(r["rollout_id"], r["turn_index"], r["turn_indices"]) for r in rows] == [
        (rollout, turn, [turn]) for rollout in rollouts for turn in range(3)
    ]
    for r in rows:
        turn = stored_rollout(gateway, r["rollout_id"])["turns"][r["turn_index"]]
        prompt, completion = turn["prompt_token_ids"], turn["completion_token_ids"]
        assert (r["prompt_ids"], r["completion_ids"], r["input_ids"]) == (
            prompt,
            completion,
            prompt + completion,
        )
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(completion)
        stored_logprobs = np.array(turn["completion_logprobs"], dtype=np.float32).tolist()
        assert r["logprobs"] == [0.0] * len(prompt) + stored_logprobs
        assert (r["group_id"], r["policy_version"], r["finish_reason"]) == ("g", "0", "length")
        assert (r["reward"], r["advantage"]) == (
            1.0 if r["rollout_id"] == rollouts[0] else 0.0,
            advantages[r["rollout_id"]],
        )
        assert (r["is_last_step"], r["masked"], r["reward_components"]) == (
            r["turn_index"] == 2,
            False,
            "null",
        )
    assert stored_rollout(gateway, rollouts[0])["claimed_by"] is None  # claims nothing
    assert len(client.claim("t", 0)) == 6


def test_samples_dataset_hands_over_the_exported_rows_without_a_file(store, tmp_path):
    from datasets import load_from_disk

    from trainer_client.hf import samples_dataset

    gateway, _client, db_url = store
    run_rollout(gateway, "g", reward=1.0, turns=2)
    export_hf(db_url, tmp_path / "samples")

    dataset = samples_dataset(db_url)

    assert dataset.to_list() == load_from_disk(str(tmp_path / "samples")).to_list()
    assert dataset.features == load_from_disk(str(tmp_path / "samples")).features
    assert len(dataset) == 2


def test_export_hf_merged_splits_a_chain_at_its_first_sampled_token(store, vllm, tmp_path):
    from datasets import load_from_disk

    gateway, client, db_url = store
    exact_completions_rollout(gateway, vllm, turns=2)

    export_hf(db_url, tmp_path / "merged", "--merged")

    (r,) = load_from_disk(str(tmp_path / "merged")).to_list()
    (sample,) = client.read(SampleOptions(merged=True)).samples
    first = int(np.flatnonzero(sample.loss_mask)[0])
    assert (r["turn_index"], r["turn_indices"], r["input_ids"]) == (0, [0, 1], sample.input_ids.tolist())
    assert (r["prompt_ids"], r["completion_ids"]) == (
        sample.input_ids[:first].tolist(),
        sample.input_ids[first:].tolist(),
    )
    assert (r["loss_mask"], r["logprobs"]) == (sample.loss_mask.tolist(), sample.token_logprobs.tolist())
    assert sum(r["loss_mask"]) == 6


def test_export_hf_to_standard_output_is_a_one_line_error(store):
    _gateway, _client, db_url = store

    refused = export_hf(db_url, "-")

    assert (refused.returncode, refused.stderr.splitlines()) == (
        2,
        ["trainer-client export: error: --format hf writes a directory: give it with -o DIR"],
    )


KILLED_TRAINER = """
import sys
import time
from trainer_client import TrainerClient

client = TrainerClient(sys.argv[1])
batch = client.claim("doomed", 0, lease=float(sys.argv[2]))
print(len(batch.rollout_ids), flush=True)
sys.stdin.read()  # in the middle of its step until it is killed
"""


def test_a_killed_trainers_claims_return_after_its_lease(store):
    gateway, client, db_url = store
    rollouts = [run_rollout(gateway, "g", reward=r, turns=1) for r in (1.0, 0.0)]
    doomed = subprocess.Popen(
        [sys.executable, "-c", KILLED_TRAINER, db_url, "6.0"],  # (the survivor claims within it)
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert doomed.stdout.readline() == "2\n"
    doomed.kill()
    doomed.wait(timeout=30)
    lease_until = stored_rollout(gateway, rollouts[0])["lease_until"]

    assert len(client.claim("survivor", 0)) == 0  # the lease still holds
    wait_for(lambda: time.time() > lease_until, "the lease's end")
    batch = client.claim("survivor", 0)

    assert sorted(batch.rollout_ids) == sorted(rollouts)
    assert [stored_rollout(gateway, r)["claimed_by"] for r in rollouts] == ["survivor", "survivor"]


def test_a_committed_claim_is_kept_after_its_lease(store):
    gateway, client, _db_url = store
    rollouts = [run_rollout(gateway, "g", reward=r, turns=1) for r in (1.0, 0.0)]

    assert len(client.claim("t1", 0, lease=3.0)) == 2
    claimed_until = time.time() + 3.0
    assert client.commit("t1", 0) == 2
    wait_for(lambda: time.time() > claimed_until, "the first lease's end")

    assert len(client.claim("t2", 0)) == 0
    assert [stored_rollout(gateway, r)["lease_until"] for r in rollouts] == [None, None]


def test_a_renewed_lease_keeps_the_claim_past_its_first_term(store):
    gateway, client, _db_url = store
    run_rollout(gateway, "g", reward=1.0, turns=1)

    assert len(client.claim("t1", 0, lease=3.0)) == 1
    claimed_until = time.time() + 3.0
    assert client.renew("t1", 0, lease=60.0) == 1
    wait_for(lambda: time.time() > claimed_until, "the first term's end")

    assert len(client.claim("t2", 0)) == 0


def test_eval_rollouts_are_never_served_for_training_and_are_reported_per_version(store, tmp_path):
    gateway, client, db_url = store
    run_rollout(gateway, "train", reward=0.5, turns=1)
    for task, rewards in (("a", (1.0, 0.0, 0.0, None)), ("b", (1.0, 1.0, 0.5))):
        for reward in rewards:
            status = "completed" if reward is not None else "failed"
            run_rollout(
                gateway, f"eval-{task}", reward=reward, status=status, turns=1, tags=["eval"], task_id=task
            )
    output = tmp_path / "eval.json"

    trained = client.claim("t", 0)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer_client.cli",
            "eval",
            "--db",
            db_url,
            "-k",
            "1",
            "-k",
            "2",
            "-o",
            str(output),
        ],
        check=True,
        capture_output=True,
    )

    assert {s.group_id for s in trained.samples} == {"train"}
    assert json.loads(output.read_text()) == {
        "pass_threshold": 1.0,
        "k": [1, 2],
        "policy_versions": [
            {
                "policy_version": "0",
                "rollouts": 7,
                "failed": 1,
                "tasks": 2,
                "reward_mean": pytest.approx(3.5 / 6),
                "pass@1": pytest.approx((1 / 4 + 2 / 3) / 2),
                "pass@2": pytest.approx((1 - 3 / 6 + 1.0) / 2),
            }
        ],
    }
