"""What TRL's asynchronous trainer gets of a rollout whose lineage is a tree: every chain as a `RolloutSample`
of the rollout's group, with the rollout's advantage; no chain is dropped."""

from __future__ import annotations

from trainer_client.trl import GatewayRolloutWorker
from training_data.samples import merge_steps

from support.samples import sub_agents_and_compaction


def test_every_chain_of_a_rollout_is_a_rollout_sample_of_its_group_with_the_rollouts_advantage():
    worker = GatewayRolloutWorker("sqlite:///unused.db")

    samples = [worker._rollout_sample(chain) for chain in merge_steps(sub_agents_and_compaction())]

    assert [(s.group_id, s.advantage, s.metrics["reward"]) for s in samples] == [(0, 0.5, 1.0)] * 3
    assert [s.input_ids.tolist() for s in samples] == [
        [1, 2, 10, 42, 11, 50, 12],
        [7, 8, 40, 41, 42],
        [9, 12, 13, 60, 14],
    ]
    assert [s.completion_mask.tolist() for s in samples] == [
        [0, 0, 1, 0, 1, 0, 1],
        [0, 0, 1, 0, 1],
        [0, 0, 1, 0, 1],
    ]
    assert sum(int(s.completion_mask.sum()) for s in samples) == 7  # every sampled token, once
