"""StepSample masks and alignment, exact-chain detection, and merge_steps into MergedSample trajectories."""

from __future__ import annotations

import numpy as np

from training_data.samples import MergedSample, merge_steps

from support.samples import chain, step, sub_agents_and_compaction

# --- StepSample ---------------------------------------------------------------------------------------------


def test_step_input_ids_are_prompt_then_completion() -> None:
    sample = step(0, [1, 2, 3], [10, 11], [-0.5, -0.25])
    assert sample.input_ids.tolist() == [1, 2, 3, 10, 11]


def test_step_loss_mask_is_zero_on_prompt_and_one_on_completion() -> None:
    sample = step(0, [1, 2, 3], [10, 11], [-0.5, -0.25])
    assert sample.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert sample.loss_mask.dtype == np.int8


def test_masked_step_has_an_all_zero_loss_mask() -> None:
    sample = step(0, [1, 2, 3], [10, 11], [-0.5, -0.25], masked=True)
    assert sample.loss_mask.tolist() == [0, 0, 0, 0, 0]


def test_step_token_logprobs_are_zero_on_prompt_and_aligned_with_completion_tokens() -> None:
    sample = step(0, [1, 2, 3], [10, 11], [-0.5, -0.25])
    assert sample.token_logprobs.tolist() == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert sample.token_logprobs.dtype == np.float32


def test_masked_step_keeps_its_sampling_logprobs() -> None:
    sample = step(0, [1], [10, 11], [-0.5, -0.25], masked=True)
    assert sample.token_logprobs.tolist() == [0.0, -0.5, -0.25]


def test_step_with_empty_prompt_trains_on_every_token() -> None:
    sample = step(0, [], [10, 11], [-0.5, -0.25])
    assert (sample.input_ids.tolist(), sample.loss_mask.tolist()) == ([10, 11], [1, 1])


def test_step_to_json_is_plain_lists_with_completion_only_logprobs() -> None:
    sample = step(0, [1, 2], [10], [-0.5], is_last_step=True)
    assert sample.to_json() == {
        "rollout_id": "r",
        "group_id": "g",
        "step": 0,
        "turn_index": 0,
        "is_last_step": True,
        "prompt_ids": [1, 2],
        "completion_ids": [10],
        "loss_mask": [0, 0, 1],
        "logprobs": [-0.5],
        "reward": 1.0,
        "reward_components": None,
        "advantage": 0.5,
        "policy_version": "0",
        "finish_reason": "stop",
        "masked": False,
    }


# --- extends ------------------------------------------------------------------------------------------------


def test_step_extends_previous_when_prompt_starts_with_its_prompt_and_completion() -> None:
    first, second, third = chain()
    assert second.extends(first)
    assert third.extends(second)


def test_step_extends_previous_with_no_environment_tokens_in_between() -> None:
    first = step(0, [1, 2], [10], [-0.5])
    second = step(1, [1, 2, 10], [11], [-0.25], parent_turn=0)
    assert second.extends(first)


def test_step_does_not_extend_previous_when_its_parent_is_another_turn() -> None:
    first, second, _ = chain()
    second.parent_turn = 5
    assert not second.extends(first)


def test_step_without_a_parent_turn_never_extends() -> None:
    first, second, _ = chain()
    second.parent_turn = None
    assert not second.extends(first)


def test_step_does_not_extend_previous_when_its_prompt_is_shorter_than_prompt_plus_completion() -> None:
    first = step(0, [1, 2], [10, 11], [-0.5, -0.25])
    second = step(1, [1, 2, 10], [12], [-1.0], parent_turn=0)
    assert not second.extends(first)


def test_step_does_not_extend_previous_when_the_completion_was_retokenized() -> None:
    first = step(0, [1, 2], [10, 11], [-0.5, -0.25])
    second = step(1, [1, 2, 10, 99, 20], [12], [-1.0], parent_turn=0)
    assert not second.extends(first)


def test_step_does_not_extend_previous_when_the_earlier_prompt_changed() -> None:
    first = step(0, [1, 2], [10], [-0.5])
    second = step(1, [1, 7, 10, 20], [12], [-1.0], parent_turn=0)
    assert not second.extends(first)


# --- merge_steps --------------------------------------------------------------------------------------------


def test_merge_steps_of_nothing_is_nothing() -> None:
    assert merge_steps([]) == []


def test_exact_chain_merges_into_one_sample_with_environment_tokens_out_of_the_loss() -> None:
    merged = merge_steps(chain())
    assert len(merged) == 1
    sample = merged[0]
    assert isinstance(sample, MergedSample)
    assert sample.turn_indices == [0, 1, 2]
    assert sample.input_ids.tolist() == [1, 2, 3, 10, 11, 20, 21, 12, 30, 13, 14]
    assert sample.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert sample.token_logprobs.tolist() == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0, 0.0, -2.0, -0.125]
    assert (sample.loss_mask.dtype, sample.token_logprobs.dtype) == (np.int8, np.float32)
    assert sample.masked is False


