"""SkyRL's `GeneratorOutput` from the store, for a `GeneratorInterface` whose agents played through the
gateway: the ids vLLM saw and sampled, never a re-tokenization.

SkyRL's trainer takes one row per trajectory (merged samples), or with `step_wise` one per turn, marked
`is_last_step`; each row is `prompt_token_ids` (the first turn's prompt), `response_ids` (every later id: the
sampled tokens and the environment's tokens between turns), `loss_masks` (1 on sampled tokens), the
sampling `rollout_logprobs` and the reward, and `token_versions` (with a current version, `token_staleness`
too: each response token's version index and updates behind it, -1 on the environment's tokens). A rollout
whose lineage is a tree (sub-agents, a compaction) has several merged chains: give them with `step_wise`,
one row each, `is_last_step` on the chain that holds the rollout's last turn; SkyRL's step-wise training
gives every row of a trajectory the advantage computed at its last step, so each chain trains with the
rollout's advantage. Its types need SkyRL itself (Python 3.12 and later): this is the plain dictionary it
checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from training_data.samples import MergedSample, StepSample, response_versions, split

Sample = StepSample | MergedSample


def generator_output(samples: Sequence[Sample], *, step_wise: bool = False) -> dict[str, Any]:
    """The rows of `samples` (in their order, which must be the generator input's) as a `GeneratorOutput`."""
    parts = [split(sample) for sample in samples]
    output: dict[str, Any] = {
        "prompt_token_ids": [part.prompt_ids.tolist() for part in parts],
        "response_ids": [part.response_ids.tolist() for part in parts],
        "rewards": [s.reward for s in samples],
        "loss_masks": [part.response_mask.tolist() for part in parts],
        "rollout_logprobs": [part.response_logprobs.tolist() for part in parts],
        "stop_reasons": [s.finish_reason or "abort" for s in samples],  # none: the call did not end
        "rollout_metrics": None,
    }
    for name, per_sample in response_versions(list(samples)).items():
        output[name] = [values.tolist() for values in per_sample]
    if step_wise:
        output["is_last_step"] = [s.is_last_step for s in samples]
    return output
