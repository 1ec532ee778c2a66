"""The GRPO loss, checked against values computed by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from trainer_client import grpo_loss

OLD = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
MASK = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])


def test_token_mean_loss_clips_the_ratio():
    new = torch.log(torch.tensor([[0.5, 0.75, 0.55], [0.5, 0.25, 0.5]]))  # ratios 1.5, 1.1 | 0.5

    loss, metrics = grpo_loss(new, OLD, ADV, MASK)

    # token 1: min(1.5, 1.2) * 1 = 1.2; token 2: 1.1; row 2 token 1: min(0.5 * -2, 0.8 * -2) = -1.6
    assert loss.item() == pytest.approx(-(1.2 + 1.1 - 1.6) / 3)
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5) / 3)
    kl = [(r - 1) - math.log(r) for r in (1.5, 1.1, 0.5)]
    assert metrics["approx_kl"] == pytest.approx(sum(kl) / 3)


def test_sequence_mean_token_mean_weighs_each_sequence_once():
    new = torch.log(torch.tensor([[0.5, 0.75, 0.55], [0.5, 0.25, 0.5]]))

    loss, _ = grpo_loss(new, OLD, ADV, MASK, aggregation="seq-mean-token-mean")

    assert loss.item() == pytest.approx(-((1.2 + 1.1) / 2 + (-1.6)) / 2)


def test_gradient_flows_only_through_unclipped_loss_tokens():
    new = torch.log(torch.tensor([[0.5, 0.75, 0.55], [0.5, 0.25, 0.5]])).requires_grad_()

    grpo_loss(new, OLD, ADV, MASK)[0].backward()

    # d/dlogp of -(ratio * A) / 3 = -ratio * A / 3 where unclipped and on the mask, else 0.
    expected = torch.tensor([[0.0, 0.0, -1.1 / 3], [0.0, 0.0, 0.0]])
    assert torch.allclose(new.grad, expected, atol=1e-6)


def test_truncated_importance_weight_uses_the_trainers_recomputation():
    new = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    proximal = torch.log(
        torch.tensor([[0.5, 1.0, 0.6], [0.5, 0.25, 0.5]])
    )  # weights 2 -> capped 1.5, 1.2, 0.5

    loss, _ = grpo_loss(new, OLD, ADV, MASK, proximal_logprobs=proximal, tis_cap=1.5)

    # ratios against proximal: 0.5, 0.8333 | 2.0; objective min(r * A, clip(r, 0.8, 1.2) * A) times the weight
    terms = [min(0.5 * 1, 0.8 * 1) * 1.5, (0.5 / 0.6) * 1 * 1.2, min(2.0 * -2, 1.2 * -2) * 0.5]
    assert loss.item() == pytest.approx(-sum(terms) / 3)


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="unknown aggregation"):
        grpo_loss(OLD, OLD, ADV, MASK, aggregation="sum")  # type: ignore[arg-type]


class _Logits(torch.nn.Module):
    """A causal LM stand-in whose next-token distribution is fixed: `probs` at every position."""

    def __init__(self, probs: list[float]) -> None:
        super().__init__()
        self.log_probs = torch.log(torch.tensor(probs))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.log_probs.expand(*input_ids.shape, -1))


def test_the_reference_trainer_reads_each_tokens_logprob_and_the_policys_entropy_there():
    from trainer_client.reference.trainer import token_logprobs

    ids = torch.tensor([[0, 1, 2, 1]])
    logprobs, entropy = token_logprobs(_Logits([0.5, 0.25, 0.25]), ids, torch.ones_like(ids), entropy=True)
    _, without = token_logprobs(_Logits([0.5, 0.25, 0.25]), ids, torch.ones_like(ids))

    assert logprobs[0].tolist() == pytest.approx([0.0, math.log(0.25), math.log(0.25), math.log(0.25)])
    h = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert entropy is not None and entropy[0].tolist() == pytest.approx([0.0, h, h, h])
    assert without is None
