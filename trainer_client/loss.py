"""The GRPO policy-gradient loss over token tensors shaped like `Batch.padded()` (or `packed()`)."""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean"]


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: Aggregation = "token-mean",
    proximal_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio policy-gradient loss; every tensor is [B, T], aligned token by token.

    `old_logprobs` are the engine's sampling logprobs. The ratio is taken against `proximal_logprobs` when
    given (the trainer's own recomputation under the weights that sampled), else against `old_logprobs`.
    With both, `tis_cap` adds the truncated importance-sampling weight min(exp(proximal - old), tis_cap),
    which corrects for the engine and the trainer disagreeing on the same weights.

    `token-mean` averages over all loss tokens of the batch (long sequences weigh more);
    `seq-mean-token-mean` averages within each sequence, then over sequences.
    Returns the loss and detached metrics: clip fraction, approximate KL to the old policy, ratio mean.
    """
    mask = loss_mask.to(logprobs.dtype)
    base = old_logprobs if proximal_logprobs is None else proximal_logprobs
    log_ratio = logprobs - base
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if tis_cap is not None and proximal_logprobs is not None:
        per_token = per_token * torch.clamp(torch.exp(proximal_logprobs - old_logprobs), max=tis_cap).detach()
    loss = _aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1.0)
        metrics = {
            "clip_fraction": float(((clipped < unclipped).to(mask.dtype) * mask).sum() / tokens),
            "approx_kl": float((((ratio - 1.0) - log_ratio) * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
        }
    return loss, metrics


def distillation_advantages(
    tensors: dict[str, torch.Tensor], *, kl_weight: float = 1.0, grpo_weight: float = 0.0
) -> torch.Tensor:
    """Per-token advantages for on-policy distillation, from `Batch.padded()` (or `packed()`) read with a
    teacher: `kl_weight * (teacher_logprobs - old_logprobs)`, the negative per-token reverse KL to the
    teacher on the tokens the policy sampled, plus `grpo_weight` times the GRPO advantage; 0 off the loss
    tokens. Fed to `grpo_loss` as its `advantages`, it moves the policy toward the teacher on its own
    samples (with `grpo_weight`, toward the reward as well)."""
    mask = tensors["loss_mask"].to(torch.float32)
    reverse_kl = tensors["old_logprobs"] - tensors["teacher_logprobs"]
    return (-kl_weight * reverse_kl + grpo_weight * tensors["advantages"]) * mask


def teacher_kl(tensors: dict[str, torch.Tensor]) -> float:
    """The mean per-token reverse KL to the teacher over the loss tokens (sampled logprob less the
    teacher's, estimated on the policy's own samples)."""
    mask = tensors["loss_mask"].to(torch.float32)
    gap = (tensors["old_logprobs"] - tensors["teacher_logprobs"]) * mask
    return float(gap.sum() / mask.sum().clamp(min=1.0))


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    if aggregation == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if aggregation == "seq-mean-token-mean":
        per_sequence = (per_token * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        has_tokens = (mask.sum(dim=-1) > 0).to(per_token.dtype)
        return (per_sequence * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    raise ValueError(f"unknown aggregation {aggregation!r}")
