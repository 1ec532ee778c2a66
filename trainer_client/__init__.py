"""Step-wise GRPO samples from the gateway's store, claimed safely, as torch tensors.

    from trainer_client import SampleOptions, TrainerClient, grpo_loss

    client = TrainerClient("sqlite:///gateway.db")
    batch = client.claim("trainer-0", step=0, options=SampleOptions(current_version=3, max_staleness=2))
    tensors = batch.padded(pad_id=0)

A torch.distributed trainer claims once per step on rank 0 and gives every rank a shard balanced by tokens
(`DistributedClaims`, `shard_batch`; `trainer_client.distributed`).

The reference async GRPO trainer is `trainer_client.reference.trainer`, the rollout workers
`trainer_client.reference.runner`, and `trainer_client.reference.loop` runs both against a gateway.
"""

from gateway.store.groups import SampleOptions
from gateway.store.samples import MergedSample, StepSample
from trainer_client.batch import Batch
from trainer_client.client import TrainerClient
from trainer_client.distributed import DistributedClaims, Shard, StepFailed, shard_batch, sum_gradients
from trainer_client.loss import grpo_loss
from trainer_client.sync import GatewayAdmin

__all__ = [
    "Batch",
    "DistributedClaims",
    "GatewayAdmin",
    "MergedSample",
    "SampleOptions",
    "Shard",
    "StepFailed",
    "StepSample",
    "TrainerClient",
    "grpo_loss",
    "shard_batch",
    "sum_gradients",
]
