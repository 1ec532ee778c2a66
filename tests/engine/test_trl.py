"""TRL trains through the gateway on CPU: `openai` SDK agents play the toy task through the gateway, TRL's
GRPO trainers (the synchronous `GRPOTrainer` and the experimental `AsyncGRPOTrainer`, as examples/trl_grpo.py
and examples/trl_async_grpo.py build them) train on the ids the store recorded, and vLLM takes every step's
weights through the admin API. The tiny model's reward rises, and the ids TRL trained on are the ids vLLM saw
and sampled."""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import statistics
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_store.database import make_engine
from trainer_client.reference.runner import RolloutRunner, RunnerConfig
from trainer_client.reference.toy_task import TargetCharactersTask
from training_data.evaluation import evaluation_report

from support import TIMEOUT, async_agent
from support.examples import example

STEPS = 10
GROUPS, GROUP_SIZE = 4, 8
TASK = TargetCharactersTask()


@pytest.fixture
def policy(policy_vllm, start_gateway, databases) -> tuple[Any, str, Path]:
    """A gateway on its own store before the trainable vLLM, at the tiny model's first weights: the gateway,
    its store's URL and the served model directory."""
    db_url = databases.new("sqlite")
    gateway = start_gateway(db_url, backends=[policy_vllm.url], process=True)
    return gateway, db_url, policy_vllm.model_dir


def stored_tokens(gateway_url: str, rollout_id: str) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """Each turn's prompt and completion ids and policy version, as GET /rollouts/{id} shows them."""
    return [
        (tuple(t["prompt_token_ids"]), tuple(t["completion_token_ids"]), t["policy_version"])
        for t in stored_turns(gateway_url, rollout_id)
    ]


def stored_turns(gateway_url: str, rollout_id: str) -> list[dict[str, Any]]:
    answer = httpx.get(
        f"{gateway_url}/rollouts/{rollout_id}", params={"include_tokens": "true"}, timeout=TIMEOUT
    )
    assert answer.status_code == 200, answer.text
    return list(answer.json()["turns"])


def trl_args(gateway_url: str, db_url: str, policy_dir: Path, output_dir: Path) -> list[str]:
    """What both TRL examples are given here: the gateway, its store and the served directory, on the CPU."""
    return [
        *("--gateway", gateway_url, "--db", db_url, "--model-dir", str(policy_dir)),
        *("--steps", str(STEPS), "--learning-rate", "1e-2", "--output-dir", str(output_dir), "--cpu"),
    ]


def test_trl_grpo_trainer_trains_on_the_ids_vllm_sampled_and_its_reward_rises(policy, work_dir):
    from trl import GRPOTrainer

    from trainer_client.trl import Rollout

    trl_grpo = example("trl_grpo")
    gateway, db_url, policy_dir = policy
    args = trl_grpo.build_parser().parse_args(
        [
            *trl_args(gateway.url, db_url, policy_dir, work_dir / "trl-out"),
            *("--model", "tiny", "--max-tokens", "16"),
            *("--prompts-per-step", str(GROUPS), "--group-size", str(GROUP_SIZE)),
        ]
    )
    played: list[Rollout] = []
    play = trl_grpo.make_agent(args.model, args.max_tokens, sampling_seed=0)  # a run that repeats

    async def agent(prompt: str, rollout: Rollout) -> float:
        played.append(rollout)
        return await play(prompt, rollout)

    trained: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()

    class Recording(GRPOTrainer):  # type: ignore[misc]
        """Keeps the unpadded ids of every sequence the loss is computed on."""

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            for ids, mask, out, out_mask in zip(
                inputs["prompt_ids"],
                inputs["prompt_mask"],
                inputs["completion_ids"],
                inputs["completion_mask"],
                strict=True,
            ):
                trained.add((tuple(ids[mask.bool()].tolist()), tuple(out[out_mask.bool()].tolist())))
            return super()._compute_loss(model, inputs)

    trainer, rollouts, sync = trl_grpo.build_trainer(args, agent, Recording)
    trainer.train()
    rollouts.close()

    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    print("TRL reward per step:", [round(r, 3) for r in rewards])
    print("waited on the gateway per step (s):", [round(w, 2) for w in rollouts.waits])
    print("weight sync per step (s):", [round(s, 2) for s in sync.syncs])
    assert len(rewards) == STEPS
    assert statistics.mean(rewards[-3:]) > statistics.mean(rewards[:3]) + 0.1
    # Every rollout was one turn, sampled at the version of the step that generated it, and TRL trained on
    # exactly the ids the store holds for it.
    assert len(played) == STEPS * GROUPS * GROUP_SIZE
    stored = {rollout.rollout_id: stored_tokens(gateway.url, rollout.rollout_id) for rollout in played}
    versions = {r.rollout_id: str(int(r.group_id.split("-")[-2])) for r in played}
    assert all(
        [version for _, _, version in turns] == [versions[rollout_id]] for rollout_id, turns in stored.items()
    )
    assert trained == {(prompt, completion) for turns in stored.values() for prompt, completion, _ in turns}


