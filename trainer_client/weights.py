"""New weights where vLLM reads them: the served model directory's safetensors, replaced in one rename, so
that a backend reloading them (`GatewayAdmin.reload_weights`) never reads half a file."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_weights(model: torch.nn.Module, model_dir: Path) -> None:
    save_tensors(model.state_dict(), model_dir)


def save_tensors(tensors: dict[str, torch.Tensor], model_dir: Path) -> None:
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    target = Path(model_dir) / "model.safetensors"
    partial = target.with_suffix(".safetensors.partial")
    save_file(state, str(partial), metadata={"format": "pt"})
    os.replace(partial, target)