def test_merged_sample_takes_rollout_fields_and_last_step_fields_from_the_last_step() -> None:
    sample = merge_steps(chain())[0]
    assert (sample.rollout_id, sample.group_id) == ("r", "g")
    assert (sample.reward, sample.advantage, sample.reward_components) == (1.0, 0.5, None)
    assert (sample.is_last_step, sample.policy_version, sample.finish_reason) == (True, "1", "stop")


def test_single_step_merges_into_a_sample_identical_to_the_step() -> None:
    only = step(0, [1, 2], [10, 11], [-0.5, -0.25], is_last_step=True)
    [sample] = merge_steps([only])
    assert sample.turn_indices == [0]
    assert sample.input_ids.tolist() == only.input_ids.tolist()
    assert sample.loss_mask.tolist() == only.loss_mask.tolist()
    assert sample.token_logprobs.tolist() == only.token_logprobs.tolist()


def test_turn_that_does_not_chain_starts_a_new_sample_and_later_turns_chain_onto_it() -> None:
    steps = [
        step(0, [1, 2], [10], [-0.5]),
        step(1, [1, 2, 10, 20], [11], [-0.25], parent_turn=0),
        step(2, [5, 6], [12], [-1.0], parent_turn=1),  # e.g. the history was rewritten: no exact prefix
        step(3, [5, 6, 12, 30], [13], [-2.0], parent_turn=2, is_last_step=True),
    ]
    first, second = merge_steps(steps)
    assert (first.turn_indices, second.turn_indices) == ([0, 1], [2, 3])
    assert first.input_ids.tolist() == [1, 2, 10, 20, 11]
    assert first.loss_mask.tolist() == [0, 0, 1, 0, 1]
    assert first.token_logprobs.tolist() == [0.0, 0.0, -0.5, 0.0, -0.25]
    assert second.input_ids.tolist() == [5, 6, 12, 30, 13]
    assert second.loss_mask.tolist() == [0, 0, 1, 0, 1]
    assert second.token_logprobs.tolist() == [0.0, 0.0, -1.0, 0.0, -2.0]
    assert (first.is_last_step, second.is_last_step) == (False, True)


def test_fork_from_an_earlier_turn_starts_a_new_sample_even_when_its_tokens_extend_that_turn() -> None:
    steps = [
        step(0, [1, 2], [10], [-0.5]),
        step(1, [1, 2, 10, 20], [11], [-0.25], parent_turn=0),
        step(2, [1, 2, 10, 20], [12], [-1.0], parent_turn=0),  # a second branch off turn 0
    ]
    first, second = merge_steps(steps)
    assert (first.turn_indices, second.turn_indices) == ([0, 1], [2])
    assert second.input_ids.tolist() == [1, 2, 10, 20, 12]
    assert second.loss_mask.tolist() == [0, 0, 0, 0, 1]  # turn 0's completion is trained once, in `first`
    assert second.token_logprobs.tolist() == [0.0, 0.0, 0.0, 0.0, -1.0]


def test_a_choice_rewarded_on_its_own_is_a_sample_of_its_own_whatever_it_extends() -> None:
    steps = [
        step(0, [1, 2], [10], [-0.5]),
        step(1, [1, 2, 10, 20], [11], [-0.25], parent_turn=0, reward=1.0, advantage=0.9, choice_reward=True),
        step(2, [1, 2, 10, 20], [12], [-1.0], parent_turn=0, reward=0.0, advantage=-0.9, choice_reward=True),
        step(3, [1, 2, 10, 20, 12, 30], [13], [-2.0], parent_turn=2),  # the agent went on with choice 1
    ]
    merged = merge_steps(steps)
    assert [m.turn_indices for m in merged] == [[0], [1], [2], [3]]
    assert [(m.reward, m.advantage, m.choice_reward) for m in merged] == [
        (1.0, 0.5, False),
        (1.0, 0.9, True),
        (0.0, -0.9, True),
        (1.0, 0.5, False),
    ]
    assert [m.loss_mask.tolist() for m in merged] == [
        [0, 0, 1],
        [0, 0, 0, 0, 1],
        [0, 0, 0, 0, 1],
        [0] * 6 + [1],
    ]


def test_masked_turn_inside_a_chain_carries_no_loss_but_keeps_its_logprobs() -> None:
    steps = chain()
    steps[1].masked = True
    [sample] = merge_steps(steps)
    assert sample.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    assert sample.token_logprobs.tolist() == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0, 0.0, -2.0, -0.125]
    assert sample.masked is False


def test_chain_of_only_masked_turns_is_a_masked_sample_with_no_loss() -> None:
    steps = chain()
    for s in steps:
        s.masked = True
    [sample] = merge_steps(steps)
    assert sample.masked is True
    assert sample.loss_mask.tolist() == [0] * 11


