"""The batch verl's agent loop hands its trainer, built from the store's samples: prompts left-padded,
responses right-padded with the environment's tokens masked, positions counted over real tokens only, the
reward on each response's last token, and the GRPO group as `uid`."""

from __future__ import annotations

import numpy as np
import pytest

from trainer_client.verl import layout
from training_data.samples import merge_steps

from support.samples import chain, step, sub_agents_and_compaction, versioned


def batch() -> tuple[dict[str, list[list[float]]], dict[str, list[object]]]:
    """A merged three-turn sample (prompt 1 2 3; environment tokens 20 21 and 30) and a one-turn sample."""
    (merged,) = merge_steps(chain())
    single = step(0, [7, 8], [9], [-0.75], reward=0.0)
    tensors, rows = layout([merged, single], pad_id=-1)
    return {k: v.tolist() for k, v in tensors.items()}, {k: list(v) for k, v in rows.items()}


def test_prompts_are_left_padded_and_responses_right_padded_with_the_environments_tokens_masked():
    tensors, _ = batch()

    assert tensors["prompts"] == [[1, 2, 3], [-1, 7, 8]]
    assert tensors["responses"] == [[10, 11, 20, 21, 12, 30, 13, 14], [9, -1, -1, -1, -1, -1, -1, -1]]
    assert tensors["response_mask"] == [[1, 1, 0, 0, 1, 0, 1, 1], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert tensors["input_ids"] == [
        a + b for a, b in zip(tensors["prompts"], tensors["responses"], strict=True)
    ]
    assert tensors["attention_mask"] == [[1] * 11, [0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]]


def test_positions_count_real_tokens_and_logprobs_and_rewards_sit_on_the_response():
    tensors, _ = batch()

    assert tensors["position_ids"] == [list(range(11)), [0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2]]
    assert tensors["rollout_log_probs"] == [
        [-0.5, -0.25, 0.0, 0.0, -1.0, 0.0, -2.0, -0.125],
        [-0.75, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    assert tensors["rm_scores"] == [[0.0] * 7 + [1.0], [0.0] * 8]


def test_each_row_carries_its_group_as_uid_its_rollout_and_its_turns():
    _, rows = batch()

    assert rows == {
        "uid": ["g", "g"],
        "rollout_id": ["r", "r"],
        "__num_turns__": [6, 2],
        "multi_modal_inputs": [{}, {}],
    }


def test_widths_given_pad_further_and_a_sample_longer_than_them_is_refused():
    (merged,) = merge_steps(chain())

    tensors, _ = layout([merged], prompt_length=4, response_length=10)
    with pytest.raises(ValueError) as refused:
        layout([merged], response_length=6)

    assert (tensors["prompts"].tolist(), tensors["responses"].shape) == ([[0, 1, 2, 3]], (1, 10))
    assert np.array_equal(tensors["position_ids"][0, :4], [0, 0, 1, 2])
    assert str(refused.value) == "a sample's response has 8 ids, more than response_length=6"


def test_each_chain_of_a_tree_shaped_rollout_is_a_row_of_its_group_with_the_rollouts_reward():
    chains = merge_steps(sub_agents_and_compaction())

    tensors, rows = layout(chains, pad_id=-1)

    assert rows["uid"].tolist() == ["g", "g", "g"]
    assert rows["rollout_id"].tolist() == ["r", "r", "r"]
    assert tensors["prompts"].tolist() == [[1, 2], [7, 8], [9, 12]]
    assert tensors["response_mask"].tolist() == [[1, 0, 1, 0, 1], [1, 0, 1, 0, 0], [1, 0, 1, 0, 0]]
    assert tensors["rm_scores"].tolist() == [[0, 0, 0, 0, 1.0], [0, 0, 1.0, 0, 0], [0, 0, 1.0, 0, 0]]


def test_each_response_tokens_version_and_staleness_are_tensors_padded_with_minus_one():
    (merged,) = merge_steps(versioned(chain(), current=2))
    (single,) = versioned([step(0, [7, 8], [9], [-0.75], policy_version="2")], current=2)

    tensors, _ = layout([merged, single])

    assert tensors["token_versions"].tolist() == [
        [0, 0, -1, -1, 0, -1, 1, 1],
        [2, -1, -1, -1, -1, -1, -1, -1],
    ]
    assert tensors["token_staleness"].tolist() == [
        [2, 2, -1, -1, 2, -1, 1, 1],
        [0, -1, -1, -1, -1, -1, -1, -1],
    ]


def test_samples_read_without_versions_add_no_version_tensors():
    tensors, _ = batch()

    assert "token_versions" not in tensors and "token_staleness" not in tensors
