"""A `transformers` causal LM trained as a LoRA adapter, each version saved where vLLM loads it; no `peft`.

A LoRA policy of the gateway (`gateway serve --lora-policy NAME=BASE`) is served as its base model plus an
adapter that every vLLM server loads at run time from a directory in PEFT's format
(`GatewayAdmin.publish_adapter`). The trainer needs three things for it: the target linear layers made
trainable as low-rank updates of frozen weights, those updates saved in the files and key names vLLM reads,
and a new directory for every version (vLLM caches an adapter by its path). That is all this module does,
so that a trainer does not have to take on `peft` and its own release cycle to produce those two files.

    adapter = LoRAAdapter.attach(model, LoRAConfig(rank=8, alpha=16))
    optimizer = torch.optim.Adam(adapter.parameters(), lr=1e-3)
    ...  # loss on `model`, backward, step
    adapter.save(Path("adapters") / "v1")
    admin.publish_adapter("agent", "1", str(Path("adapters/v1").resolve()))

Each target `nn.Linear` computes `W x + b + (alpha / rank) * B (A x)`: its own weight and bias frozen, `A`
[rank, in] initialised as `nn.Linear` initialises its weights and `B` [out, rank] at zero, so that a fresh
adapter (version 0) answers exactly as the base model does and training starts from the served policy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's path in the base model: its saves are keyed
`base_model.model.<module path>.lora_A.weight`, and vLLM maps those names back onto the base model's."""

DECODER_LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama-, Qwen- or Mistral-style decoder layer; the output head stays the base's."""


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8
    """`r`: a vLLM server loads the adapter only if its --max-lora-rank is at least this."""
    alpha: int = 16
    """The update is scaled by `alpha / rank`: another rank needs little retuning of the learning rate."""
    target_modules: tuple[str, ...] = DECODER_LINEAR_LAYERS
    """The last part of the names of the linear layers to adapt (every layer's modules of those names)."""


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` plus its trainable low-rank update, scaled by `alpha / rank`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: int) -> None:
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.scaling = alpha / rank
        weight = base.weight
        self.lora_A = nn.Parameter(
            torch.empty(rank, base.in_features, dtype=weight.dtype, device=weight.device)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, dtype=weight.dtype, device=weight.device)
        )
        # A as nn.Linear draws its weights (PEFT's choice too); B at zero leaves the base's outputs unchanged.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = nn.functional.linear(nn.functional.linear(x, self.lora_A), self.lora_B)
        return self.base(x) + self.scaling * update  # type: ignore[no-any-return]


class LoRAAdapter:
    """The LoRA layers attached to one model: their parameters to train and their save in PEFT's format."""

    def __init__(self, model: nn.Module, config: LoRAConfig, layers: dict[str, LoRALinear]) -> None:
        self.model = model
        self.config = config
        self.layers = layers
        """Each adapted layer by its module path in the model (`model.layers.0.self_attn.q_proj`)."""

    @classmethod
    def attach(cls, model: nn.Module, config: LoRAConfig | None = None) -> LoRAAdapter:
        """Freeze every weight of `model` and put a `LoRALinear` in place of each target linear layer; from
        then on only the adapter's parameters train. Raises if no layer of the model is a target."""
        config = config or LoRAConfig()
        if config.rank < 1:
            raise ValueError(f"a LoRA rank is at least 1, not {config.rank}")
        model.requires_grad_(False)
        targets = [
            (path, module)
            for path, module in model.named_modules()
            if isinstance(module, nn.Linear) and path.rpartition(".")[2] in config.target_modules
        ]
        if not targets:
            raise ValueError(
                f"no linear layer of the model is named one of {', '.join(config.target_modules)}: "
                "pass the names of its layers as LoRAConfig(target_modules=...)"
            )
        layers = {}
        for path, linear in targets:
            parent, _, name = path.rpartition(".")
            layers[path] = LoRALinear(linear, config.rank, config.alpha)
            setattr(model.get_submodule(parent), name, layers[path])
        return cls(model, config, layers)

    def parameters(self) -> Iterator[nn.Parameter]:
        """What the optimizer steps: every layer's A and B, nothing of the base model."""
        for layer in self.layers.values():
            yield layer.lora_A
            yield layer.lora_B

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A and B of every layer under PEFT's names, detached copies on the CPU."""
        tensors = {}
        for path, layer in self.layers.items():
            for part, weight in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
                tensors[f"{PEFT_PREFIX}{path}.{part}.weight"] = weight.detach().to("cpu").contiguous().clone()
        return tensors

    def peft_config(self) -> dict[str, Any]:
        targets = sorted({path.rpartition(".")[2] for path in self.layers})
        return peft_config(self.config.rank, self.config.alpha, targets, _base_name(self.model))

    def save(self, directory: Path) -> Path:
        """Write the adapter as a new directory (`adapter_config.json`, `adapter_model.safetensors`) and
        return its absolute path, what a server is told to load.

        Refuses a directory that exists: a version is read from a directory of its own, since vLLM keys its
        cached adapters and prefix-cache blocks by path, and a server that reads files being overwritten loads
        half of each version. The files are written beside it and the directory renamed into place whole, so
        a reader never sees it half written."""
        target = Path(directory).expanduser().resolve()
        if target.exists():
            raise FileExistsError(f"{target} exists: save each adapter version to a new directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            save_file(self.state_dict(), str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
            (staging / CONFIG_FILE).write_text(json.dumps(self.peft_config(), indent=2) + "\n")
            staging.chmod(0o755)  # mkdtemp's 0700 would keep servers running as another user out
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target


def peft_config(
    rank: int, alpha: int, targets: list[str], base: str | None, *, initialised: bool = True
) -> dict[str, Any]:
    """`adapter_config.json` as PEFT writes it for a causal LM's adapter (vLLM reads `r`, `lora_alpha`,
    `target_modules`, `bias` and the flags of what it cannot serve: DoRA, modules to save). `initialised`
    is PEFT's `init_lora_weights`: False for an adapter whose B is random rather than zero."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base,
        "bias": "none",
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": initialised,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": alpha,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": targets,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": None,
        "use_dora": False,
        "use_rslora": False,
    }


def _base_name(model: nn.Module) -> str | None:
    """Where the base model was loaded from (`from_pretrained`'s argument), which PEFT records."""
    name = getattr(model, "name_or_path", None)
    return str(name) if name else None