def test_merge_steps_does_not_modify_the_steps() -> None:
    steps = chain()
    merge_steps(steps)
    assert [s.input_ids.tolist() for s in steps] == [s.input_ids.tolist() for s in chain()]
    assert [s.loss_mask.tolist() for s in steps] == [[0, 0, 0, 1, 1], [0] * 7 + [1], [0] * 9 + [1, 1]]


def test_merged_to_json_has_whole_sequence_logprobs_and_turn_indices() -> None:
    steps = chain()[:2]
    [sample] = merge_steps(steps)
    assert sample.to_json() == {
        "rollout_id": "r",
        "group_id": "g",
        "turn_indices": [0, 1],
        "is_last_step": False,
        "input_ids": [1, 2, 3, 10, 11, 20, 21, 12],
        "loss_mask": [0, 0, 0, 1, 1, 0, 0, 1],
        "logprobs": [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0],
        "reward": 1.0,
        "reward_components": None,
        "advantage": 0.5,
        "policy_version": "0",
        "finish_reason": "tool_calls",
        "masked": False,
    }


# --- merge_steps on a rollout's tree ------------------------------------------------------------------------


def test_a_chain_keeps_its_turns_whatever_other_chains_turns_came_between_them() -> None:
    merged = merge_steps(sub_agents_and_compaction())
    assert [m.turn_indices for m in merged] == [[0, 3, 4], [1, 2], [5, 6]]
    main = merged[0]
    assert main.input_ids.tolist() == [1, 2, 10, 42, 11, 50, 12]
    assert main.loss_mask.tolist() == [0, 0, 1, 0, 1, 0, 1]
    assert main.token_logprobs.tolist() == [0.0, 0.0, -0.5, 0.0, -0.25, 0.0, -1.0]
    assert merged[1].loss_mask.tolist() == [0, 0, 1, 0, 1]
    assert [m.is_last_step for m in merged] == [False, False, True]


def test_merging_by_lineage_trains_every_sampled_token_exactly_once() -> None:
    steps = sub_agents_and_compaction()
    merged = merge_steps(steps)
    assert sum(int(m.loss_mask.sum()) for m in merged) == sum(s.completion_ids.shape[0] for s in steps)
    trained = sorted(
        float(lp) for m in merged for lp, on in zip(m.token_logprobs, m.loss_mask, strict=True) if on
    )
    assert trained == sorted(float(lp) for s in steps for lp in s.logprobs)


def test_every_chain_of_a_rollout_carries_the_rollouts_reward_and_advantage() -> None:
    merged = merge_steps(sub_agents_and_compaction())
    assert {(m.reward, m.advantage) for m in merged} == {(1.0, 0.5)}


def test_two_sub_agents_running_at_once_are_two_chains_and_the_main_one_is_one() -> None:
    steps = [
        step(0, [1], [10], [-0.5]),
        step(1, [7], [40], [-0.1]),  # sub-agent A
        step(2, [8], [50], [-0.2]),  # sub-agent B
        step(3, [8, 50, 51], [52], [-0.3], parent_turn=2),
        step(4, [7, 40, 41], [42], [-0.4], parent_turn=1),
        step(5, [1, 10, 42, 52], [11], [-0.6], parent_turn=0, is_last_step=True),
    ]
    assert [m.turn_indices for m in merge_steps(steps)] == [[0, 5], [1, 4], [2, 3]]


def test_the_second_turn_to_extend_a_turn_that_was_already_extended_starts_a_chain_of_its_own() -> None:
    steps = [
        step(0, [1, 2], [10], [-0.5]),
        step(1, [1, 2, 10, 20], [11], [-0.25], parent_turn=0),
        step(2, [1, 2, 10, 30], [12], [-1.0], parent_turn=0),
        step(3, [1, 2, 10, 30, 12, 31], [13], [-2.0], parent_turn=2),
        step(4, [1, 2, 10, 20, 11, 21], [14], [-3.0], parent_turn=1),
    ]
    merged = merge_steps(steps)
    assert [m.turn_indices for m in merged] == [[0, 1, 4], [2, 3]]
    assert merged[1].loss_mask.tolist() == [0, 0, 0, 0, 1, 0, 1]


def test_an_attempt_a_client_retried_stands_alone_and_the_retry_continues_the_chain() -> None:
    steps = [
        step(0, [1, 2], [10], [-0.5]),
        step(1, [1, 2, 10, 20], [11], [-0.25], parent_turn=0, masked=True),
        step(2, [1, 2, 10, 20], [12], [-1.0], parent_turn=0),
        step(3, [1, 2, 10, 20, 12, 30], [13], [-2.0], parent_turn=2, is_last_step=True),
    ]
    steps[1].retried = True
    merged = merge_steps(steps)
    assert [m.turn_indices for m in merged] == [[0, 2, 3], [1]]
    assert merged[0].input_ids.tolist() == [1, 2, 10, 20, 12, 30, 13]
    assert merged[0].loss_mask.tolist() == [0, 0, 1, 0, 1, 0, 1]
    assert (merged[1].masked, merged[1].loss_mask.tolist()) == (True, [0, 0, 0, 0, 0])
