"""Batch.padded and Batch.packed tensor layouts, exact for small batches, and Batch.metrics."""

from __future__ import annotations

import math

import numpy as np
import torch

from trainer_client.batch import Batch
from training_data.groups import RolloutInfo, Selection
from training_data.samples import merge_steps

from support.samples import f32, last_step


def two_samples() -> Batch:
    """A 5-token sample (3 prompt + 2 completion) and a 3-token one (1 prompt + 2 completion)."""
    return Batch(
        [
            last_step("r1", [1, 2, 3], [10, 11], [-0.5, -0.25], advantage=1.5, reward=1.0),
            last_step("r2", [4], [12, 13], [-1.0, -2.0], advantage=-0.5, reward=0.0),
        ]
    )


def i64(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


# --- padded -------------------------------------------------------------------------------------------------


def test_padded_gives_exactly_these_five_tensors() -> None:
    names = ["advantages", "attention_mask", "input_ids", "loss_mask", "old_logprobs"]
    assert sorted(two_samples().padded()) == names


def test_padded_shapes_are_batch_by_longest_sample() -> None:
    tensors = two_samples().padded()
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {
        "input_ids": (2, 5),
        "attention_mask": (2, 5),
        "loss_mask": (2, 5),
        "old_logprobs": (2, 5),
        "advantages": (2, 5),
    }


def test_padded_dtypes_are_int64_ids_and_attention_and_float32_the_rest() -> None:
    tensors = two_samples().padded()
    assert {name: t.dtype for name, t in tensors.items()} == {
        "input_ids": torch.int64,
        "attention_mask": torch.int64,
        "loss_mask": torch.float32,
        "old_logprobs": torch.float32,
        "advantages": torch.float32,
    }


def test_padded_input_ids_are_right_padded_with_pad_id() -> None:
    expected = i64([[1, 2, 3, 10, 11], [4, 12, 13, 7, 7]])
    assert torch.equal(two_samples().padded(pad_id=7)["input_ids"], expected)


def test_padded_default_pad_id_is_zero() -> None:
    assert torch.equal(two_samples().padded()["input_ids"], i64([[1, 2, 3, 10, 11], [4, 12, 13, 0, 0]]))


def test_padded_attention_mask_covers_real_tokens_only() -> None:
    assert torch.equal(two_samples().padded()["attention_mask"], i64([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))


def test_padded_loss_mask_covers_completion_tokens_only() -> None:
    assert torch.equal(two_samples().padded()["loss_mask"], f32([[0, 0, 0, 1, 1], [0, 1, 1, 0, 0]]))


def test_padded_old_logprobs_sit_on_their_completion_tokens_and_are_zero_elsewhere() -> None:
    expected = f32([[0, 0, 0, -0.5, -0.25], [0, -1.0, -2.0, 0, 0]])
    assert torch.equal(two_samples().padded()["old_logprobs"], expected)


def test_padded_advantages_are_broadcast_to_loss_tokens_only() -> None:
    expected = f32([[0, 0, 0, 1.5, 1.5], [0, -0.5, -0.5, 0, 0]])
    assert torch.equal(two_samples().padded()["advantages"], expected)


def test_padded_pad_id_does_not_change_other_tensors() -> None:
    default, custom = two_samples().padded(), two_samples().padded(pad_id=-100)
    for name in ("attention_mask", "loss_mask", "old_logprobs", "advantages"):
        assert torch.equal(default[name], custom[name])


def test_padded_masked_sample_has_no_loss_and_no_advantage_but_keeps_old_logprobs() -> None:
    batch = Batch([last_step("r", [1], [10, 11], [-0.5, -0.25], advantage=2.0, masked=True)])
    tensors = batch.padded()
    assert torch.equal(tensors["loss_mask"], f32([[0, 0, 0]]))
    assert torch.equal(tensors["advantages"], f32([[0, 0, 0]]))
    assert torch.equal(tensors["old_logprobs"], f32([[0, -0.5, -0.25]]))
    assert torch.equal(tensors["attention_mask"], i64([[1, 1, 1]]))


def test_padded_merged_sample_masks_environment_tokens_between_completions() -> None:
    steps = [
        last_step("r", [1, 2], [10], [-0.5], advantage=0.25),
        last_step("r", [1, 2, 10, 20], [11, 12], [-0.25, -1.0], advantage=0.25, turn_index=1, parent_turn=0),
    ]
    tensors = Batch(list(merge_steps(steps))).padded()
    assert torch.equal(tensors["input_ids"], i64([[1, 2, 10, 20, 11, 12]]))
    assert torch.equal(tensors["loss_mask"], f32([[0, 0, 1, 0, 1, 1]]))
    assert torch.equal(tensors["old_logprobs"], f32([[0, 0, -0.5, 0, -0.25, -1.0]]))
    assert torch.equal(tensors["advantages"], f32([[0, 0, 0.25, 0, 0.25, 0.25]]))


def test_padded_empty_batch_is_zero_by_zero() -> None:
    tensors = Batch([]).padded()
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {
        "input_ids": (0, 0),
        "attention_mask": (0, 0),
        "loss_mask": (0, 0),
        "old_logprobs": (0, 0),
        "advantages": (0, 0),
    }


# --- packed -------------------------------------------------------------------------------------------------


def test_packed_gives_one_row_with_cu_seqlens_and_position_ids() -> None:
    tensors = two_samples().packed()
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {
        "input_ids": (1, 8),
        "position_ids": (1, 8),
        "cu_seqlens": (3,),
        "loss_mask": (1, 8),
        "old_logprobs": (1, 8),
        "advantages": (1, 8),
    }


def test_packed_dtypes_are_int64_ids_and_positions_int32_cu_seqlens_and_float32_the_rest() -> None:
    tensors = two_samples().packed()
    assert {name: t.dtype for name, t in tensors.items()} == {
        "input_ids": torch.int64,
        "position_ids": torch.int64,
        "cu_seqlens": torch.int32,
        "loss_mask": torch.float32,
        "old_logprobs": torch.float32,
        "advantages": torch.float32,
    }


def test_packed_input_ids_concatenate_samples_without_padding() -> None:
    assert torch.equal(two_samples().packed()["input_ids"], i64([[1, 2, 3, 10, 11, 4, 12, 13]]))


def test_packed_cu_seqlens_mark_where_each_sample_starts_and_the_total() -> None:
    assert torch.equal(two_samples().packed()["cu_seqlens"], torch.tensor([0, 5, 8], dtype=torch.int32))


def test_packed_position_ids_restart_at_zero_for_each_sample() -> None:
    assert torch.equal(two_samples().packed()["position_ids"], i64([[0, 1, 2, 3, 4, 0, 1, 2]]))


def test_packed_loss_mask_logprobs_and_advantages_follow_each_sample() -> None:
    tensors = two_samples().packed()
    assert torch.equal(tensors["loss_mask"], f32([[0, 0, 0, 1, 1, 0, 1, 1]]))
    assert torch.equal(tensors["old_logprobs"], f32([[0, 0, 0, -0.5, -0.25, 0, -1.0, -2.0]]))
    assert torch.equal(tensors["advantages"], f32([[0, 0, 0, 1.5, 1.5, 0, -0.5, -0.5]]))


def test_packed_row_is_the_padded_rows_without_their_padding() -> None:
    batch = two_samples()
    padded, packed = batch.padded(), batch.packed()
    keep = padded["attention_mask"].bool()
    for name in ("input_ids", "loss_mask", "old_logprobs", "advantages"):
        assert torch.equal(padded[name][keep].unsqueeze(0), packed[name])


def test_packed_and_padded_round_advantages_to_the_same_float32() -> None:
    batch = Batch([last_step("r", [1], [10, 11], [-0.5, -0.25], advantage=1 / 3)])
    third = float(np.float32(1 / 3))
    assert torch.equal(batch.padded()["advantages"], f32([[0, third, third]]))
    assert torch.equal(batch.packed()["advantages"], f32([[0, third, third]]))


def test_packed_single_sample_has_cu_seqlens_zero_and_length() -> None:
    tensors = Batch([last_step("r", [1, 2], [3], [-0.5])]).packed()
    assert torch.equal(tensors["cu_seqlens"], torch.tensor([0, 3], dtype=torch.int32))
    assert torch.equal(tensors["position_ids"], i64([[0, 1, 2]]))


def test_packed_empty_batch_is_one_empty_row_and_cu_seqlens_zero() -> None:
    tensors = Batch([]).packed()
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {
        "input_ids": (1, 0),
        "position_ids": (1, 0),
        "cu_seqlens": (1,),
        "loss_mask": (1, 0),
        "old_logprobs": (1, 0),
        "advantages": (1, 0),
    }
    assert tensors["cu_seqlens"].tolist() == [0]
    assert tensors["cu_seqlens"].dtype == torch.int32


# --- Batch bookkeeping and metrics --------------------------------------------------------------------------


def test_batch_len_counts_samples_and_rollout_ids_are_unique_in_first_seen_order() -> None:
    batch = Batch(
        [
            last_step("b", [1], [2], [-0.5]),
            last_step("a", [1], [2], [-0.5]),
            last_step("b", [1, 2, 5], [3], [-0.5], turn_index=1, parent_turn=0),
        ]
    )
    assert len(batch) == 3
    assert batch.rollout_ids == ["b", "a"]


def test_metrics_count_each_rollout_once_for_rewards_and_every_sample_for_tokens() -> None:
    batch = Batch(
        [
            last_step("r1", [1, 2, 3], [10, 11], [-0.5, -0.25], reward=1.0),
            last_step("r1", [1, 2, 3, 10, 11, 20], [12], [-1.0], reward=1.0, turn_index=1, parent_turn=0),
            last_step("r2", [4], [12, 13], [-1.0, -2.0], reward=0.0),
        ],
        counts={"groups": 1, "skipped_stale": 2},
    )
    assert batch.metrics() == {
        "rollouts": 2.0,
        "reward_mean": 0.5,
        "reward_std": 0.5,
        "samples": 3.0,
        "samples_per_rollout": 1.5,
        "tokens": 15.0,
        "loss_tokens": 5.0,
        "groups": 1.0,
        "skipped_stale": 2.0,
    }


def test_metrics_count_each_choice_rewarded_on_its_own_as_a_trajectory() -> None:
    batch = Batch(
        [
            last_step("r1", [1], [10], [-0.5], reward=1.0, turn_index=0, choice_reward=True),
            last_step("r1", [1], [11], [-0.5], reward=0.0, turn_index=1, choice_reward=True),
            last_step("r1", [1, 11, 5], [12], [-0.5], reward=0.5, turn_index=2, parent_turn=1),
            last_step("r2", [1], [13], [-0.5], reward=0.5),
        ]
    )
    metrics = batch.metrics()
    assert (metrics["rollouts"], metrics["reward_mean"], metrics["reward_std"]) == (
        2.0,
        0.5,
        math.sqrt(0.125),
    )


def test_metrics_loss_tokens_leave_out_masked_samples() -> None:
    batch = Batch(
        [last_step("r1", [1], [10, 11], [-0.5, -0.25]), last_step("r2", [1], [12], [-0.5], masked=True)]
    )
    assert (batch.metrics()["tokens"], batch.metrics()["loss_tokens"]) == (5.0, 2.0)


def test_metrics_of_an_empty_batch_are_zero() -> None:
    assert Batch([]).metrics() == {
        "rollouts": 0.0,
        "reward_mean": 0.0,
        "reward_std": 0.0,
        "samples": 0.0,
        "samples_per_rollout": 0.0,
        "tokens": 0.0,
        "loss_tokens": 0.0,
    }


def test_metrics_count_the_rollouts_with_samples_and_the_served_ones_apart() -> None:
    # Two rollouts served, one of them without a sample (its only call sampled nothing).
    served = [RolloutInfo("r1", "g", "completed", 1.0, None), RolloutInfo("r2", "g", "completed", 0.0, None)]
    selection = Selection(served={"g": served})
    batch = Batch([last_step("r1", [1], [2], [-0.5])], counts=selection.counts())
    metrics = batch.metrics()
    assert (metrics["rollouts"], metrics["served_rollouts"]) == (1.0, 2.0)
    assert metrics["samples_per_rollout"] == 1.0
    assert batch.counts["served_rollouts"] == 2
