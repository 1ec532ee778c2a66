"""Step-wise GRPO samples from the gateway's store, claimed safely, as torch tensors.

    from trainer_client import SampleOptions, TrainerClient, grpo_loss

    client = TrainerClient("sqlite:///gateway.db")
    batch = client.claim("trainer-0", step=0, options=SampleOptions(current_version=3, max_staleness=2))
    tensors = batch.padded(pad_id=0)

A torch.distributed trainer claims once per step on rank 0 and gives every rank a shard balanced by tokens
(`DistributedClaims`, `shard_batch`; `trainer_client.distributed`).

The reference async GRPO trainer is `trainer_client.reference.trainer`, the rollout workers
`trainer_client.reference.runner`, and `trainer_client.reference.loop` runs both against a gateway.

A LoRA policy of the gateway (`--lora-policy NAME=BASE`): `LoRAAdapter.attach(model, LoRAConfig(...))` makes
a `transformers` model's linear layers trainable as LoRA, `adapter.save(dir)` writes each version in PEFT's
format, and `GatewayAdmin.publish_adapter` makes it the policy's live version (`trainer_client.lora`).

On-policy distillation: `trainer-client score` (`trainer_client.scoring`) stores a teacher's logprob of
every sampled token; samples read with `SampleOptions(teacher=...)` carry them, and
`distillation_advantages` turns them into per-token advantages.

The same samples for the trainers teams already run: `trainer_client.hf` (Hugging Face datasets),
`trainer_client.trl` (TRL's GRPO trainers), `trainer_client.verl` (verl's agent-loop batch) and
`trainer_client.skyrl` (SkyRL's generator output).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer_client.batch import Batch
    from trainer_client.client import TrainerClient
    from trainer_client.distributed import DistributedClaims, Shard, StepFailed, shard_batch, sum_gradients
    from trainer_client.lora import LoRAAdapter, LoRAConfig
    from trainer_client.loss import distillation_advantages, grpo_loss, teacher_kl
    from trainer_client.sync import GatewayAdmin
    from training_data.groups import SampleOptions
    from training_data.samples import MergedSample, StepSample

_HOMES = {
    "Batch": "trainer_client.batch",
    "DistributedClaims": "trainer_client.distributed",
    "GatewayAdmin": "trainer_client.sync",
    "LoRAAdapter": "trainer_client.lora",
    "LoRAConfig": "trainer_client.lora",
    "MergedSample": "training_data.samples",
    "SampleOptions": "training_data.groups",
    "Shard": "trainer_client.distributed",
    "StepFailed": "trainer_client.distributed",
    "StepSample": "training_data.samples",
    "TrainerClient": "trainer_client.client",
    "distillation_advantages": "trainer_client.loss",
    "grpo_loss": "trainer_client.loss",
    "shard_batch": "trainer_client.distributed",
    "sum_gradients": "trainer_client.distributed",
    "teacher_kl": "trainer_client.loss",
}
"""Where each name lives, imported on first use: torch loads with the names that need it, so that
`trainer-client stats` and `export` (and an analyst's reads) start without it."""


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = [
    "Batch",
    "DistributedClaims",
    "GatewayAdmin",
    "LoRAAdapter",
    "LoRAConfig",
    "MergedSample",
    "SampleOptions",
    "Shard",
    "StepFailed",
    "StepSample",
    "TrainerClient",
    "distillation_advantages",
    "grpo_loss",
    "shard_batch",
    "sum_gradients",
    "teacher_kl",
]
