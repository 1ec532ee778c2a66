"""TRL's GRPO trainers fed by the gateway: they train on the ids vLLM saw and sampled, read from the store,
never on a re-tokenization of the agents' text.

Two seams, both with vLLM's weights kept in step through the gateway's admin API (pause, the served model
directory's weights replaced, reload, policy version, resume):

- `GRPOTrainer` (synchronous): `GatewayRollouts` is its `rollout_func`. Each prompt of a generation batch
  becomes a rollout (the trainer's `num_generations` copies of a prompt make one GRPO group) that your agent
  plays through the gateway; the reward it returns is posted, and the rollout's merged sample comes back from
  the store as `prompt_ids`, `completion_ids`, `logprobs` and `env_mask` (0 on the environment's tokens
  between model turns). The rollouts are played in exact mode, whatever the gateway's default: the trainer
  takes one sequence per prompt copy, and exact mode makes a conversation one chain, token for token, even
  across replies cut by `max_tokens`. A rollout whose turns still make several chains (sub-agents, a
  compaction, a history the harness rewrote) stops the step. `GatewayWeightSync` is the callback that gives
  vLLM the weights of every step.
- `trl.experimental`'s `AsyncGRPOTrainer`: `GatewayRolloutWorker` is its rollout worker, claiming ready
  groups from the store (whoever plays them: environments, orchestrators) with their advantages, and
  `GatewayWeightTransfer` its weight transfer. Every chain of a rollout (its main conversation, each
  sub-agent's, the one a compaction restarts) is a sample of its own, with the rollout's advantage. The
  trainer's model versions are the gateway's policy versions.

Needs the `trl` extra (`pip install 'rl-gateway[trl]'`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import numpy as np
import torch
from transformers import TrainerCallback

from trainer_client.client import TrainerClient
from trainer_client.sync import GatewayAdmin
from trainer_client.weights import save_tensors, save_weights
from training_data.groups import SampleOptions, numeric_version
from training_data.samples import MergedSample, response_versions, split

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments


@dataclass(frozen=True)
class Rollout:
    """What an agent needs to play one rollout through the gateway."""

    rollout_id: str
    group_id: str
    base_url: str
    """The rollout's OpenAI base URL (`OPENAI_BASE_URL`)."""
    api_key: str
    """The rollout's own key when the gateway runs with --rollout-keys, else any string."""


Agent = Callable[[Any, Rollout], Awaitable[float]]
"""Plays one episode of a prompt (the dataset's `prompt` value) with an OpenAI client at `rollout.base_url`,
and returns its reward."""


class GatewayRollouts:
    """`GRPOTrainer(rollout_func=...)`: the prompts are played by `agent` through the gateway, and the trainer
    gets back what the store recorded. Pass `reward_funcs=rollouts.reward` so that the trainer's rewards are
    the stored ones.

    The rollouts are read without claiming: this trainer played them. `waits` holds how long each generation
    batch took (the agents' calls and the store's read: the time the trainer waited on the gateway)."""

    def __init__(
        self,
        gateway_url: str,
        db: str,
        agent: Agent,
        *,
        control_token: str | None = None,
        name: str | None = None,
    ) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.agent = agent
        self.name = name or f"trl-{uuid.uuid4().hex[:8]}"
        self.waits: list[float] = []
        self._headers = {"authorization": f"Bearer {control_token}"} if control_token else {}
        self._client = TrainerClient(db)
        self._batches = 0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        started = time.monotonic()
        size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        group_ids = [f"{self.name}-{self._batches}-{i // size}" for i in range(len(prompts))]
        self._batches += 1
        rollout_ids = asyncio.run(self._play(prompts, group_ids, size))
        options = SampleOptions(merged=True, include_errors=True)
        batch = self._client.read_groups(sorted(set(group_ids)), options)
        samples = _one_chain_each(cast(list[MergedSample], batch.samples))
        silent = [rollout_id for rollout_id in rollout_ids if rollout_id not in samples]
        if silent:
            raise RuntimeError(
                f"{len(silent)} of {len(rollout_ids)} rollouts made no model call (the first: {silent[0]}): "
                "the trainer needs a completion for every prompt"
            )
        answer = _columns([samples[rollout_id] for rollout_id in rollout_ids])
        self.waits.append(time.monotonic() - started)
        return answer

    @staticmethod
    def reward(
        prompts: list[Any], completions: list[Any], reward: list[float], **_: Any
    ) -> list[float | None]:
        """The reward function that hands the trainer the stored rewards."""
        return list(reward)

    async def _play(self, prompts: list[Any], group_ids: list[str], size: int) -> list[str]:
        """Every prompt played as a rollout of its group and finished with its reward; the rollout ids."""
        async with httpx.AsyncClient(
            base_url=self.gateway_url, headers=self._headers, timeout=60.0
        ) as control:
            created = await asyncio.gather(*(_create(control, group_id, size) for group_id in group_ids))
            outcomes = await asyncio.gather(
                *(self.agent(prompt, rollout) for prompt, rollout in zip(prompts, created, strict=True)),
                return_exceptions=True,
            )
            await asyncio.gather(
                *(_finish(control, r.rollout_id, o) for r, o in zip(created, outcomes, strict=True))
            )
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            raise RuntimeError(f"an agent failed: {failed!r}") from failed
        return [rollout.rollout_id for rollout in created]

    def close(self) -> None:
        self._client.close()