def test_a_two_turn_rollout_of_cut_replies_reaches_trl_as_one_sequence_with_the_environments_tokens_masked(
    start_gateway, databases
):
    from trainer_client.trl import GatewayRollouts, Rollout

    db_url = databases.new("sqlite")
    gateway = start_gateway(db_url, process=True)  # pass-through by default: the seam asks for exact mode

    async def agent(prompt: str, rollout: Rollout) -> float:
        messages: list[Any] = [{"role": "user", "content": prompt}]
        async with async_agent(rollout.base_url, rollout.api_key) as client:
            for turn, follow_up in enumerate(("More.", None)):
                reply = await client.chat.completions.create(  # cut at 4 tokens, never ended sooner
                    model="tiny",
                    messages=messages,
                    max_tokens=4,
                    seed=turn,  # the same replies every run (unseeded, one run made two chains of them)
                    extra_body={"min_tokens": 4},
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
        return 0.25

    rollouts = GatewayRollouts(gateway.url, db_url, agent)
    out = rollouts(["Say something."], TrainerOf(num_generations=1))
    rollouts.close()

    (rollout_id,) = out["rollout_id"]
    first, second = stored_turns(gateway.url, rollout_id)
    sampled = len(first["completion_token_ids"]), len(second["completion_token_ids"])
    environment = second["prompt_token_ids"][len(first["prompt_token_ids"]) + sampled[0] :]
    assert out["prompt_ids"] == [first["prompt_token_ids"]]
    assert out["completion_ids"] == [
        first["completion_token_ids"] + environment + second["completion_token_ids"]
    ]
    assert (first["finish_reason"], second["splice"]) == ("length", "exact")
    assert out["env_mask"] == [[1] * sampled[0] + [0] * len(environment) + [1] * sampled[1]]
    logprobs = first["completion_logprobs"] + [0.0] * len(environment) + second["completion_logprobs"]
    assert out["logprobs"] == [pytest.approx(logprobs, abs=1e-6)]  # stored as float32
    assert (out["reward"], len(environment) > 0) == ([0.25], True)


def test_an_agent_that_fails_stops_the_generation_with_its_error_and_its_rollout_is_failed(
    start_gateway, databases
):
    from trainer_client.trl import GatewayRollouts, Rollout

    db_url = databases.new("sqlite")
    gateway = start_gateway(db_url, process=True)
    played: dict[str, str] = {}

    async def agent(prompt: str, rollout: Rollout) -> float:
        played[rollout.rollout_id] = prompt
        if prompt == "broken":
            raise ValueError("the sandbox did not start")
        async with async_agent(rollout.base_url, rollout.api_key) as client:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=2
            )
        return 1.0

    rollouts = GatewayRollouts(gateway.url, db_url, agent)
    with pytest.raises(RuntimeError) as failed:
        rollouts(["fine", "fine", "broken", "broken"], TrainerOf(num_generations=2))
    rollouts.close()

    assert str(failed.value) == "an agent failed: ValueError('the sandbox did not start')"
    finished = {
        rollout_id: (prompt, answer["group_id"][-2:], answer["status"], answer["reward"])
        for rollout_id, prompt in played.items()
        for answer in [httpx.get(f"{gateway.url}/rollouts/{rollout_id}", timeout=TIMEOUT).json()]
    }
    assert sorted(finished.values()) == [
        ("broken", "-1", "failed", None),
        ("broken", "-1", "failed", None),
        ("fine", "-0", "completed", 1.0),
        ("fine", "-0", "completed", 1.0),
    ]


