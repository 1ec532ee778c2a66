"""The reference async GRPO trainer: claim a batch, take one clipped policy-gradient step, sync the weights.

Rollouts keep flowing while it trains: the batch comes from whatever groups are ready, samples more than
`max_staleness` policy versions old are skipped at claim time, and the weight sync pauses the engines only for
the moment it takes to reload. On CPU the sync goes through the disk: the new weights are written (atomically)
as the served model directory's safetensors, then every vLLM backend reloads them and is told the new version.
Claims are leased: a trainer killed mid-step gives its rollouts back when the lease runs out.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from trainer_client.batch import Batch
from trainer_client.client import TrainerClient
from trainer_client.groups import SampleOptions
from trainer_client.loss import grpo_loss
from trainer_client.sync import GatewayAdmin

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerConfig:
    model_dir: Path
    """The directory vLLM serves: the policy is loaded from it and new weights are written to it."""
    db: str
    gateway_url: str
    admin_token: str | None = None
    trainer_id: str = "trainer-0"
    steps: int = 20
    groups_per_step: int = 4
    learning_rate: float = 1e-6
    clip: float = 0.2
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

    def line(self) -> str:
        return (
            f"step {self.step:>3}  v{self.version:<3} reward {self.reward_mean:.4f}  loss {self.loss:+.4f}  "
            f"kl {self.approx_kl:.5f}  clip {self.clip_fraction:.3f}  {self.rollouts} rollouts "
            f"{self.loss_tokens} tokens  {self.tokens_per_s:,.0f} tok/s  stale {self.skipped_stale}  "
            f"wait {self.wait_s:.1f}s train {self.train_s:.2f}s sync {self.sync_s:.2f}s"
        )


class GRPOTrainer:
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self.model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.learning_rate)
        self.client = TrainerClient(config.db)
        self.admin = GatewayAdmin(config.gateway_url, config.admin_token)
        self.version = int(self.admin.state()["policy_version"])

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
        config = self.config
        started = time.monotonic()
        batch = self.claim(step, alive)
        waited = time.monotonic() - started
        metrics = self.train_on(batch)
        trained = time.monotonic()
        self.client.renew(config.trainer_id, step, config.lease)
        self.sync(self.version + 1)
        kept = self.client.commit(config.trainer_id, step)
        if kept < len(batch.rollout_ids):
            log.warning(
                "step %d: %d of %d rollouts were taken by another trainer after their lease ran out "
                "(raise the lease above a step's time)",
                step,
                len(batch.rollout_ids) - kept,
                len(batch.rollout_ids),
            )
        synced = time.monotonic()
        train_s = trained - started - waited
        tokens = int(metrics.pop("loss_tokens"))
        return StepReport(
            step=step,
            version=self.version,
            rollouts=len(batch.rollout_ids),
            samples=len(batch),
            reward_mean=batch.metrics()["reward_mean"],
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
            options = SampleOptions(
                current_version=self.version,
                max_staleness=config.max_staleness,
                max_groups=config.groups_per_step - have,
                include_errors=config.include_errors,
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
        logprobs = token_logprobs(self.model, tensors["input_ids"], tensors["attention_mask"])
        loss, metrics = grpo_loss(
            logprobs,
            tensors["old_logprobs"],
            tensors["advantages"],
            tensors["loss_mask"],
            clip_low=self.config.clip,
            clip_high=self.config.clip,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        return {**metrics, "loss": float(loss.detach()), "loss_tokens": float(tensors["loss_mask"].sum())}

    def sync(self, version: int) -> None:
        """Write the weights where vLLM reads them, have every backend reload them, then take the version."""
        with self.admin.weight_sync(str(version), mode=self.config.sync_mode):
            save_weights(self.model, self.config.model_dir)
            self.admin.reload_weights()
        self.version = version

    def close(self) -> None:
        self.client.close()
        self.admin.close()


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """[B, T] logprob of each token given those before it (0 at position 0), as `Batch.padded()` aligns
    them."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def save_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Replace `model.safetensors` in one rename, so that a reader never sees half a file."""
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    target = Path(model_dir) / "model.safetensors"
    partial = target.with_suffix(".safetensors.partial")
    save_file(state, str(partial), metadata={"format": "pt"})
    os.replace(partial, target)
