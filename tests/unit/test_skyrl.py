"""SkyRL's `GeneratorOutput` from the store's samples: a merged trajectory is one row, its prompt the first
turn's, its response every later id with only the sampled tokens in the loss; step-wise rows say which
turn ends the trajectory."""

from __future__ import annotations

from trainer_client.skyrl import generator_output
from training_data.samples import merge_steps

from support.samples import chain, step, sub_agents_and_compaction, versioned


def test_a_merged_trajectory_is_one_row_with_the_environments_tokens_out_of_the_loss():
    (merged,) = merge_steps(chain())
    single = step(0, [7, 8], [9], [-0.75], reward=0.0, finish_reason=None)

    output = generator_output([merged, single])

    assert output == {
        "prompt_token_ids": [[1, 2, 3], [7, 8]],
        "response_ids": [[10, 11, 20, 21, 12, 30, 13, 14], [9]],
        "rewards": [1.0, 0.0],
        "loss_masks": [[1, 1, 0, 0, 1, 0, 1, 1], [1]],
        "rollout_logprobs": [[-0.5, -0.25, 0.0, 0.0, -1.0, 0.0, -2.0, -0.125], [-0.75]],
        "stop_reasons": ["stop", "abort"],
        "rollout_metrics": None,
    }


def test_step_wise_rows_mark_the_last_step_of_each_trajectory():
    output = generator_output(chain(), step_wise=True)

    assert output["is_last_step"] == [False, False, True]
    assert output["prompt_token_ids"][1] == [1, 2, 3, 10, 11, 20, 21]
    assert output["response_ids"][1] == [12]
    assert output["loss_masks"] == [[1, 1], [1], [1, 1]]


def test_a_tree_shaped_rollouts_chains_are_step_wise_rows_the_last_of_which_ends_the_trajectory():
    """SkyRL's step-wise training computes a trajectory's advantage at its last step and gives it to each of
    its rows: every chain of the rollout trains with the rollout's advantage."""
    chains = merge_steps(sub_agents_and_compaction())

    output = generator_output(chains, step_wise=True)

    assert output["is_last_step"] == [False, False, True]
    assert output["prompt_token_ids"] == [[1, 2], [7, 8], [9, 12]]
    assert output["loss_masks"] == [[1, 0, 1, 0, 1], [1, 0, 1], [1, 0, 1]]
    assert output["rewards"] == [1.0, 1.0, 1.0]


def test_each_response_tokens_version_and_staleness_ride_along_with_the_environments_tokens_at_minus_one():
    (merged,) = merge_steps(versioned(chain(), current=2))

    output = generator_output([merged])

    assert output["token_versions"] == [[0, 0, -1, -1, 0, -1, 1, 1]]
    assert output["token_staleness"] == [[2, 2, -1, -1, 2, -1, 1, 1]]
