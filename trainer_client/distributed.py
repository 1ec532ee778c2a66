"""Trainers on many ranks (torch.distributed data parallel): one claim per step, split across ranks by tokens.

A data-parallel trainer of N ranks claims each step's groups once, from rank 0 and under a lease, as one
trainer would: the store sees one trainer id, one lease and one commit per step, ranks never compete for
groups, and a group is never seen in part. Advantages are computed on whole groups at claim time, before
the split, so a group whose samples land on several ranks keeps the advantages one rank would give it.
Rank 0 splits the batch into one shard per rank, balanced by tokens (`shard_batch`), and sends every rank
its own. Once every rank is through the step, rank 0 commits the claim; if any rank fails, it releases it
and every rank raises, so that the groups go to a later step whole.

`shard_batch` and `split_claim` are pure. `torch.distributed` is imported only inside the functions that use
a process group, so that `trainer_client` imports without it.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer_client.batch import Batch, Sample
from trainer_client.client import TrainerClient
from training_data.groups import SampleOptions
from training_data.samples import StepSample

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)


def sample_tokens(sample: Sample) -> int:
    """What a sample costs to train on: its sequence length (prompt and completion), as a packed row or a
    variable-length kernel pays it."""
    if isinstance(sample, StepSample):
        return int(sample.prompt_ids.shape[0] + sample.completion_ids.shape[0])
    return int(sample.input_ids.shape[0])


def shard_batch(batch: Batch, world_size: int) -> list[Batch]:
    """Split `batch` into `world_size` shards balanced by tokens; every sample goes to exactly one shard.

    Longest sample first, each onto the shard with the fewest tokens so far (the lowest rank among equals),
    so the result depends only on the samples' order and lengths, the same on every machine. The heaviest
    shard then holds at most the longest sample's tokens more than the lightest, and at most
    (4/3 - 1/(3 * world_size)) times the heaviest shard of the best split possible (Graham's bound for
    longest-first scheduling). Within a shard, samples keep their order in `batch` (a rollout's steps stay
    in order) and their advantages, computed on their whole groups.

    With fewer samples than ranks, ranks 0 to len(batch) - 1 get one sample each and the others an empty
    shard. Shards carry no `counts`: those describe the claim's groups and rollouts, which a split by
    sample does not divide (see `Shard.counts`).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    tokens = [sample_tokens(sample) for sample in batch.samples]
    longest_first = sorted(range(len(tokens)), key=lambda index: (-tokens[index], index))
    lightest = [(0, rank) for rank in range(world_size)]  # (tokens so far, rank): a heap as it stands
    members: list[list[int]] = [[] for _ in range(world_size)]
    for index in longest_first:
        load, rank = heapq.heappop(lightest)
        members[rank].append(index)
        heapq.heappush(lightest, (load + tokens[index], rank))
    return [Batch([batch.samples[index] for index in sorted(indices)]) for indices in members]


def loss_tokens(samples: Iterable[Sample]) -> int:
    """Tokens that carry loss (the sum of the loss masks)."""
    return sum(int(sample.loss_mask.sum()) for sample in samples)


@dataclass
class Shard:
    """One rank's part of one step's claim, with what every rank needs to know of the whole step.

    `batch` may be empty (a step with fewer samples than ranks): such a rank must still take part in every
    collective of the step (it contributes a zero gradient to the sum), or the others wait for it. Decide
    what to do on what every rank knows (`samples`, `loss_tokens`, `metrics`), never on the rank's own
    shard, so that every rank takes the same branch.
    """

    step: int
    rank: int
    batch: Batch
    """This rank's samples, with the advantages of their whole groups."""
    samples: int
    """Samples in the whole step, over every rank."""
    loss_tokens: int
    """Loss tokens in the whole step, over every rank."""
    shard_tokens: list[int]
    """Tokens (`sample_tokens`) of every rank's shard, by rank: how balanced the split is."""
    counts: dict[str, int]
    """The claim's counters: groups and rollouts served, groups dropped, rollouts skipped by reason."""
    metrics: dict[str, float]
    """`Batch.metrics()` of the whole step's batch (reward mean over every rollout, not this shard's)."""
    kept: int | None = None
    """After the step: how many of its rollouts the commit kept (fewer if a lease ran out mid-step)."""

    @property
    def world_size(self) -> int:
        return len(self.shard_tokens)

    @property
    def token_share(self) -> float:
        """This shard's share of the step's loss tokens. A token-mean loss over the shard times this, with
        gradients summed over ranks (`sum_gradients`), gives the gradient of the token-mean loss over the
        whole step, as one process training on the whole batch would get it (with DDP, which averages
        gradients, multiply by `world_size` too)."""
        return loss_tokens(self.batch.samples) / self.loss_tokens if self.loss_tokens else 0.0