async def _create(control: httpx.AsyncClient, group_id: str, size: int) -> Rollout:
    """A member of a group of `size` (TRL's generations of one prompt): no trainer takes the group before
    all of them have finished."""
    answer = await control.post("/rollouts", json={"group_id": group_id, "group_size": size, "mode": "exact"})
    answer.raise_for_status()
    body = answer.json()
    return Rollout(body["rollout_id"], group_id, body["base_url"], body.get("api_key") or "unused")


async def _finish(control: httpx.AsyncClient, rollout_id: str, outcome: float | BaseException) -> None:
    body = (
        {"status": "failed"}
        if isinstance(outcome, BaseException)
        else {"status": "completed", "reward": float(outcome)}
    )
    (await control.post(f"/rollouts/{rollout_id}/finish", json=body)).raise_for_status()


def _one_chain_each(samples: list[MergedSample]) -> dict[str, MergedSample]:
    """Each rollout's one chain of turns. `GRPOTrainer` takes one sequence per copy of a prompt (its rows are
    its dataset's prompts, its advantages a view over groups of `num_generations` rows), and one sequence
    holds one conversation: a rollout whose turns make several chains (sub-agents, a compaction, a history
    the harness rewrote, turns of a backend without exact mode) cannot reach it whole, and training
    a part of it would leave sampled tokens untrained. Such a rollout stops the step with what to do. A
    chain that trains nothing (an attempt the client retried) is left out."""
    chains: dict[str, list[MergedSample]] = {}
    for sample in samples:
        chains.setdefault(sample.rollout_id, []).append(sample)
    trained = {
        rollout_id: [c for c in chain if not c.masked] or chain[:1] for rollout_id, chain in chains.items()
    }
    trees = {rollout_id: chain for rollout_id, chain in trained.items() if len(chain) > 1}
    if trees:
        rollout_id, tree = next(iter(trees.items()))
        raise RuntimeError(
            f"{len(trees)} of {len(chains)} rollouts are trees of chains that GRPOTrainer cannot take whole "
            f"(one sequence per prompt copy); the first, {rollout_id}, has {len(tree)} chains of turns "
            f"{[chain.turn_indices for chain in tree]}. Train such agents with GatewayRolloutWorker "
            "(AsyncGRPOTrainer) or trainer_client, which take every chain as a sample of its group"
        )
    return {rollout_id: chain[0] for rollout_id, chain in trained.items()}


def _columns(samples: list[MergedSample]) -> dict[str, list[Any]]:
    """What `rollout_func` returns: the ids split at the first turn's prompt, the stored reward, and each
    completion token's version index (read with a current version, its staleness too:
    `training_data.versions`)."""
    columns: dict[str, list[Any]] = {
        "prompt_ids": [],
        "completion_ids": [],
        "logprobs": [],
        "env_mask": [],
        "reward": [],
        "rollout_id": [],
    }
    for name, per_sample in response_versions(samples).items():
        columns[name] = [values.tolist() for values in per_sample]
    for sample in samples:
        part = split(sample)
        columns["prompt_ids"].append(part.prompt_ids.tolist())
        columns["completion_ids"].append(part.response_ids.tolist())
        columns["logprobs"].append(part.response_logprobs.tolist())
        columns["env_mask"].append(part.response_mask.tolist())
        columns["reward"].append(sample.reward)
        columns["rollout_id"].append(sample.rollout_id)
    return columns


def _admin(gateway_url: str, admin_token: str | None) -> tuple[GatewayAdmin, int]:
    """The gateway's admin API, and the policy version it stamps now (0 if not a number): where the
    versions a trainer sets start from."""
    admin = GatewayAdmin(gateway_url, admin_token)
    return admin, numeric_version(admin.state()["policy_version"]) or 0


