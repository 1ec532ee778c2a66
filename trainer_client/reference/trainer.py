"""The reference async GRPO trainer: claim a batch, take one clipped policy-gradient step, sync the weights.

Rollouts keep flowing while it trains: the batch comes from whatever groups are ready, samples more than
`max_staleness` policy versions old are skipped at claim time, and the weight sync pauses the engines only for
the moment it takes to reload. On CPU the sync goes through the disk: the new weights are written (atomically)
as the served model directory's safetensors, then every vLLM backend reloads them and is told the new version.
Claims are leased: a trainer killed mid-step gives its rollouts back when the lease runs out.

With `TrainerConfig(lora=LoRAPolicy(...))` it trains a LoRA policy of the gateway (`--lora-policy NAME=BASE`)
instead: the base model's weights stay frozen and untouched on disk, only the adapter trains
(`trainer_client.lora`), and each step's adapter is saved to a directory of its own and published as the
policy's next version (`GatewayAdmin.publish_adapter`): new calls go to it, calls in flight finish on theirs,
nothing pauses. Version 0, the fresh adapter that answers as the base model does, is published as the trainer
starts, so that the rollouts have a version to run on.

With `TrainerConfig(data_parallel=True)` it is one rank of a torch.distributed trainer (see
`trainer_client.distributed`): rank 0 claims each step and splits it by tokens, every rank trains on its shard
and the gradients are summed over ranks so that every rank takes the same optimizer step, and rank 0 alone
writes the weights, talks to the gateway and commits the step once every rank is through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM

from trainer_client.batch import Batch
from trainer_client.client import TrainerClient
from trainer_client.distributed import DistributedClaims, Shard, sum_gradients
from trainer_client.lora import LoRAAdapter, LoRAConfig
from trainer_client.loss import distillation_advantages, grpo_loss
from trainer_client.scoring import Scorer, TeacherServer
from trainer_client.sync import GatewayAdmin
from trainer_client.weights import save_weights
from training_data.groups import SampleOptions
from training_data.teacher_scores import ScoreFilter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Distillation:
    """On-policy distillation: the teacher scores every sampled token of the rollouts as they land, and the
    advantage of each token is `kl_weight * (teacher logprob - sampling logprob)` plus `grpo_weight` times
    its GRPO advantage (`trainer_client.loss.distillation_advantages`)."""

    teacher_url: str
    model: str
    """The teacher's served model name: its scores are stored under it."""
    kl_weight: float = 1.0
    grpo_weight: float = 0.0
    api_key: str | None = None


@dataclass(frozen=True)
class LoRAPolicy:
    """A LoRA policy of the gateway to train: its name (`--lora-policy NAME=BASE`), where its versions are
    saved, and the adapter's shape."""

    name: str
    adapter_dir: Path
    """Version N is saved as `adapter_dir / f"v{N}"`, a directory every vLLM server of the base reads; none
    may exist yet (a version is never overwritten)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass(frozen=True)
class TrainerConfig:
    model_dir: Path
    """The directory vLLM serves: the policy is loaded from it and new weights are written to it (with
    `lora`, the base model, only read)."""
    db: str
    gateway_url: str
    admin_token: str | None = None
    trainer_id: str = "trainer-0"
    steps: int = 20
    groups_per_step: int = 4
    learning_rate: float = 1e-6
    clip: float = 0.2
    entropy_bonus: float = 0.0
    """Weight of the policy's mean entropy on the loss tokens, subtracted from the loss: it keeps a small
    policy from turning deterministic, after which every group's rewards are equal and nothing is learnt."""
    max_grad_norm: float = 1.0
    max_staleness: int = 1
    """Samples from more than this many versions before the current one are skipped."""
    lease: float = 600.0
    """Seconds a claim holds before other trainers may take it, unless this trainer commits its step."""
    sync_mode: Literal["wait", "abort", "keep"] = "wait"
    batch_timeout: float = 600.0
    """Seconds to wait for `groups_per_step` ready groups."""
    include_errors: bool = True
    """Keep rollouts with error turns (masked) so that their groups' statistics stay whole."""
    seed: int = 0
    torch_threads: int | None = None
    """Threads for the trainer's torch (default: torch's choice); 1 leaves a small machine to vLLM."""
    data_parallel: bool = False
    """Run as one rank of the default torch.distributed process group (which the caller set up: torchrun,
    `init_process_group`), every rank with the same config. Only rank 0 reads the store, writes the weights
    and calls the gateway."""
    distill: Distillation | None = None
    """Train toward a teacher's logprobs (alone, or mixed with the reward) instead of the reward alone."""
    lora: LoRAPolicy | None = None
    """Train this LoRA policy's adapter on the frozen base model instead of the served weights."""


