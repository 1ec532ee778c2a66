"""Teacher scores on samples: aligned in step-wise and merged samples, laid out in padded and packed tensors,
turned into distillation advantages; and how the scorer groups turns into teacher requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer_client.batch import Batch
from trainer_client.loss import distillation_advantages, teacher_kl
from trainer_client.scoring import ScoreReport, _requests, chains
from training_data.samples import merge_steps
from training_data.teacher_scores import TurnToScore

from support.samples import f32, last_step


def scored(sample, teacher: list[float]):
    sample.teacher_logprobs = np.array(teacher, dtype=np.float32)
    return sample


def two_scored_samples() -> Batch:
    return Batch(
        [
            scored(last_step("r1", [1, 2, 3], [10, 11], [-0.5, -0.25], advantage=1.5), [-0.25, -1.0]),
            scored(last_step("r2", [4], [12, 13], [-1.0, -2.0], advantage=-0.5), [-3.0, -0.5]),
        ]
    )


def test_padded_teacher_logprobs_sit_under_the_tokens_they_score():
    tensors = two_scored_samples().padded()

    assert torch.equal(tensors["teacher_logprobs"], f32([[0, 0, 0, -0.25, -1.0], [0, -3.0, -0.5, 0, 0]]))
    assert torch.equal(tensors["old_logprobs"], f32([[0, 0, 0, -0.5, -0.25], [0, -1.0, -2.0, 0, 0]]))


def test_packed_teacher_logprobs_follow_the_packed_ids():
    tensors = two_scored_samples().packed()

    assert torch.equal(tensors["teacher_logprobs"], f32([[0, 0, 0, -0.25, -1.0, 0, -3.0, -0.5]]))


def test_a_batch_read_without_a_teacher_has_no_teacher_tensor_and_no_teacher_kl():
    batch = Batch([last_step("r1", [1], [2], [-0.5])])

    assert "teacher_logprobs" not in batch.padded()
    assert "teacher_logprobs" not in batch.packed()
    assert "teacher_kl" not in batch.metrics()


def test_a_batch_mixing_scored_and_unscored_samples_is_refused():
    batch = Batch([scored(last_step("r1", [1], [2], [-0.5]), [-1.0]), last_step("r2", [1], [2], [-0.5])])

    with pytest.raises(ValueError, match="some samples of the batch have teacher scores and others not"):
        batch.padded()


def test_merged_samples_carry_each_turns_teacher_logprobs_and_zero_between_turns():
    first = scored(last_step("r", [1, 2], [3, 4], [-0.1, -0.2], turn_index=0), [-1.0, -2.0])
    second = scored(last_step("r", [1, 2, 3, 4, 5], [6], [-0.3], turn_index=1, parent_turn=0), [-3.0])

    (merged,) = merge_steps([first, second])

    assert merged.token_teacher_logprobs.tolist() == [0, 0, -1.0, -2.0, 0, -3.0]
    assert merged.to_json()["teacher_logprobs"] == [0, 0, -1.0, -2.0, 0, -3.0]


def test_a_merged_chain_with_an_unscored_turn_has_no_teacher_logprobs():
    first = scored(last_step("r", [1, 2], [3, 4], [-0.1, -0.2], turn_index=0), [-1.0, -2.0])
    second = last_step("r", [1, 2, 3, 4, 5], [6], [-0.3], turn_index=1, parent_turn=0)

    (merged,) = merge_steps([first, second])

    assert merged.token_teacher_logprobs is None
    assert "teacher_logprobs" not in merged.to_json()


def test_the_distillation_advantage_is_the_teacher_less_the_sampled_logprob_on_loss_tokens():
    tensors = two_scored_samples().padded()

    alone = distillation_advantages(tensors)
    mixed = distillation_advantages(tensors, kl_weight=0.5, grpo_weight=2.0)

    assert torch.equal(alone, f32([[0, 0, 0, 0.25, -0.75], [0, -2.0, 1.5, 0, 0]]))
    assert torch.equal(mixed, f32([[0, 0, 0, 3.125, 2.625], [0, -2.0, -0.25, 0, 0]]))


def test_teacher_kl_is_the_mean_gap_over_loss_tokens_in_tensors_and_batch_metrics():
    batch = two_scored_samples()

    # gaps (sampled - teacher): -0.25, 0.75, 2.0, -1.5 over 4 loss tokens
    assert teacher_kl(batch.padded()) == pytest.approx(0.25)
    assert batch.metrics()["teacher_kl"] == pytest.approx(0.25)


def turn(turn_index: int, prompt: list[int], completion: list[int], rollout_id: str = "r") -> TurnToScore:
    return TurnToScore(turn_index + 100, rollout_id, turn_index, np.array(prompt), np.array(completion))


def test_turns_that_extend_one_another_ride_on_the_last_ones_sequence():
    turns = [
        turn(0, [1, 2], [3]),
        turn(1, [1, 2, 3, 9], [4]),  # extends turn 0
        turn(2, [7], [8]),  # a new chain: its prompt is not turn 1's ids
        turn(3, [7, 8, 5], [6]),
    ]

    assert [[t.turn_index for t in chain] for chain in chains(turns)] == [[0, 1], [2, 3]]


def test_a_sub_agents_turns_between_a_chains_turns_do_not_cut_the_chain():
    turns = [
        turn(0, [1, 2], [3]),
        turn(1, [7], [8]),  # a sub-agent's conversation
        turn(2, [7, 8, 5], [6]),
        turn(3, [1, 2, 3, 8], [4]),  # the main conversation resumed with the sub-agent's answer
    ]

    assert [[t.turn_index for t in chain] for chain in chains(turns)] == [[0, 3], [1, 2]]


def test_requests_hold_whole_chains_up_to_the_token_budget_and_skip_what_the_teacher_cannot_read():
    turns = [
        turn(0, [1, 2], [3], "a"),
        turn(1, [1, 2, 3], [4], "a"),  # a's chain: 4 tokens
        turn(0, [5, 6, 7], [8, 9], "b"),  # 5 tokens
        turn(0, list(range(20)), [1], "c"),  # 21 tokens: past a 16-token context
        turn(0, [1], [2], "d"),  # 2 tokens
    ]
    report = ScoreReport()

    requests = list(_requests(turns, max_model_len=16, batch_tokens=8, report=report))

    assert [[s.tolist() for s in r.sequences] for r in requests] == [
        [[1, 2, 3, 4]],
        [[5, 6, 7, 8, 9], [1, 2]],
    ]
    assert [[[t.rollout_id for t in chain] for chain in r.turns] for r in requests] == [
        [["a", "a"]],
        [["b"], ["d"]],
    ]
    assert report.too_long == [("c", 0)]
