"""Async GRPO end to end on the trainable vLLM (a copy of the tiny model that training overwrites): the model
learns through the gateway, and weight updates, backend restarts and pauses lose nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import sqlalchemy as sa

from rollout_store.database import make_engine
from trainer_client import SampleOptions, TrainerClient
from trainer_client.reference.runner import RolloutRunner, RunnerConfig
from trainer_client.reference.toy_task import TargetCharactersTask

import support
from support import TIMEOUT, async_agent, run_rollout, until

STEPS = 10
MAX_STALENESS = 1
TOKENS = 100
"""Per call of the 200 in the pause test."""
FROZEN, FROZEN_TOKENS = "frozen", 1500
"""The pause test's call that vLLM's freeze finds mid-reply in any case: it has its first tokens before the
200 calls are sent, and 1,400 and more to go when the freeze lands, a few engine steps after the 200 start."""


def query(db_url: str, sql: str) -> list[Any]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql)).all()
    finally:
        engine.dispose()


admin = functools.partial(support.admin, timeout=600)  # pauses here drain hundreds of calls (up to 600 s)


async def failed_calls(http: httpx.AsyncClient) -> int:
    """Agent calls that failed, as the gateway counts them (its /metrics)."""
    lines = (await http.get("/metrics")).text.splitlines()
    return sum(
        int(float(line.rpartition(" ")[2])) for line in lines if line.startswith("gateway_errors_total{")
    )


async def answered_and_in_flight(http: httpx.AsyncClient) -> tuple[int, int]:
    """Chat calls the gateway has answered 200 (its /metrics), and calls it has sent to its server and not yet
    had answered (its /admin/state: vLLM's own /metrics can answer only once its running requests have ended,
    too late to see them)."""
    sample = 'gateway_requests_total{endpoint="chat",status="200"} '
    lines = (await http.get("/metrics")).text.splitlines()
    answered = sum(int(float(line.removeprefix(sample))) for line in lines if line.startswith(sample))
    backends = (await http.get("/admin/state")).json()["backends"]
    return answered, sum(backend["in_flight"] for backend in backends)


def test_async_grpo_through_the_gateway_raises_mean_reward(policy_vllm, start_gateway, databases, work_dir):
    from testbed.demo.train import demo_config
    from trainer_client.reference.loop import run_loop, save_report

    db_url = databases.new("sqlite")
    gateway = start_gateway(db_url, backends=[policy_vllm.url], process=True)
    config = demo_config(
        policy_vllm.model_dir, db_url, gateway.url, steps=STEPS, groups_per_step=4, group_size=8
    )
    config = dataclasses.replace(
        config, trainer=dataclasses.replace(config.trainer, max_staleness=MAX_STALENESS)
    )

    result = run_loop(config)
    report, plot = save_report(result, work_dir / "training-report")

    rewards = result.reward_by_version("training")
    # Measured: about 0.12 at version 0; 0.97 to 1.0 at version 10 (which rollouts land in which step varies).
    assert rewards[str(STEPS)] > rewards["0"] + 0.1
    assert [step.version for step in result.steps] == list(range(1, STEPS + 1))
    # No turn lost across the weight updates: every answered model call is a committed turn.
    turns = query(db_url, "SELECT status, COUNT(*) FROM turns GROUP BY status")
    assert turns == [("ok", result.runner.calls + result.eval_runner.calls)]
    assert query(db_url, "SELECT COUNT(*) FROM rollouts WHERE status = 'running'") == [(0,)]
    # Every trained sample was sampled at most MAX_STALENESS versions before the step that used it.
    lags = query(
        db_url,
        "SELECT r.claim_step - CAST(t.policy_version AS INTEGER) "
        "FROM turns t JOIN rollouts r USING (rollout_id) "
        "WHERE r.claimed_by IS NOT NULL AND r.skip_reason IS NULL",
    )
    assert lags and max(lag for (lag,) in lags) <= MAX_STALENESS
    # Evaluation rollouts: never claimed, measured at the first version and every 5 steps.
    assert query(db_url, "SELECT COUNT(*) FROM rollouts WHERE eval AND claimed_by IS NOT NULL") == [(0,)]
    assert [v["policy_version"] for v in result.evaluation["policy_versions"]] == ["0", "5", "10"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report.stat().st_size > 0


def run_ranks(script: str, *args: str, timeout: float = 300) -> list[dict[str, Any]]:
    """`script` as ranks 0 and 1 of a torch.distributed group (gloo, on CPU), each its own process, meeting
    through a file in a fresh directory (no port to pick); returns the JSON each printed last."""
    rendezvous = Path(args[0]) / "rendezvous"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, f"file://{rendezvous}", str(rank), *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [rank.communicate(timeout=timeout)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    return [json.loads(output.splitlines()[-1]) for output in outputs]


def group_advantages(rewards: dict[str, float], groups: dict[str, str]) -> dict[str, float]:
    """(reward - group mean) / (group std + 1e-6) over each group's rollouts: what one process computes."""
    advantages = {}
    for group in set(groups.values()):
        members = [rollout for rollout in rewards if groups[rollout] == group]
        values = np.array([rewards[rollout] for rollout in members])
        for rollout, value in zip(members, (values - values.mean()) / (values.std() + 1e-6), strict=True):
            advantages[rollout] = float(value)
    return advantages


