"""A training batch: step-wise samples as torch tensors, padded or packed, and trajectory-level metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from training_data.samples import MergedSample, StepSample, per_token_versions

if TYPE_CHECKING:  # torch is imported where tensors are made: reading and exporting samples need none
    import torch

Sample = StepSample | MergedSample


@dataclass
class Batch:
    samples: list[Sample]
    counts: dict[str, int] = field(default_factory=dict)
    """Groups and rollouts served (`served_rollouts`, some perhaps without a sample), groups dropped,
    rollouts skipped by reason."""

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def rollout_ids(self) -> list[str]:
        return list(dict.fromkeys(s.rollout_id for s in self.samples))

    def padded(self, pad_id: int = 0) -> dict[str, torch.Tensor]:
        import torch

        """Right-padded [B, L] tensors; `old_logprobs[b, t]` is the sampling logprob of `input_ids[b, t]`
        (0 on prompt and padding), `advantages[b, t]` the sample's advantage on its loss tokens; samples read
        with a teacher add `teacher_logprobs`, aligned like `old_logprobs`. `token_versions` is the index of
        the version that sampled each token (`training_data.versions`), and with a current version
        `token_staleness` its updates behind it (-1 on prompt, padding and where unknown)."""
        sequences = [(s.input_ids, s.loss_mask, s.token_logprobs) for s in self.samples]
        lengths = [ids.shape[0] for ids, _, _ in sequences]
        width = max(lengths, default=0)
        rows = len(self.samples)
        input_ids = np.full((rows, width), pad_id, dtype=np.int64)
        attention = np.zeros((rows, width), dtype=np.int64)
        loss_mask = np.zeros((rows, width), dtype=np.float32)
        old_logprobs = np.zeros((rows, width), dtype=np.float32)
        advantages = np.zeros((rows, width), dtype=np.float32)
        for row, (sample, (ids, mask, logprobs)) in enumerate(zip(self.samples, sequences, strict=True)):
            length = ids.shape[0]
            input_ids[row, :length] = ids
            attention[row, :length] = 1
            loss_mask[row, :length] = mask
            old_logprobs[row, :length] = logprobs
            advantages[row, :length] = sample.advantage * loss_mask[row, :length]
        tensors = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention),
            "loss_mask": torch.from_numpy(loss_mask),
            "old_logprobs": torch.from_numpy(old_logprobs),
            "advantages": torch.from_numpy(advantages),
        }
        teacher = self._teacher_logprobs()
        if teacher is not None:
            padded = np.zeros((rows, width), dtype=np.float32)
            for row, values in enumerate(teacher):
                padded[row, : values.shape[0]] = values
            tensors["teacher_logprobs"] = torch.from_numpy(padded)
        for name, placed in per_token_versions(self.samples).items():
            padded_versions = np.full((rows, width), -1, dtype=np.int64)
            for row, (start, values) in enumerate(placed):
                padded_versions[row, start : start + values.shape[0]] = values
            tensors[name] = torch.from_numpy(padded_versions)
        return tensors

    def packed(self) -> dict[str, torch.Tensor]:
        """All samples in one [1, T] row for variable-length attention kernels: `cu_seqlens` [B + 1] marks
        where each sample starts, `position_ids` restart at 0 for each (and `teacher_logprobs` as in
        `padded`)."""
        import torch

        parts_ids, parts_mask, parts_logprobs, parts_adv = [], [], [], []
        for sample in self.samples:
            mask = sample.loss_mask.astype(np.float32)
            parts_ids.append(sample.input_ids)
            parts_mask.append(mask)
            parts_logprobs.append(sample.token_logprobs)
            parts_adv.append(mask * np.float32(sample.advantage))
        lengths = np.array([ids.shape[0] for ids in parts_ids], dtype=np.int64)
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        total = int(cu_seqlens[-1])
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu_seqlens[:-1].astype(np.int64), lengths)

        def row(parts: list[np.ndarray], dtype: Any) -> torch.Tensor:
            joined = np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype=dtype)
            return torch.from_numpy(joined).unsqueeze(0)

        tensors = {
            "input_ids": row(parts_ids, np.int64),
            "position_ids": torch.from_numpy(positions).unsqueeze(0),
            "cu_seqlens": torch.from_numpy(cu_seqlens),
            "loss_mask": row(parts_mask, np.float32),
            "old_logprobs": row(parts_logprobs, np.float32),
            "advantages": row(parts_adv, np.float32),
        }
        teacher = self._teacher_logprobs()
        if teacher is not None:
            tensors["teacher_logprobs"] = row(teacher, np.float32)
        for name, placed in per_token_versions(self.samples).items():
            joined = np.full(total, -1, dtype=np.int64)
            for first, (start, values) in zip(cu_seqlens[:-1].tolist(), placed, strict=True):
                joined[first + start : first + start + values.shape[0]] = values
            tensors[name] = torch.from_numpy(joined).unsqueeze(0)
        return tensors

    def _teacher_logprobs(self) -> list[np.ndarray] | None:
        """Each sample's teacher logprobs aligned with its `input_ids`; None when read without a teacher."""
        values = [s.token_teacher_logprobs for s in self.samples]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise ValueError("some samples of the batch have teacher scores and others not")
        return [v for v in values if v is not None]

    def metrics(self) -> dict[str, float]:
        """Trajectory-level reward metrics, turn-level counts beside them, then the selection's `counts`.

        A trajectory is a rollout with its reward, or a choice rewarded on its own (`choice_reward`: each
        choice of such a call is a trajectory from the call's prompt); `rollouts` counts the rollouts with
        samples in the batch."""
        rollouts = {s.rollout_id for s in self.samples}
        trajectories = {_trajectory(s): s.reward for s in self.samples}
        rewards = np.array(list(trajectories.values()), dtype=np.float64)
        tokens = sum(int(s.loss_mask.sum()) for s in self.samples)
        return {
            "rollouts": float(len(rollouts)),
            "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
            "reward_std": float(rewards.std()) if rewards.size else 0.0,
            "samples": float(len(self.samples)),
            "samples_per_rollout": len(self.samples) / max(len(rollouts), 1),
            "tokens": float(sum(int(s.input_ids.shape[0]) for s in self.samples)),
            "loss_tokens": float(tokens),
            **self._teacher_metrics(),
            **{name: float(value) for name, value in self.counts.items()},
        }

    def _teacher_metrics(self) -> dict[str, float]:
        """`teacher_kl`: the mean per-token reverse KL to the teacher (sampling logprob less the teacher's)
        over the loss tokens, when the samples were read with a teacher."""
        teacher = self._teacher_logprobs()
        if teacher is None:
            return {}
        gap = sum(
            float(((s.token_logprobs - values) * s.loss_mask).sum())
            for s, values in zip(self.samples, teacher, strict=True)
        )
        tokens = sum(int(s.loss_mask.sum()) for s in self.samples)
        return {"teacher_kl": gap / max(tokens, 1)}


def _trajectory(sample: Sample) -> tuple[str, int | None]:
    """The trajectory a sample's reward belongs to: its rollout, or the choice it is."""
    if not sample.choice_reward:
        return sample.rollout_id, None
    return sample.rollout_id, sample.turn_index if isinstance(sample, StepSample) else sample.turn_indices[0]