class GatewayWeightSync(TrainerCallback):
    """After every optimizer step, vLLM takes the new weights: the gateway pauses, the served model
    directory's safetensors are replaced, every backend reloads them, and the policy version becomes the
    gateway's version at the start plus the step. On one process, or where every rank holds the whole
    model (the main process writes)."""

    def __init__(
        self, gateway_url: str, model_dir: Path, *, admin_token: str | None = None, mode: str = "wait"
    ) -> None:
        self.model_dir = Path(model_dir)
        self.mode = mode
        self.admin, self.start_version = _admin(gateway_url, admin_token)
        self.syncs: list[float] = []
        """Seconds each sync took."""

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **_: Any,
    ) -> None:
        if not state.is_world_process_zero or model is None:
            return
        started = time.monotonic()
        with self.admin.weight_sync(str(self.start_version + state.global_step), mode=self.mode):
            save_weights(model, self.model_dir)
            self.admin.reload_weights()
        self.syncs.append(time.monotonic() - started)


class GatewayRolloutWorker:
    """`AsyncGRPOTrainer(rollout_worker=...)`: a thread claims ready groups from the store (at most
    `max_staleness` versions behind the trainer's model version) and puts their merged samples on
    `rollout_buffer`, with the store's GRPO advantages. A claim is committed at once: what is in the buffer
    is the trainer's. Agents play elsewhere, through the gateway."""

    def __init__(
        self,
        db: str,
        *,
        trainer_id: str = "trl",
        max_staleness: int | None = None,
        groups_per_claim: int = 8,
        include_errors: bool = False,
        buffer_size: int = 4096,
    ) -> None:
        self.rollout_buffer: queue.Queue[Any] = queue.Queue(buffer_size)
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.trainer_id = trainer_id
        self.max_staleness = max_staleness
        self.groups_per_claim = groups_per_claim
        self.include_errors = include_errors
        self.model_version = 0
        self._db = db
        self._groups: dict[str, int] = {}
        self._claims = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gateway-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def update_model_version(self, version: int) -> None:
        self.model_version = version

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the claiming thread has died (the trainer calls this when its buffer runs dry)."""
        if self._failure is not None:
            raise RuntimeError(f"the gateway rollout worker failed: {self._failure!r}") from self._failure
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the gateway rollout worker is not running")

    def _run(self) -> None:
        try:
            with TrainerClient(self._db) as client:
                while not self._stop.is_set():
                    if not self._claim(client):
                        self._stop.wait(0.2)
        except BaseException as exc:  # the trainer learns of it from check_health
            self._failure = exc
            raise

    def _claim(self, client: TrainerClient) -> bool:
        """Claim up to `groups_per_claim` groups and queue their samples; whether any was ready."""
        step = self._claims
        options = SampleOptions(
            current_version=self.model_version,
            max_staleness=self.max_staleness,
            max_groups=self.groups_per_claim,
            include_errors=self.include_errors,
            merged=True,
        )
        batch = client.claim(self.trainer_id, step, options)
        if not batch.counts.get("groups"):
            return False
        self._claims += 1
        for sample in cast(list[MergedSample], batch.samples):
            self._put(self._rollout_sample(sample))
        skipped = batch.counts.get("skipped_stale", 0)
        self.metrics_queue.put(
            {"gateway/claimed_samples": float(len(batch)), "gateway/stale": float(skipped)}
        )
        return True

    def _put(self, item: Any) -> None:
        """Onto the buffer, waiting while it is full, unless the worker is stopped meanwhile."""
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def _rollout_sample(self, sample: MergedSample) -> Any:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        group = self._groups.setdefault(sample.group_id, len(self._groups))
        return RolloutSample(
            prompt=[],
            completion=[],
            input_ids=sample.input_ids.astype(np.int64),
            completion_mask=sample.loss_mask.astype(np.int64),
            old_log_probs=sample.token_logprobs.astype(np.float32),
            advantage=float(sample.advantage),
            model_version=numeric_version(sample.policy_version) or 0,
            group_id=group,
            metrics={"reward": float(sample.reward)},
            enqueued_at=time.time(),
        )


class GatewayWeightTransfer:
    """`AsyncGRPOTrainer(weight_transfer=...)` through the disk and the gateway's admin API: the trainer's
    weights replace the served model directory's safetensors, every backend reloads them, and the gateway
    resumes at the next policy version (the trainer's own count of syncs, as its model versions are)."""

    def __init__(
        self, gateway_url: str, model_dir: Path, *, admin_token: str | None = None, mode: str = "wait"
    ) -> None:
        self.model_dir = Path(model_dir)
        self.mode = mode
        self.admin, self.version = _admin(gateway_url, admin_token)

    def init_weight_transfer(self) -> None:
        self.admin.state()  # the gateway answers: fail now rather than at the first sync

    def pause(self) -> None:
        self.admin.pause(self.mode)

    def send_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Write them all (the trainer's ranks walk the iterator in step), then have every backend reload."""
        save_tensors({name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}, self.model_dir)
        self.admin.reload_weights()

    def resume(self) -> None:
        self.version += 1
        try:
            self.admin.set_policy_version(str(self.version))
        finally:
            self.admin.resume()

    def destroy(self) -> None:
        self.admin.close()