RANK_CLAIMS = """
import json, sys
import torch.distributed as dist
from trainer_client import DistributedClaims, StepFailed, TrainerClient

init_method, rank, db_url = sys.argv[1], int(sys.argv[2]), sys.argv[4]
dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
claims = DistributedClaims(TrainerClient(db_url) if rank == 0 else None, "dp", lease=60.0)
try:
    with claims.step(0) as failed:
        if rank == 1:
            raise ValueError("rank 1 failed mid-step")
except (ValueError, StepFailed) as exc:
    step_0 = [type(exc).__name__, len(failed.batch)]
with claims.step(1) as shard:
    step_1 = [[s.rollout_id, s.turn_index, s.advantage] for s in shard.batch.samples]
print(json.dumps({"step_0": step_0, "step_1": step_1, "kept": shard.kept, "tokens": shard.shard_tokens}))
dist.destroy_process_group()
"""


def test_a_step_that_fails_on_one_rank_is_released_and_the_next_step_takes_it_whole(
    policy_vllm, start_gateway, databases, tmp_path
):
    db_url = databases.new("postgresql")
    gateway = start_gateway(db_url, backends=[policy_vllm.url], process=True)
    rewards = {run_rollout(gateway, "g1", reward=r, turns=2): r for r in (1.0, 0.0, 0.5)}
    rewards |= {run_rollout(gateway, "g2", reward=r, turns=1): r for r in (0.25, 0.75)}
    groups = {rollout: "g1" if index < 3 else "g2" for index, rollout in enumerate(rewards)}

    ranks = run_ranks(RANK_CLAIMS, str(tmp_path), db_url)

    # Step 0: rank 1 raised, so rank 0 released the claim and raised too (each had its share of 8 samples).
    assert [rank["step_0"][0] for rank in ranks] == ["StepFailed", "ValueError"]
    assert sum(rank["step_0"][1] for rank in ranks) == 8
    # Step 1 took the same groups whole: every sample on exactly one rank, advantages as on one process.
    seen = [(rollout, turn) for rank in ranks for rollout, turn, _ in rank["step_1"]]
    assert sorted(seen) == sorted([(r, t) for r in rewards for t in range(2 if groups[r] == "g1" else 1)])
    assert len(seen) == len(set(seen)) == 8 and all(rank["step_1"] for rank in ranks)
    expected = group_advantages(rewards, groups)
    for rank in ranks:
        for rollout, _, advantage in rank["step_1"]:
            assert advantage == pytest.approx(expected[rollout], rel=1e-12)
    assert [rank["kept"] for rank in ranks] == [5, 5]
    # Balanced by tokens: the two shards differ by at most the longest sample.
    ((longest,),) = query(db_url, "SELECT MAX(prompt_tokens + completion_tokens) FROM turns")
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    assert abs(ranks[0]["tokens"][0] - ranks[0]["tokens"][1]) <= longest
    claims = query(db_url, "SELECT claimed_by, claim_step, lease_until FROM rollouts")
    assert claims == [("dp", 1, None)] * 5


