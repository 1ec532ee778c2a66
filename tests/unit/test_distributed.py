"""Splitting a claimed batch across data-parallel ranks (trainer_client.distributed): balanced by tokens,
every sample on exactly one rank with its group's advantage, deterministic, and a token-weighted loss over
the shards that equals the whole batch's."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import random

import numpy as np
import pytest
import torch

from trainer_client import Batch, grpo_loss, shard_batch
from trainer_client.distributed import loss_tokens, sample_tokens, split_claim
from training_data.samples import StepSample, merge_steps

from support.samples import step


def sample(
    rollout_id: str,
    tokens: int,
    *,
    completion: int = 1,
    advantage: float = 0.0,
    group_id: str = "g",
    turn_index: int = 0,
    masked: bool = False,
) -> StepSample:
    """A step of `tokens` tokens in all, the last `completion` of them sampled."""
    return step(
        turn_index,
        [i % 50 for i in range(tokens - completion)],
        [(i * 7 + turn_index) % 50 for i in range(completion)],
        [-3.9 + 0.05 * (turn_index % 3)] * completion,  # near 1 / 50
        rollout_id=rollout_id,
        group_id=group_id,
        reward=advantage,
        advantage=advantage,
        is_last_step=True,
        masked=masked,
    )


def of_lengths(lengths: list[int]) -> Batch:
    return Batch([sample(f"r{index}", tokens) for index, tokens in enumerate(lengths)])


def ids(batch: Batch) -> list[str]:
    return [s.rollout_id for s in batch.samples]


def loads(shards: list[Batch]) -> list[int]:
    return [sum(sample_tokens(s) for s in shard.samples) for shard in shards]


def agentic_batch() -> Batch:
    """8 GRPO groups of 8 tool-using rollouts, 1 to 8 turns each, step-wise: each turn's prompt is a 600-token
    task plus the history so far (replies of 40 to 199 tokens, 60 tokens of tool output after each)."""
    samples = []
    for group, member in itertools.product(range(8), range(8)):
        rollout = group * 8 + member
        prompt = 600 + (rollout * 13) % 40
        for turn in range(1 + (rollout * 5 + group) % 8):
            reply = 40 + (rollout * 37 + turn * 11) % 160
            name = f"g{group}-m{member}"
            samples.append(
                sample(name, prompt + reply, completion=reply, group_id=f"g{group}", turn_index=turn)
            )
            prompt += reply + 60
    return Batch(samples)


# --- which sample goes where -------------------------------------------------------------------------------


def test_longest_first_onto_the_lightest_shard_gives_these_shards() -> None:
    # 9 -> rank 0, 7 -> 1, 5 -> 1 (7 < 9), 4 -> 0 (9 < 12), 3 -> 1 (12 < 13), 2 -> 0 (13 < 15)
    shards = shard_batch(of_lengths([5, 9, 3, 7, 4, 2]), 2)

    assert [ids(shard) for shard in shards] == [["r1", "r4", "r5"], ["r0", "r2", "r3"]]
    assert loads(shards) == [15, 15]


def test_equally_light_shards_are_filled_from_the_lowest_rank() -> None:
    shards = shard_batch(of_lengths([5, 5, 5, 5, 5]), 3)

    assert [ids(shard) for shard in shards] == [["r0", "r3"], ["r1", "r4"], ["r2"]]


def test_every_sample_lands_on_exactly_one_shard() -> None:
    batch = agentic_batch()
    keys = [(s.rollout_id, s.turn_index) for s in batch.samples]

    for world_size in (1, 2, 3, 4, 8, 64, 500):
        shards = shard_batch(batch, world_size)
        placed = [(s.rollout_id, s.turn_index) for shard in shards for s in shard.samples]
        assert len(shards) == world_size
        assert sorted(placed) == sorted(keys) and len(placed) == len(set(placed)) == 288


def test_shards_hold_the_very_samples_with_their_groups_advantages_in_batch_order() -> None:
    batch = Batch(
        [
            sample("a", 30, advantage=1.5, group_id="g1", turn_index=0),
            sample("a", 40, advantage=1.5, group_id="g1", turn_index=1),
            sample("b", 10, advantage=-1.5, group_id="g1"),
            sample("c", 20, advantage=0.25, group_id="g2"),
        ]
    )

    shards = shard_batch(batch, 2)

    assert [[(s.rollout_id, s.turn_index, s.advantage) for s in shard.samples] for shard in shards] == [
        [("a", 1, 1.5), ("b", 0, -1.5)],
        [("a", 0, 1.5), ("c", 0, 0.25)],
    ]
    assert all(any(s is original for original in batch.samples) for shard in shards for s in shard.samples)


def test_one_rank_gets_the_whole_batch_in_its_order() -> None:
    batch = of_lengths([3, 8, 1, 8])

    (only,) = shard_batch(batch, 1)

    assert ids(only) == ["r0", "r1", "r2", "r3"]


def test_fewer_samples_than_ranks_leave_the_last_ranks_an_empty_shard() -> None:
    shards = shard_batch(of_lengths([4, 9]), 4)

    assert [ids(shard) for shard in shards] == [["r1"], ["r0"], [], []]
    assert loads(shards) == [9, 4, 0, 0]
    assert [shard.padded()["input_ids"].shape[0] for shard in shards] == [1, 1, 0, 0]


def test_an_empty_batch_gives_every_rank_an_empty_shard() -> None:
    assert [len(shard) for shard in shard_batch(Batch([], {"groups": 0}), 3)] == [0, 0, 0]


def test_a_world_of_no_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1, not 0"):
        shard_batch(of_lengths([1]), 0)


def test_the_split_depends_only_on_the_samples_so_every_process_computes_the_same() -> None:
    batch = agentic_batch()
    copy = pickle.loads(pickle.dumps(batch))  # as another process would hold it

    first, again, elsewhere = (
        [[(s.rollout_id, s.turn_index) for s in shard.samples] for shard in shard_batch(b, 4)]
        for b in (batch, batch, copy)
    )

    assert first == again == elsewhere


def test_shards_carry_no_counts_of_the_claim() -> None:
    shards = shard_batch(Batch(of_lengths([2, 3]).samples, {"groups": 1, "rollouts": 2}), 2)

    assert [shard.counts for shard in shards] == [{}, {}]


def test_merged_samples_weigh_their_whole_sequence() -> None:
    first = sample("m", 5, completion=2)
    extended = np.concatenate([first.input_ids, np.array([49], dtype=np.int32)])  # + a tool token
    second = dataclasses.replace(first, turn_index=1, parent_turn=0, prompt_ids=extended)
    (merged,) = merge_steps([first, second])

    shards = shard_batch(Batch([merged, sample("x", 4)]), 2)

    assert sample_tokens(merged) == 8
    assert loads(shards) == [8, 4]


# --- balance ------------------------------------------------------------------------------------------------


def test_heaviest_shard_exceeds_the_lightest_by_at_most_the_longest_sample() -> None:
    rng = random.Random(7)
    for _ in range(300):
        lengths = [rng.randint(1, 4000) for _ in range(rng.randint(1, 60))]
        world_size = rng.randint(2, 8)

        spread = loads(shard_batch(of_lengths(lengths), world_size))

        assert max(spread) - min(spread) <= max(lengths)
        assert sum(spread) == sum(lengths)


def test_heaviest_shard_is_within_grahams_bound_of_the_best_split() -> None:
    rng = random.Random(11)
    for _ in range(60):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(2, 8))]
        world_size = rng.randint(2, 3)

        heaviest = max(loads(shard_batch(of_lengths(lengths), world_size)))
        best = min(
            max(
                sum(t for t, r in zip(lengths, ranks, strict=True) if r == rank) for rank in range(world_size)
            )
            for ranks in itertools.product(range(world_size), repeat=len(lengths))
        )

        assert heaviest <= (4 / 3 - 1 / (3 * world_size)) * best


def test_a_realistic_agentic_batch_splits_within_a_tenth_of_a_percent() -> None:
    batch = agentic_batch()

    by_world = {n: loads(shard_batch(batch, n)) for n in (2, 4, 8)}

    assert (len(batch), sum(by_world[2]), max(sample_tokens(s) for s in batch.samples)) == (
        288,
        330_496,
        2_260,
    )
    assert by_world == {
        2: [165_247, 165_249],
        4: [82_629, 82_630, 82_621, 82_616],
        8: [41_327, 41_317, 41_317, 41_294, 41_303, 41_310, 41_310, 41_318],
    }
    assert all(max(spread) * n < 1.001 * sum(spread) for n, spread in by_world.items())


# --- the step's shards --------------------------------------------------------------------------------------


def test_split_claim_gives_every_rank_the_whole_steps_totals() -> None:
    batch = Batch(
        [
            sample("a", 10, completion=4, advantage=1.0),
            sample("b", 7, completion=3, advantage=-1.0),
            sample("c", 5, completion=2, advantage=0.0, masked=True),
        ],
        {"groups": 1, "rollouts": 3, "masked_rollouts": 1, "dropped_groups": 0},
    )

    shards = split_claim(batch, step=4, world_size=2)

    assert [(s.step, s.rank, ids(s.batch)) for s in shards] == [(4, 0, ["a"]), (4, 1, ["b", "c"])]
    assert [(s.samples, s.loss_tokens, s.shard_tokens, s.world_size) for s in shards] == [
        (3, 7, [10, 12], 2),
        (3, 7, [10, 12], 2),
    ]
    assert [s.token_share for s in shards] == [4 / 7, 3 / 7]
    assert all(s.counts == batch.counts and s.metrics == batch.metrics() for s in shards)
    assert [s.kept for s in shards] == [None, None]


def test_a_rank_with_an_empty_shard_has_no_share_of_the_loss() -> None:
    shards = split_claim(of_lengths([6]), step=0, world_size=3)

    assert [(len(s.batch), s.token_share) for s in shards] == [(1, 1.0), (0, 0.0), (0, 0.0)]


def test_a_step_without_loss_tokens_gives_every_rank_a_zero_share() -> None:
    shards = split_claim(Batch([sample("a", 4, masked=True), sample("b", 3, masked=True)]), 0, 2)

    assert [s.token_share for s in shards] == [0.0, 0.0]


def test_shard_losses_weighted_by_token_share_sum_to_the_whole_batchs_loss_and_gradient() -> None:
    batch = agentic_batch()
    batch = Batch([s for s in batch.samples if s.group_id in ("g0", "g1")])  # 78 samples keep it quick
    advantages = {name: (index % 5 - 2) / 2 for index, name in enumerate(batch.rollout_ids)}
    for s in batch.samples:
        s.advantage = advantages[s.rollout_id]
    weights = torch.linspace(-1.0, 1.0, 50, dtype=torch.float64)

    def loss_and_gradient(part: Batch, scale: float) -> tuple[float, torch.Tensor]:
        policy = weights.clone().requires_grad_(True)
        t = part.padded()
        logprobs = torch.log_softmax(policy, 0)[t["input_ids"]]  # a policy that ignores the context
        loss, _ = grpo_loss(logprobs, t["old_logprobs"].double(), t["advantages"].double(), t["loss_mask"])
        (loss * scale).backward()
        assert policy.grad is not None
        return float(loss.detach()) * scale, policy.grad

    whole_loss, whole_gradient = loss_and_gradient(batch, 1.0)
    parts = [loss_and_gradient(s.batch, s.token_share) for s in split_claim(batch, 0, 4) if s.batch.samples]

    assert loss_tokens(batch.samples) == sum(loss_tokens(s.batch.samples) for s in split_claim(batch, 0, 4))
    assert sum(loss for loss, _ in parts) == pytest.approx(whole_loss, rel=1e-12)
    assert torch.allclose(sum(gradient for _, gradient in parts), whole_gradient, rtol=1e-12, atol=1e-15)
    assert float(whole_gradient.abs().sum()) > 0.1