def test_an_agent_that_makes_no_model_call_stops_the_generation_with_a_clear_error(start_gateway, databases):
    from trainer_client.trl import GatewayRollouts, Rollout

    db_url = databases.new("sqlite")
    gateway = start_gateway(db_url, process=True)
    played: list[str] = []

    async def agent(prompt: str, rollout: Rollout) -> float:
        played.append(rollout.rollout_id)
        return 0.0  # gave up before asking the model anything

    rollouts = GatewayRollouts(gateway.url, db_url, agent)
    with pytest.raises(RuntimeError) as failed:
        rollouts(["idle", "idle"], TrainerOf(num_generations=2))
    rollouts.close()

    assert str(failed.value) == (
        f"2 of 2 rollouts made no model call (the first: {played[0]}): "
        "the trainer needs a completion for every prompt"
    )


def test_a_rollout_with_a_sub_agents_conversation_stops_the_step_rather_than_train_part_of_it(
    start_gateway, databases
):
    from trainer_client.trl import GatewayRollouts, Rollout

    db_url = databases.new("sqlite")
    gateway = start_gateway(db_url, process=True)
    played: list[str] = []

    async def agent(prompt: str, rollout: Rollout) -> float:
        played.append(rollout.rollout_id)
        async with async_agent(rollout.base_url, rollout.api_key) as client:
            for conversation in (prompt, "You are a sub-agent. Find the file."):  # a fresh conversation
                await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": conversation}], max_tokens=2
                )
        return 1.0

    rollouts = GatewayRollouts(gateway.url, db_url, agent)
    with pytest.raises(RuntimeError) as failed:
        rollouts(["Fix the bug."], TrainerOf(num_generations=1))
    rollouts.close()

    assert str(failed.value) == (
        "1 of 1 rollouts are trees of chains that GRPOTrainer cannot take whole (one sequence per prompt "
        f"copy); the first, {played[0]}, has 2 chains of turns [[0], [1]]. Train such agents with "
        "GatewayRolloutWorker (AsyncGRPOTrainer) or trainer_client, which take every chain as a sample of "
        "its group"
    )


class TrainerOf:
    """What `GatewayRollouts` reads of TRL's trainer: the group size, and whether it is training."""

    def __init__(self, num_generations: int) -> None:
        self.num_generations = self.num_generations_eval = num_generations
        self.model = type("Model", (), {"training": True})()