RANK_LOOP = """
import dataclasses, json, sys
from pathlib import Path
import torch.distributed as dist
from testbed.demo.train import demo_config
from trainer_client.reference.loop import run_rank
from trainer_client.reference.trainer import GRPOTrainer
from trainer_client.weights import save_weights

init_method, rank, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
policy, db_url, gateway_url = sys.argv[4:]
dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
shards = []


class RecordingTrainer(GRPOTrainer):
    def train_shard(self, shard):
        samples = [[s.rollout_id, s.turn_index, s.advantage] for s in shard.batch.samples]
        shards.append({"step": shard.step, "samples": samples, "tokens": shard.shard_tokens})
        metrics = super().train_shard(shard)
        save_weights(self.model, out / f"rank{rank}")  # this rank's weights after the step
        return metrics


(out / f"rank{rank}").mkdir()
config = demo_config(Path(policy), db_url, gateway_url, steps=2, groups_per_step=2, group_size=4)
config = dataclasses.replace(config, eval_groups=1)
reports = []
result = run_rank(config, on_step=reports.append, make_trainer=RecordingTrainer)
steps = [dataclasses.asdict(report) for report in reports]
print(json.dumps({"shards": shards, "steps": steps, "result": result is not None}))
dist.destroy_process_group()
"""


def test_two_ranks_train_every_claimed_rollout_once_on_disjoint_shards_with_one_process_advantages(
    policy_vllm, start_gateway, databases, tmp_path
):
    from safetensors.torch import load_file

    db_url = databases.new("sqlite")
    gateway = start_gateway(db_url, backends=[policy_vllm.url], process=True)

    ranks = run_ranks(RANK_LOOP, str(tmp_path), str(policy_vllm.model_dir), db_url, gateway.url)

    assert [rank["result"] for rank in ranks] == [True, False]  # the loop's result is rank 0's
    claimed = query(
        db_url,
        "SELECT r.rollout_id, r.group_id, r.claim_step, r.reward, r.lease_until, COUNT(t.turn_id) "
        "FROM rollouts r JOIN turns t USING (rollout_id) WHERE r.claimed_by = 'trainer-0' "
        "AND r.skip_reason IS NULL GROUP BY r.rollout_id, r.group_id, r.claim_step, r.reward, r.lease_until",
    )
    # Two steps of 2 groups x 4 one-turn rollouts, each committed (no lease left), none stale or skipped.
    assert sorted(step for _, _, step, *_ in claimed) == [0] * 8 + [1] * 8
    assert {(lease, turns) for *_, lease, turns in claimed} == {(None, 1)}
    assert query(db_url, "SELECT COUNT(*) FROM rollouts WHERE skip_reason IS NOT NULL") == [(0,)]
    expected = group_advantages(
        {r: reward for r, _, _, reward, *_ in claimed}, {r: g for r, g, *_ in claimed}
    )
    ((longest,),) = query(db_url, "SELECT MAX(prompt_tokens + completion_tokens) FROM turns")
    for step in (0, 1):
        shards = [shard for rank in ranks for shard in rank["shards"] if shard["step"] == step]
        seen = [(rollout, turn) for shard in shards for rollout, turn, _ in shard["samples"]]
        # Every sample of the step's claim on exactly one rank; both ranks had some.
        assert sorted(seen) == sorted((r, 0) for r, _, claim_step, *_ in claimed if claim_step == step)
        assert len(seen) == len(set(seen)) == 8 and all(shard["samples"] for shard in shards)
        for shard in shards:
            for rollout, _, advantage in shard["samples"]:
                assert advantage == pytest.approx(expected[rollout], rel=1e-12)
        assert shards[0]["tokens"] == shards[1]["tokens"]  # balanced: apart by at most the longest sample
        assert abs(shards[0]["tokens"][0] - shards[0]["tokens"][1]) <= longest
    # Both ranks took the same two steps: the whole step's metrics, the same weights as rank 0 served.
    assert [[step["version"] for step in rank["steps"]] for rank in ranks] == [[1, 2], [1, 2]]
    for field in (
        "loss",
        "approx_kl",
        "clip_fraction",
        "loss_tokens",
        "rollouts",
        "reward_mean",
        "shard_tokens",
    ):
        assert [step[field] for step in ranks[0]["steps"]] == [step[field] for step in ranks[1]["steps"]]
    served = load_file(policy_vllm.model_dir / "model.safetensors")
    for rank in (0, 1):
        weights = load_file(tmp_path / f"rank{rank}" / "model.safetensors")
        assert weights.keys() == served.keys()
        assert all(weights[name].equal(served[name]) for name in served)
    assert admin(gateway, "/state").json()["policy_version"] == "2"