@dataclass(frozen=True)
class StepReport:
    step: int
    version: int
    """The policy version the step produced."""
    rollouts: int
    samples: int
    reward_mean: float
    loss: float
    approx_kl: float
    clip_fraction: float
    loss_tokens: int
    tokens_per_s: float
    skipped_stale: int
    wait_s: float
    train_s: float
    sync_s: float
    shard_tokens: tuple[int, ...] = ()
    """Data parallel: the tokens of each rank's shard, by rank (empty on one process)."""
    teacher_kl: float | None = None
    """Distillation: the mean per-token reverse KL of the step's samples to the teacher."""

    def line(self) -> str:
        ranks = f"  ranks {'/'.join(map(str, self.shard_tokens))} tokens" if self.shard_tokens else ""
        teacher = f"teacher kl {self.teacher_kl:.4f}  " if self.teacher_kl is not None else ""
        return (
            f"step {self.step:>3}  v{self.version:<3} reward {self.reward_mean:.4f}  {teacher}"
            f"loss {self.loss:+.4f}  "
            f"kl {self.approx_kl:.5f}  clip {self.clip_fraction:.3f}  {self.rollouts} rollouts "
            f"{self.loss_tokens} tokens  {self.tokens_per_s:,.0f} tok/s  stale {self.skipped_stale}  "
            f"wait {self.wait_s:.1f}s train {self.train_s:.2f}s sync {self.sync_s:.2f}s{ranks}"
        )


