"""New weights where vLLM reads them: the served model directory's safetensors, replaced in one rename, so
that a backend reloading them (`GatewayAdmin.reload_weights`) never reads half a file.

A model that ties its output head to its input embeddings (Qwen3 up to 4B, Qwen2.5 up to 3B, Llama 3.2)
holds one tensor under two names; safetensors refuses to write shared memory twice, and a tied checkpoint
holds it once: under its first name, the input embedding's in every Hugging Face causal LM, which is the
one vLLM loads (it skips `lm_head.*` when the config ties them)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_weights(model: torch.nn.Module, model_dir: Path) -> None:
    save_tensors(model.state_dict(), model_dir)


def save_tensors(tensors: dict[str, torch.Tensor], model_dir: Path) -> None:
    state = _once_each({name: tensor.detach().to("cpu") for name, tensor in tensors.items()})
    target = Path(model_dir) / "model.safetensors"
    partial = target.with_suffix(".safetensors.partial")
    save_file(state, str(partial), metadata={"format": "pt"})
    os.replace(partial, target)


def _once_each(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor under the first name that holds it (a tied head's second name dropped), contiguous."""
    seen: set[tuple[object, ...]] = set()
    kept = {}
    for name, tensor in tensors.items():
        view = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride())
        if view in seen and tensor.numel():
            continue
        seen.add(view)
        kept[name] = tensor.contiguous()
    return kept