def test_trl_async_grpo_trainer_takes_claimed_groups_with_their_advantages_and_its_reward_rises(
    policy, work_dir, monkeypatch
):
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from transformers import AttentionInterface
    from trl.experimental.async_grpo import async_grpo_trainer

    trl_async_grpo = example("trl_async_grpo")
    gateway, db_url, policy_dir = policy
    # AsyncGRPOTrainer assumes CUDA: on CPU its throughput metric has no peak to compare with.
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *_: float("nan"))
    # On-policy (each step trains on groups sampled at its version), so that ten steps of the tiny model show
    # learning: measured 0.13 at version 1, and over versions 8-10 a mean 0.10 to 0.22 higher (three runs).
    # With one version of staleness it learns too, more slowly (0.13 to 0.25 in ten steps, a third of its
    # tokens clipped). TRL's synchronous trainer, above, learns the task within five steps.
    args = trl_async_grpo.build_parser().parse_args(
        [
            *trl_args(gateway.url, db_url, policy_dir, work_dir / "trl-async-out"),
            *(
                "--batch-size",
                str(GROUPS * GROUP_SIZE),
                "--groups-per-claim",
                str(GROUPS),
                "--max-staleness",
                "0",
            ),
        ]
    )
    worker = trl_async_grpo.build_worker(args)
    taken: list[Any] = []

    class Recorded(queue.Queue[Any]):
        """The worker's buffer, keeping every sample the trainer took."""

        def get(self, block: bool = True, timeout: float | None = None) -> Any:
            sample = super().get(block, timeout)
            taken.append(sample)
            return sample

    worker.rollout_buffer = Recorded(4096)
    trainer = trl_async_grpo.build_trainer(args, worker)
    AttentionInterface.register("tree_fa3", sdpa_tree_attention)  # its FlashAttention-3 kernels need CUDA

    stop = threading.Event()
    playing = threading.Thread(target=lambda: asyncio.run(play_until(gateway.url, stop)))
    playing.start()
    try:
        trainer.train()
    finally:
        stop.set()
        playing.join()

    engine = make_engine(db_url)
    with engine.connect() as conn:
        report = evaluation_report(conn, tagged_eval=False)
        (rollout_ids,) = zip(*conn.exec_driver_sql("SELECT rollout_id FROM rollouts").all(), strict=True)
    engine.dispose()
    rewards = {row["policy_version"]: row["reward_mean"] for row in report["policy_versions"]}
    print("mean reward per policy version:", {v: round(r, 3) for v, r in rewards.items() if r is not None})
    assert worker.model_version == STEPS + 1  # one sync before the first step, one after each
    assert statistics.mean(rewards[str(v)] for v in range(STEPS - 2, STEPS + 1)) > rewards["1"] + 0.05
    # Every sample TRL took is a stored turn, its mask on the sampled ids, and none was more than one version
    # behind the trainer.
    stored = {
        (prompt + completion, (0,) * len(prompt) + (1,) * len(completion))
        for rollout_id in rollout_ids
        for prompt, completion, _ in stored_tokens(gateway.url, rollout_id)
    }
    assert len(taken) >= STEPS * GROUPS * GROUP_SIZE
    assert {(tuple(s.input_ids.tolist()), tuple(s.completion_mask.tolist())) for s in taken} <= stored


async def play_until(gateway_url: str, stop: threading.Event) -> None:
    """The environment: groups of the toy task played through the gateway until `stop`."""
    runner = RolloutRunner(gateway_url, TASK, RunnerConfig(group_size=GROUP_SIZE, groups_in_flight=GROUPS))
    try:
        await runner.run(stop=stop.is_set)
    finally:
        await runner.close()


def sdpa_tree_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    *,
    tree_kv_index: Any,
    tree_cu_seqlens_q: Any,
    tree_cu_seqlens_k: Any,
    scaling: float | None = None,
    **_: Any,
) -> tuple[Any, None]:
    """AsyncGRPOTrainer's packed attention with torch's SDPA: each packed segment of queries attends
    causally to the keys of its path (gathered by `tree_kv_index`), the two aligned at their ends."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    q = query[0]  # [heads, tokens, dim]
    k, v = (x[0].index_select(1, tree_kv_index) for x in (key, value))
    if k.shape[0] != q.shape[0]:  # grouped-query attention
        k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], 0) for x in (k, v))
    out = []
    segments = zip(
        itertools.pairwise(tree_cu_seqlens_q.tolist()),
        itertools.pairwise(tree_cu_seqlens_k.tolist()),
        strict=True,
    )
    for (q0, q1), (k0, k1) in segments:
        causal = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(k1 - k0 - (q1 - q0))
        out.append(
            scaled_dot_product_attention(
                q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], attn_mask=causal, scale=scaling
            )
        )
    return torch.cat(out, 1).transpose(0, 1).unsqueeze(0), None