def test_backend_crashed_and_restarted_mid_rollout_leaves_error_turns_and_masked_rollouts(
    policy_vllm, start_gateway, databases
):
    db_url = databases.new("postgresql")
    gateway = start_gateway(db_url, backends=[policy_vllm.url], process=True)
    turns = 7
    task = TargetCharactersTask(turns=turns)
    # Seven turns of 180 tokens, as many as the context holds: from the first answer, calls are in flight for
    # seconds, so the crash still lands in one where this test's polls are slow (seen: 3 s under load).
    runner_config = RunnerConfig(
        group_size=4, groups_in_flight=1, max_tokens=180, min_tokens=180, retry_for=600
    )

    async def play_through_a_restart() -> list[float]:
        runner = RolloutRunner(gateway.url, task, runner_config, name="restart")
        group = asyncio.create_task(runner.play_group(0))
        # Once the first turns have been answered, the crash lands while the next ones are being generated
        # (the gateway's counts answer in milliseconds, a store query may not).
        async with httpx.AsyncClient(base_url=gateway.url, timeout=TIMEOUT) as http:

            async def next_turns_in_flight() -> bool:
                assert not group.done(), "the group ended before the crash"
                return all(await answered_and_in_flight(http))

            await until(next_turns_in_flight, "a turn answered and the next ones in flight")
            policy_vllm.kill()  # a crash, with the next turns in flight
            await until(lambda: failed_calls(http), "a call failed on the crashed server")
        await asyncio.to_thread(policy_vllm.start)
        rewards = await group
        await runner.close()
        return rewards

    rewards = asyncio.run(play_through_a_restart())

    assert len(rewards) == 4
    assert httpx.get(gateway.url + "/healthz", timeout=TIMEOUT).status_code == 200
    statuses = dict(query(db_url, "SELECT status, COUNT(*) FROM turns GROUP BY status"))
    assert statuses["error"] >= 1 and statuses["ok"] == 4 * turns
    broken = {r for (r,) in query(db_url, "SELECT DISTINCT rollout_id FROM turns WHERE status = 'error'")}
    with TrainerClient(db_url) as client:
        assert len(client.read().samples) == turns * (4 - len(broken))  # by default they are skipped
        batch = client.claim("trainer", 0, SampleOptions(include_errors=True))
    assert batch.counts["masked_rollouts"] == len(broken)
    for sample in batch.samples:
        assert sample.masked == (sample.rollout_id in broken)
        assert int(sample.loss_mask.sum()) == (0 if sample.masked else len(sample.completion_ids))


