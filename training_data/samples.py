"""Training samples with the engine's exact ids and sampling logprobs: step-wise (one per model call) or
merged (one per chain of calls that extend each other exactly).

A rollout is a tree, not a line: a harness's sub-agents hold conversations of their own, interleaved in time
with the main one, and a compaction restarts the conversation from a summary. Merging follows the lineage
(`parent_turn`): each chain is a path of that tree, so every sampled token is trained exactly once, and the
main conversation stays one sample however many sub-agent calls came between its turns. Every chain of a
rollout carries the rollout's reward and advantage: the advantage is the rollout's, shared by all of its
chains alike (each of their sampled tokens weighs as in a step-wise sample).

A sample's reward and advantage are its rollout's, except for a choice of an n > 1 call whose choices were
rewarded one by one (`training_data.groups`): it has its own. Such a choice is a merged sample of its own:
it joins neither the chain it extends nor a later turn that extends it (that turn starts a chain, the
choice's ids part of its prompt, without loss), so that each token trains with the advantage of its turn,
merged or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


@dataclass
class StepSample:
    """One turn of a rollout, ready for a policy-gradient step.

    `logprobs[i]` is the engine's sampling logprob of `completion_ids[i]`. `loss_mask` covers
    `input_ids = prompt_ids + completion_ids`: 0 on the prompt, 1 on the completion (all 0 when `masked`:
    the rollout had failed or cancelled turns and is kept only for its group's statistics).
    """

    rollout_id: str
    group_id: str
    step: int
    turn_index: int
    is_last_step: bool
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    reward: float
    reward_components: dict[str, float] | None
    advantage: float
    policy_version: str | None
    finish_reason: str | None
    masked: bool = False
    parent_turn: int | None = None
    drift_tokens: int | None = None
    choice_reward: bool = False
    """`reward` and `advantage` are this turn's own: a choice of a call whose choices were rewarded one by
    one."""
    retried: bool = False
    """A client's retry repeated this call and the agent went on with the retry's reply: this one carries no
    loss (`masked`), so that nothing is trained twice."""
    teacher_logprobs: np.ndarray | None = None
    """A teacher's logprob of each of `completion_ids` (`trainer-client score`, `SampleOptions(teacher=)`)."""
    completion_versions: np.ndarray | None = None
    """The index, in its policy's published versions, of the version that sampled each of `completion_ids`
    (`training_data.versions`; -1 where unknown)."""
    completion_staleness: np.ndarray | None = None
    """Each of `completion_ids`' updates behind the trainer's current version, when read with one (-1 where
    unknown)."""
    stale: np.ndarray | None = None
    """The completion tokens masked out of the loss as too stale (`SampleOptions.max_token_staleness`)."""

    @property
    def alone(self) -> bool:
        """Merged, this step is a sample of its own: its reward is its own, or a retry replaced it."""
        return self.choice_reward or self.retried

    @property
    def input_ids(self) -> np.ndarray:
        return np.concatenate([self.prompt_ids, self.completion_ids])

    @property
    def prompt_length(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def loss_mask(self) -> np.ndarray:
        mask = np.zeros(self.prompt_ids.shape[0] + self.completion_ids.shape[0], dtype=np.int8)
        if not self.masked:
            mask[self.prompt_ids.shape[0] :] = 1 if self.stale is None else ~self.stale
        return mask

    @property
    def token_versions(self) -> np.ndarray | None:
        """`completion_versions` aligned with `input_ids` (-1 on the prompt)."""
        return _aligned(self.prompt_ids.shape[0], self.completion_versions)

    @property
    def token_staleness(self) -> np.ndarray | None:
        """`completion_staleness` aligned with `input_ids` (-1 on the prompt)."""
        return _aligned(self.prompt_ids.shape[0], self.completion_staleness)

    @property
    def token_logprobs(self) -> np.ndarray:
        """Sampling logprobs aligned with `input_ids` (0 on the prompt)."""
        return np.concatenate([np.zeros(self.prompt_ids.shape[0], dtype=np.float32), self.logprobs])

    @property
    def token_teacher_logprobs(self) -> np.ndarray | None:
        """Teacher logprobs aligned with `input_ids` (0 on the prompt), if the sample was read with them."""
        if self.teacher_logprobs is None:
            return None
        aligned: np.ndarray = np.concatenate(
            [np.zeros(self.prompt_ids.shape[0], np.float32), self.teacher_logprobs]
        )
        return aligned

    def extends(self, previous: StepSample) -> bool:
        """Whether this step's prompt is `previous`'s prompt + completion, token for token, plus more."""
        size = previous.prompt_ids.shape[0] + previous.completion_ids.shape[0]
        if self.parent_turn != previous.turn_index or self.prompt_ids.shape[0] < size:
            return False
        return bool(
            np.array_equal(self.prompt_ids[: previous.prompt_ids.shape[0]], previous.prompt_ids)
            and np.array_equal(self.prompt_ids[previous.prompt_ids.shape[0] : size], previous.completion_ids)
        )

    def to_json(self) -> dict[str, Any]:
        """A plain-JSON record (the `export --format jsonl` line)."""
        return _record(
            self,
            {
                "step": self.step,
                "turn_index": self.turn_index,
                "is_last_step": self.is_last_step,
                "prompt_ids": self.prompt_ids.tolist(),
                "completion_ids": self.completion_ids.tolist(),
                "loss_mask": self.loss_mask.tolist(),
                "logprobs": self.logprobs.tolist(),
                **_teacher(self.teacher_logprobs),
                **_versions(self.completion_versions, self.completion_staleness),
            },
        )


def _aligned(prompt: int, values: np.ndarray | None) -> np.ndarray | None:
    if values is None:
        return None
    aligned: np.ndarray = np.concatenate([np.full(prompt, -1, dtype=np.int32), values.astype(np.int32)])
    return aligned


def _versions(versions: np.ndarray | None, staleness: np.ndarray | None) -> dict[str, Any]:
    found = {} if versions is None else {"token_versions": versions.tolist()}
    return found if staleness is None else {**found, "token_staleness": staleness.tolist()}


@dataclass
class MergedSample:
    """A chain of steps whose prompts extend each other exactly, as one sequence: every step's completion
    tokens carry loss (mask 1) and their sampling logprobs; the prompt and the environment's tokens between
    completions (tool results, template boundaries) carry none."""

    rollout_id: str
    group_id: str
    turn_indices: list[int]
    is_last_step: bool
    input_ids: np.ndarray
    prompt_length: int
    """The first turn's prompt: the ids before the first sampled token (masked or not)."""
    loss_mask: np.ndarray
    token_logprobs: np.ndarray
    reward: float
    reward_components: dict[str, float] | None
    advantage: float
    policy_version: str | None
    finish_reason: str | None
    masked: bool = False
    choice_reward: bool = False
    """A choice rewarded on its own (`StepSample.choice_reward`), alone in its sample."""
    token_teacher_logprobs: np.ndarray | None = None
    """A teacher's logprob of each sampled token, aligned with `input_ids` (0 where `token_logprobs` is)."""
    token_versions: np.ndarray | None = None
    """The version index of each sampled token (`StepSample.completion_versions`), aligned with `input_ids`
    (-1 elsewhere)."""
    token_staleness: np.ndarray | None = None
    """Each sampled token's updates behind the trainer's current version, aligned with `input_ids` (-1
    elsewhere and where unknown)."""

    def to_json(self) -> dict[str, Any]:
        return _record(
            self,
            {
                "turn_indices": self.turn_indices,
                "is_last_step": self.is_last_step,
                "input_ids": self.input_ids.tolist(),
                "loss_mask": self.loss_mask.tolist(),
                "logprobs": self.token_logprobs.tolist(),
                **_teacher(self.token_teacher_logprobs),
                **_versions(self.token_versions, self.token_staleness),
            },
        )


def _record(sample: StepSample | MergedSample, tokens: dict[str, Any]) -> dict[str, Any]:
    """An export record: the rollout, the sample's tokens, then its outcome (the same columns for both)."""
    return {
        "rollout_id": sample.rollout_id,
        "group_id": sample.group_id,
        **tokens,
        "reward": sample.reward,
        "reward_components": sample.reward_components,
        "advantage": sample.advantage,
        "policy_version": sample.policy_version,
        "finish_reason": sample.finish_reason,
        "masked": sample.masked,
    }


def _teacher(logprobs: np.ndarray | None) -> dict[str, Any]:
    return {} if logprobs is None else {"teacher_logprobs": logprobs.tolist()}


def merge_steps(steps: list[StepSample]) -> list[MergedSample]:
    """One rollout's steps (in turn order) merged by lineage: a step joins the chain of the turn it extends
    exactly, whatever other chains' turns came between them in time (a sub-agent's calls, a compaction's).
    A turn that a second later turn extends (a fork) is not extended again: the second starts a chain of
    its own, the shared tokens in its prompt without loss. A choice rewarded on its own, and an attempt a
    client retried, stand alone: neither joins a chain nor is joined."""
    chains: list[list[StepSample]] = []
    open_ends: dict[int, int] = {}  # the last turn of a chain that no turn has extended yet -> its chain
    for step in steps:
        at = open_ends.get(step.parent_turn) if step.parent_turn is not None and not step.alone else None
        if at is not None and step.extends(chains[at][-1]):
            del open_ends[chains[at][-1].turn_index]
            chains[at].append(step)
        else:
            at = len(chains)
            chains.append([step])
        if not step.alone:
            open_ends[step.turn_index] = at
    return [_merge(chain) for chain in chains]


def _merge(chain: list[StepSample]) -> MergedSample:
    last = chain[-1]
    input_ids = last.input_ids
    loss_mask = np.zeros(input_ids.shape[0], dtype=np.int8)
    logprobs = np.zeros(input_ids.shape[0], dtype=np.float32)
    scored = all(step.teacher_logprobs is not None for step in chain)
    teacher = np.zeros(input_ids.shape[0], dtype=np.float32) if scored else None
    versions = _unknown(input_ids, all(step.completion_versions is not None for step in chain))
    staleness = _unknown(input_ids, all(step.completion_staleness is not None for step in chain))
    for step in chain:
        start = step.prompt_ids.shape[0]
        end = start + step.completion_ids.shape[0]
        loss_mask[start:end] = step.loss_mask[start:]
        logprobs[start:end] = step.logprobs
        if teacher is not None:
            teacher[start:end] = step.teacher_logprobs
        if versions is not None:
            versions[start:end] = step.completion_versions
        if staleness is not None:
            staleness[start:end] = step.completion_staleness
    return MergedSample(
        rollout_id=last.rollout_id,
        group_id=last.group_id,
        turn_indices=[step.turn_index for step in chain],
        is_last_step=last.is_last_step,
        input_ids=input_ids,
        prompt_length=chain[0].prompt_length,
        loss_mask=loss_mask,
        token_logprobs=logprobs,
        reward=last.reward,
        reward_components=last.reward_components,
        advantage=last.advantage,
        policy_version=last.policy_version,
        finish_reason=last.finish_reason,
        masked=all(step.masked for step in chain),
        choice_reward=last.choice_reward,
        token_teacher_logprobs=teacher,
        token_versions=versions,
        token_staleness=staleness,
    )


def _unknown(input_ids: np.ndarray, known: bool) -> np.ndarray | None:
    return np.full(input_ids.shape[0], -1, dtype=np.int32) if known else None


class Split(NamedTuple):
    """A sample cut at its first turn's prompt, as trainers that keep prompt and response apart take it."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    """Every id after the prompt: sampled tokens and, merged, the environment's tokens between turns."""
    response_mask: np.ndarray
    """1 on sampled tokens (0 everywhere when the sample is masked)."""
    response_logprobs: np.ndarray
    """The sampling logprobs, 0 on the environment's tokens."""


def split(sample: StepSample | MergedSample) -> Split:
    cut = sample.prompt_length
    return Split(
        sample.input_ids[:cut], sample.input_ids[cut:], sample.loss_mask[cut:], sample.token_logprobs[cut:]
    )


def per_token_versions(
    samples: Sequence[StepSample | MergedSample],
) -> dict[str, list[tuple[int, np.ndarray]]]:
    """Per sample, the version index (`token_versions`) and, read with a current version, the staleness
    (`token_staleness`) of its sampled ids, each where every sample has it, as where they start in
    `input_ids` and their values: -1 elsewhere. A step's values start after its prompt (its completion's are
    not copied into an array as long as its prompt); a merged sample's cover its `input_ids`."""
    found: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name in ("token_versions", "token_staleness"):
        placed = [_placed(sample, name) for sample in samples]
        known = [(start, values) for start, values in placed if values is not None]
        if known and len(known) == len(placed):
            found[name] = known
    return found


def _placed(sample: StepSample | MergedSample, name: str) -> tuple[int, np.ndarray | None]:
    if isinstance(sample, StepSample):
        values = sample.completion_versions if name == "token_versions" else sample.completion_staleness
        return sample.prompt_ids.shape[0], values
    return 0, getattr(sample, name)


def response_versions(samples: Sequence[StepSample | MergedSample]) -> dict[str, list[np.ndarray]]:
    """`per_token_versions` of each id after its prompt, as `split` cuts it (-1 on the environment's tokens),
    for the trainers that take per-token columns."""
    return {
        name: [
            values[sample.prompt_length - start :]
            for (start, values), sample in zip(placed, samples, strict=True)
        ]
        for name, placed in per_token_versions(samples).items()
    }