def split_claim(batch: Batch, step: int, world_size: int) -> list[Shard]:
    """The shards of a step's claimed batch, one per rank (rank 0 computes them and sends each its own)."""
    parts = shard_batch(batch, world_size)
    shard_tokens = [sum(sample_tokens(sample) for sample in part.samples) for part in parts]
    total_loss_tokens = loss_tokens(batch.samples)
    metrics = batch.metrics()
    return [
        Shard(
            step=step,
            rank=rank,
            batch=part,
            samples=len(batch),
            loss_tokens=total_loss_tokens,
            shard_tokens=shard_tokens,
            counts=dict(batch.counts),
            metrics=dict(metrics),
        )
        for rank, part in enumerate(parts)
    ]


class StepFailed(RuntimeError):
    """Raised on the ranks that did not fail when another rank failed the step: its claim was released."""


@dataclass(frozen=True)
class _NoShard:
    """Sent instead of a shard when rank 0 could not claim the step."""

    reason: str


@dataclass(frozen=True)
class _Outcome:
    """How the step ended, as rank 0 tells every rank: committed (`kept` rollouts) or released (`reason`)."""

    kept: int | None
    reason: str = ""


class DistributedClaims:
    """Each step's claim for a torch.distributed trainer: rank 0 claims and splits, every rank gets its shard,
    rank 0 commits once every rank is through (or releases if any rank failed).

        claims = DistributedClaims(TrainerClient(db) if rank == 0 else None, "trainer-0", lease=600)
        with claims.step(step, SampleOptions(max_groups=8)) as shard:
            ...  # train on shard.batch, on every rank

    Every rank of `group` (the default process group when None) must call `step` for the same steps in the
    same order: it runs collectives (a scatter on entry; on exit an all-reduce of each rank's outcome and
    rank 0's answer). A rank that raises inside the `with` still joins those, so the others learn of it and
    raise `StepFailed`, and the rank's own exception propagates; failures are agreed on at the step's
    collectives, so a rank that fails between two collectives of the body (the gradient sum, say) leaves
    the others waiting in theirs until the process group's timeout (which must also outlast rank 0's wait
    for ready groups). If rank 0 dies, the lease returns the claim to the store.
    """

    def __init__(
        self,
        client: TrainerClient | None,
        trainer_id: str,
        *,
        lease: float | None = 600.0,
        group: ProcessGroup | None = None,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedClaims needs torch.distributed initialised (init_process_group)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank == 0 and client is None:
            raise ValueError("rank 0 claims and commits: give it a TrainerClient")
        self.client = client if self.rank == 0 else None
        self.trainer_id = trainer_id
        self.lease = lease

    @contextmanager
    def step(
        self,
        step: int,
        options: SampleOptions | None = None,
        *,
        claim: Callable[[], Batch] | None = None,
    ) -> Iterator[Shard]:
        """This rank's shard of the step's claim; on leaving the block, the claim is committed once every
        rank left it without an exception, else released (then every rank raises).

        Rank 0 claims with `client.claim(trainer_id, step, options, lease=lease)`, or calls `claim()` when
        given (it must claim under `trainer_id` and `step`, e.g. a loop waiting for enough groups); the
        other ranks ignore both."""
        shard = self._receive_shard(step, options, claim)
        try:
            yield shard
        except BaseException:
            self._finish(shard, failed=True)
            raise
        self._finish(shard, failed=False)

    def _receive_shard(
        self, step: int, options: SampleOptions | None, claim: Callable[[], Batch] | None
    ) -> Shard:
        import torch.distributed as dist

        parts: list[Shard | _NoShard] | None = None
        error: Exception | None = None
        if self.rank == 0:
            try:
                batch = claim() if claim is not None else self._claim(step, options)
                parts = list(split_claim(batch, step, self.world_size))
            except Exception as exc:
                error = exc
                self._release(step)  # whatever the claim took before it failed
                parts = [_NoShard(f"rank 0 could not claim step {step}: {exc!r}")] * self.world_size
        received: list[Shard | _NoShard | None] = [None]
        dist.scatter_object_list(received, parts, group=self.group, group_src=0)
        if error is not None:
            raise error
        part = received[0]
        if isinstance(part, _NoShard):
            raise StepFailed(part.reason)
        if not isinstance(part, Shard):
            raise RuntimeError(f"rank {self.rank} received {part!r} instead of its shard of step {step}")
        return part

    def _finish(self, shard: Shard, *, failed: bool) -> None:
        """Agree on the step's outcome: every rank says whether it failed, rank 0 commits or releases and
        tells every rank what it did."""
        import torch
        import torch.distributed as dist

        votes = torch.zeros(self.world_size, dtype=torch.int64)
        votes[self.rank] = int(failed)
        try:
            dist.all_reduce(votes, group=self.group)
        except Exception:
            if self.rank == 0:  # a rank died: its share was never trained
                self._release(shard.step)
            raise
        failed_ranks = [rank for rank, vote in enumerate(votes.tolist()) if vote]
        outcome: list[_Outcome | None] = [None]
        commit_error: Exception | None = None
        if self.rank == 0:
            try:
                outcome[0] = self._settle(shard.step, failed_ranks)
            except Exception as exc:
                commit_error = exc
                self._release(shard.step)
                outcome[0] = _Outcome(None, f"rank 0 could not commit step {shard.step}: {exc!r}")
        dist.broadcast_object_list(outcome, group=self.group, group_src=0)
        result = outcome[0]
        if result is None:
            raise RuntimeError(f"rank {self.rank} received no outcome for step {shard.step}")
        if result.kept is not None:
            shard.kept = result.kept
            return
        if commit_error is not None:
            raise commit_error
        if not failed:  # a failing rank's own exception propagates instead
            raise StepFailed(result.reason)

    def _settle(self, step: int, failed_ranks: list[int]) -> _Outcome:
        client = self._client()
        if failed_ranks:
            released = client.release(self.trainer_id, step)
            return _Outcome(
                None, f"step {step} failed on rank(s) {failed_ranks}: {released} rollouts released"
            )
        return _Outcome(client.commit(self.trainer_id, step))

    def _claim(self, step: int, options: SampleOptions | None) -> Batch:
        return self._client().claim(self.trainer_id, step, options, lease=self.lease)

    def _release(self, step: int) -> None:
        """Give the step's claim back, if the store can be reached; else its lease returns it later."""
        try:
            self._client().release(self.trainer_id, step)
        except Exception:
            log.exception("could not release step %d of %s: its lease will return it", step, self.trainer_id)

    def _client(self) -> TrainerClient:
        if self.client is None:
            raise RuntimeError(f"rank {self.rank} does not talk to the store: rank 0 does")
        return self.client


def sum_gradients(parameters: Iterable[torch.nn.Parameter], group: ProcessGroup | None = None) -> None:
    """Sum the parameters' gradients over the ranks of `group`, in one all-reduce; a missing gradient (a rank
    with an empty shard, a parameter its samples did not reach) counts as zeros. Every rank ends with the
    same gradients, so the same optimizer step keeps every rank's model the same."""
    import torch
    import torch.distributed as dist

    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        size = p.numel()
        p.grad = flat[offset : offset + size].view_as(p).to(p.dtype)
        offset += size