@pytest.mark.parametrize("mode", ["wait", "keep", "abort"])
def test_pause_with_200_turns_in_flight_loses_none(mode, policy_vllm, start_gateway, databases):
    db_url = databases.new("sqlite")
    gateway = start_gateway(db_url, backends=[policy_vllm.url], process=True)
    calls = 200
    generating: set[str] = set()
    """The calls whose first chunk has come: vLLM sends it with the first sampled token."""

    async def call(rollout: str, tokens: int) -> str | None:
        agent = async_agent(gateway.agent_url(rollout))
        async with agent:
            stream = await agent.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"Count to {rollout}."}],
                stream=True,
                max_tokens=tokens,
                extra_body={"min_tokens": tokens},
            )
            finish = None
            async for chunk in stream:
                generating.add(rollout)
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return finish

    async def in_flight(count: int) -> bool:
        return bool((await asyncio.to_thread(admin, gateway, "/state")).json()["in_flight"] >= count)

    def vllm(path: str, **params: str) -> None:
        httpx.post(f"{policy_vllm.url}{path}", params=params, timeout=TIMEOUT).raise_for_status()

    async def pause_mid_flight() -> tuple[list[str | None], str | None]:
        frozen = None
        if mode != "wait":
            # The call the keep or abort pause always finds mid-reply: vLLM froze it with tokens sampled and
            # many more to go, before the 200 calls were sent.
            frozen = asyncio.ensure_future(call(FROZEN, FROZEN_TOKENS))
            await until(lambda: FROZEN in generating, "the frozen call's first token")
        # vLLM holds the calls (a pause in keep mode queues what reaches it) and lets them go together:
        # released one by one, the first could finish before the last arrived.
        vllm("/pause", mode="keep")
        replies = asyncio.gather(*(call(f"r{i}", TOKENS) for i in range(calls)))
        await until(lambda: in_flight(calls + (frozen is not None)), "every call in flight")
        vllm("/resume")
        if mode == "wait":
            await until(lambda: len(generating) >= calls // 2, "vLLM generating for the calls together")
        else:
            # Then vLLM freezes them mid-generation, so that the gateway's keep or abort pause finds them
            # there however slow the machine (the gateway's resume resumes vLLM).
            await until(lambda: len(generating) > 1, "vLLM generating for the calls")
            vllm("/pause", mode="keep")
        paused = await asyncio.to_thread(admin, gateway, "/pause", json={"mode": mode})
        assert paused.status_code == 200, paused.text
        await asyncio.to_thread(admin, gateway, "/policy_version", json={"version": "1"})
        await asyncio.to_thread(admin, gateway, "/resume")
        return await replies, await frozen if frozen else None

    finishes, frozen_finish = asyncio.run(pause_mid_flight())

    turns = {
        rollout: rest
        for rollout, *rest in query(
            db_url,
            "SELECT rollout_id, status, finish_reason, policy_version, policy_version_end, completion_tokens "
            "FROM turns",
        )
    }
    frozen = turns.pop(FROZEN, None)
    assert len(turns) == calls and {status for status, *_ in turns.values()} == {"ok"}
    assert sorted((finish for _, finish, *_ in turns.values()), key=str) == sorted(
        finishes, key=str
    )  # as the agents saw
    # Dispatched at version 0. "wait" ended them all before the update. "keep" froze those vLLM was generating
    # when its pause landed (between engine steps): they finished at version 1. "abort" ended those (an abort
    # before the first token ends the stream without a finish reason, as vLLM sends it); calls still on their
    # way into vLLM's scheduler were queued there and ran after the update.
    versions = {(start, end) for _, _, start, end, _ in turns.values()}
    if mode == "wait":
        assert versions == {("0", "0")} and frozen is None
    else:
        assert versions <= {("0", "0"), ("0", "1")}
        assert frozen is not None and frozen[0] == "ok" and frozen[1] == frozen_finish
    if mode == "keep":
        assert frozen == ["ok", "length", "0", "1", FROZEN_TOKENS]
    if mode == "abort":
        assert frozen is not None and frozen[1:4] == ["abort", "0", "0"] and frozen[4] < FROZEN_TOKENS
        assert set(finishes) <= {"abort", "length", None}
    else:
        assert finishes == ["length"] * calls
        assert {tokens for *_, tokens in turns.values()} == {TOKENS}
    assert admin(gateway, "/state").json()["paused"] is False