class GRPOTrainer:
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self.model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=torch.float32)
        self.adapter = LoRAAdapter.attach(self.model, config.lora.lora) if config.lora else None
        self.model.train()
        trained = self.adapter.parameters() if self.adapter else self.model.parameters()
        self.optimizer = torch.optim.Adam(trained, lr=config.learning_rate)
        self.rank = _default_rank() if config.data_parallel else 0
        self._client = TrainerClient(config.db) if self.rank == 0 else None
        self._admin = GatewayAdmin(config.gateway_url, config.admin_token) if self.rank == 0 else None
        self.version = self._first_version() if self.rank == 0 else 0
        self.scorer = self._distillation_scorer() if self.rank == 0 else None
        self.claims: DistributedClaims | None = None
        if config.data_parallel:
            self.claims = DistributedClaims(self._client, config.trainer_id, lease=config.lease)
            self.version = _start_like_rank_0(self.model, self.version)

    @property
    def client(self) -> TrainerClient:
        """The store's client: rank 0's alone."""
        if self._client is None:
            raise RuntimeError(f"rank {self.rank} does not read the store: rank 0 does")
        return self._client

    @property
    def admin(self) -> GatewayAdmin:
        """The gateway's admin API: rank 0's alone."""
        if self._admin is None:
            raise RuntimeError(f"rank {self.rank} does not call the gateway: rank 0 does")
        return self._admin

    def run(
        self, on_step: Callable[[StepReport], None] | None = None, alive: Callable[[], bool] = lambda: True
    ) -> list[StepReport]:
        """Train `steps` steps; `alive()` turning false (the rollout workers died) ends the wait for
        groups."""
        reports = []
        for step in range(self.config.steps):
            report = self.step(step, alive)
            log.info(report.line())
            reports.append(report)
            if on_step is not None:
                on_step(report)
        return reports

    def step(self, step: int, alive: Callable[[], bool] = lambda: True) -> StepReport:
        if self.claims is not None:
            return self._data_parallel_step(self.claims, step, alive)
        config = self.config
        started = time.monotonic()
        batch = self.claim(step, alive)
        waited = time.monotonic() - started
        metrics = self.train_on(batch)
        trained = time.monotonic()
        self.client.renew(config.trainer_id, step, config.lease)
        self.sync(self.version + 1)
        kept = self.client.commit(config.trainer_id, step)
        _warn_if_taken(step, kept, batch.counts.get("served_rollouts", 0))
        synced = time.monotonic()
        train_s = trained - started - waited
        tokens = int(metrics.pop("loss_tokens"))
        summary = batch.metrics()
        return StepReport(
            step=step,
            version=self.version,
            rollouts=len(batch.rollout_ids),
            samples=len(batch),
            reward_mean=summary["reward_mean"],
            teacher_kl=summary.get("teacher_kl"),
            loss=metrics["loss"],
            approx_kl=metrics["approx_kl"],
            clip_fraction=metrics["clip_fraction"],
            loss_tokens=tokens,
            tokens_per_s=tokens / max(train_s, 1e-9),
            skipped_stale=batch.counts.get("skipped_stale", 0),
            wait_s=waited,
            train_s=train_s,
            sync_s=synced - trained,
        )

    def _data_parallel_step(
        self, claims: DistributedClaims, step: int, alive: Callable[[], bool]
    ) -> StepReport:
        """The step as one rank: rank 0 claims (waiting for `groups_per_step` groups), every rank trains on
        its shard, rank 0 syncs the weights; leaving the block commits the claim once every rank is done."""
        config = self.config
        started = time.monotonic()
        with claims.step(step, claim=lambda: self.claim(step, alive)) as shard:
            waited = time.monotonic() - started
            metrics = self.train_shard(shard)
            trained = time.monotonic()
            if self.rank == 0:
                self.client.renew(config.trainer_id, step, config.lease)
                self.sync(self.version + 1)
        if self.rank != 0:
            self.version += 1  # rank 0 synced it: the step committed
        if self.rank == 0:
            _warn_if_taken(step, shard.kept or 0, shard.counts.get("served_rollouts", 0))
        synced = time.monotonic()
        train_s = trained - started - waited
        tokens = int(metrics.pop("loss_tokens"))
        return StepReport(
            step=step,
            version=self.version,
            rollouts=int(shard.metrics["rollouts"]),
            samples=shard.samples,
            reward_mean=shard.metrics["reward_mean"],
            teacher_kl=shard.metrics.get("teacher_kl"),
            loss=metrics["loss"],
            approx_kl=metrics["approx_kl"],
            clip_fraction=metrics["clip_fraction"],
            loss_tokens=tokens,
            tokens_per_s=tokens / max(train_s, 1e-9),
            skipped_stale=shard.counts.get("skipped_stale", 0),
            wait_s=waited,
            train_s=train_s,
            sync_s=synced - trained,
            shard_tokens=tuple(shard.shard_tokens),
        )

    def claim(self, step: int, alive: Callable[[], bool] = lambda: True) -> Batch:
        """Ready groups up to `groups_per_step`, waiting for more while fewer are ready (the leases of those
        already taken are renewed meanwhile)."""
        config = self.config
        deadline = time.monotonic() + config.batch_timeout
        batches: list[Batch] = []
        while True:
            have = sum(b.counts.get("groups", 0) for b in batches)
            if have >= config.groups_per_step:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {have} of {config.groups_per_step} groups ready after {config.batch_timeout:.0f} s"
                )
            if not alive():
                raise RuntimeError("stopped waiting for groups: the rollout workers are gone")
            if batches:
                self.client.renew(config.trainer_id, step, config.lease)
            if self.scorer is not None:
                # a group is served once the teacher has scored it: the newest first, so that the groups
                # this step can train on are scored however many stale ones wait
                self.scorer.score(ScoreFilter(newest_groups=config.groups_per_step - have))
            options = SampleOptions(
                current_version=self.version,
                max_staleness=config.max_staleness,
                max_groups=config.groups_per_step - have,
                include_errors=config.include_errors,
                teacher=config.distill.model if config.distill else None,
            )
            batch = self.client.claim(config.trainer_id, step, options, lease=config.lease)
            if any(batch.counts.values()):
                batches.append(batch)
            else:
                time.sleep(0.2)
        counts: dict[str, int] = {}
        for batch in batches:
            for name, value in batch.counts.items():
                counts[name] = counts.get(name, 0) + value
        return Batch([s for b in batches for s in b.samples], counts)

    def train_on(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on the batch; the ratio is taken against the engine's sampling logprobs."""
        tensors = batch.padded()
        loss, metrics = self.loss(tensors)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        return {**metrics, "loss": float(loss.detach()), "loss_tokens": float(tensors["loss_mask"].sum())}

    def train_shard(self, shard: Shard) -> dict[str, float]:
        """One optimizer step on this rank's shard, the same step on every rank.

        Each rank weights its token-mean loss by its share of the step's loss tokens and the gradients are
        summed over ranks, so every rank applies the gradient one process would compute on the whole batch
        (`train_on`), whatever the split; the clipped, summed gradients are the same on every rank, and so
        are the weights after the step. A rank with an empty shard runs no model but joins the sums with
        zeros. The metrics come back summed over ranks too: those of the whole step."""
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(3, dtype=torch.float64)  # loss, approx_kl and clip_fraction weighted by tokens
        if shard.batch.samples:
            tensors = shard.batch.padded()
            loss, metrics = self.loss(tensors)
            weighted = loss * shard.token_share
            weighted.backward()  # type: ignore[no-untyped-call]
            tokens = float(tensors["loss_mask"].sum())
            sums = torch.tensor(
                [float(weighted.detach()), metrics["approx_kl"] * tokens, metrics["clip_fraction"] * tokens],
                dtype=torch.float64,
            )
        sum_gradients(self.model.parameters())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        loss_sum, kl_sum, clip_sum = _sum_over_ranks(sums).tolist()
        total = max(shard.loss_tokens, 1)
        return {
            "loss": loss_sum,
            "approx_kl": kl_sum / total,
            "clip_fraction": clip_sum / total,
            "loss_tokens": float(shard.loss_tokens),
        }

    def loss(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped GRPO loss against the engine's sampling logprobs, less the entropy bonus; with
        distillation, its advantages are toward the teacher."""
        distill = self.config.distill
        if distill is not None:
            advantages = distillation_advantages(
                tensors, kl_weight=distill.kl_weight, grpo_weight=distill.grpo_weight
            )
            tensors = {**tensors, "advantages": advantages}
        bonus = self.config.entropy_bonus
        logprobs, entropy = token_logprobs(
            self.model, tensors["input_ids"], tensors["attention_mask"], entropy=bonus > 0
        )
        loss, metrics = grpo_loss(
            logprobs,
            tensors["old_logprobs"],
            tensors["advantages"],
            tensors["loss_mask"],
            clip_low=self.config.clip,
            clip_high=self.config.clip,
        )
        if entropy is None:
            return loss, metrics
        mask = tensors["loss_mask"].to(entropy.dtype)
        mean_entropy = (entropy * mask).sum() / mask.sum().clamp(min=1)
        return loss - bonus * mean_entropy, {**metrics, "entropy": float(mean_entropy.detach())}

    def sync(self, version: int) -> None:
        """Write the weights where vLLM reads them, have every backend reload them, then take the version;
        for a LoRA policy, publish the adapter as that version instead."""
        lora = self.config.lora
        if lora is not None and self.adapter is not None:
            self.publish(lora, self.adapter, version)
        else:
            with self.admin.weight_sync(str(version), mode=self.config.sync_mode):
                save_weights(self.model, self.config.model_dir)
                self.admin.reload_weights()
        self.version = version

    def publish(self, policy: LoRAPolicy, adapter: LoRAAdapter, version: int) -> None:
        """Save the adapter as its version's own directory and make it the LoRA policy's live version."""
        path = adapter.save(policy.adapter_dir / f"v{version}")
        self.admin.publish_adapter(policy.name, str(version), str(path))

    def _first_version(self) -> int:
        """The version the trainer starts from: the gateway's policy version, or for a LoRA policy 0, the
        fresh adapter, published now (the base model's answers under the policy's name)."""
        lora = self.config.lora
        if lora is None or self.adapter is None:
            return int(self.admin.state()["policy_version"])
        self.publish(lora, self.adapter, 0)
        return 0

    def _distillation_scorer(self) -> Scorer | None:
        """The teacher's scorer, its tokenizer checked against the gateway's first server."""
        distill = self.config.distill
        if distill is None:
            return None
        teacher = TeacherServer(distill.teacher_url, distill.model, api_key=distill.api_key)
        scorer = Scorer(self.config.db, teacher)
        scorer.check(self.admin.state()["backends"][0]["url"])
        return scorer

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer.teacher.close()
        if self._client is not None:
            self._client.close()
        if self._admin is not None:
            self._admin.close()


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] logprob of each token given those before it, and with `entropy` the policy's entropy there
    (both 0 at position 0), as `Batch.padded()` aligns them. The entropy costs two more [B, T, vocab]
    tensors: it is computed only when asked for."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    every = torch.log_softmax(logits, dim=-1)
    picked = torch.nn.functional.pad(every.gather(-1, input_ids[:, 1:, None]).squeeze(-1), (1, 0))
    if not entropy:
        return picked, None
    return picked, torch.nn.functional.pad(-(every.exp() * every).sum(-1), (1, 0))


def _warn_if_taken(step: int, kept: int, rollouts: int) -> None:
    if kept < rollouts:
        log.warning(
            "step %d: %d of %d rollouts were taken by another trainer after their lease ran out "
            "(raise the lease above a step's time)",
            step,
            rollouts - kept,
            rollouts,
        )


def _default_rank() -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("data_parallel needs torch.distributed initialised first (init_process_group)")
    return dist.get_rank()


def _start_like_rank_0(model: torch.nn.Module, version: int) -> int:
    """Every rank starts from rank 0's weights and policy version (the only rank that asked the gateway)."""
    import torch.distributed as dist

    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    versions: list[int] = [version]
    dist.broadcast_object_list(versions, src=0)
    return versions[0]


def _sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(values)
    return values
