"""The LoRA adapters of the tiny model as `peft` would have saved them: the files, key names, shapes and
config vLLM reads, seeded weights that differ per seed, and a build that leaves a complete adapter alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from testbed.adapters import build_adapter


def weights(adapter: Path) -> dict[str, np.ndarray]:
    return load_file(str(adapter / "adapter_model.safetensors"))


def test_an_adapter_holds_a_and_b_of_every_linear_layer_shaped_from_the_models_config(
    model_dir: Path, tmp_path: Path
) -> None:
    adapter = build_adapter(model_dir, tmp_path / "adapter", seed=1, rank=8)

    written = weights(adapter)
    shapes = {name: tuple(tensor.shape) for name, tensor in written.items()}
    expected: dict[str, tuple[int, int]] = {}
    for layer in (0, 1):
        for module, (fan_in, fan_out) in {
            "self_attn.q_proj": (128, 128),
            "self_attn.k_proj": (128, 128),
            "self_attn.v_proj": (128, 128),
            "self_attn.o_proj": (128, 128),
            "mlp.gate_proj": (128, 256),
            "mlp.up_proj": (128, 256),
            "mlp.down_proj": (256, 128),
        }.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            expected[f"{prefix}.lora_A.weight"] = (8, fan_in)
            expected[f"{prefix}.lora_B.weight"] = (fan_out, 8)
    assert shapes == expected
    assert {tensor.dtype for tensor in written.values()} == {np.dtype(np.float32)}
    assert all(np.count_nonzero(tensor) > 0 for tensor in written.values())
    assert sorted(path.name for path in adapter.iterdir() if not path.name.startswith(".")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def test_an_adapters_config_is_a_peft_lora_of_a_causal_lm_on_the_model(
    model_dir: Path, tmp_path: Path
) -> None:
    adapter = build_adapter(model_dir, tmp_path / "adapter", seed=1, rank=16)

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert {key: config[key] for key in ("peft_type", "task_type", "r", "lora_alpha", "bias")} == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 16,
        "lora_alpha": 32,
        "bias": "none",
    }
    assert config["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert config["base_model_name_or_path"] == str(model_dir)
    assert (config["use_dora"], config["use_rslora"], config["lora_bias"], config["modules_to_save"]) == (
        False,
        False,
        False,
        None,
    )
    assert {tuple(tensor.shape) for name, tensor in weights(adapter).items() if "lora_A" in name} == {
        (16, 128),
        (16, 256),
    }


def test_adapters_of_different_seeds_have_different_weights_and_of_one_seed_the_same(
    model_dir: Path, tmp_path: Path
) -> None:
    one = weights(build_adapter(model_dir, tmp_path / "one", seed=1))
    again = weights(build_adapter(model_dir, tmp_path / "again", seed=1))
    other = weights(build_adapter(model_dir, tmp_path / "other", seed=2))

    assert all(np.array_equal(one[name], again[name]) for name in one)
    assert not any(np.array_equal(one[name], other[name]) for name in one)


def test_the_adapters_updates_leave_the_residual_streams_constant_feature_alone(
    model_dir: Path, tmp_path: Path
) -> None:
    """The tiny model's end token reads that feature: replies through an adapter still end."""
    written = weights(build_adapter(model_dir, tmp_path / "adapter", seed=1))

    writers = [name for name in written if name.endswith(("o_proj.lora_B.weight", "down_proj.lora_B.weight"))]
    assert len(writers) == 4
    assert all(not written[name][0].any() and written[name][1:].all() for name in writers)


def test_building_an_adapter_again_leaves_the_complete_one_untouched(model_dir: Path, tmp_path: Path) -> None:
    adapter = build_adapter(model_dir, tmp_path / "adapter", seed=1)
    files = [adapter / "adapter_config.json", adapter / "adapter_model.safetensors"]
    stamps = [path.stat().st_mtime_ns for path in files]

    assert build_adapter(model_dir, tmp_path / "adapter", seed=1) == adapter

    assert [path.stat().st_mtime_ns for path in files] == stamps


def test_building_another_adapter_in_the_same_directory_replaces_it(model_dir: Path, tmp_path: Path) -> None:
    first = weights(build_adapter(model_dir, tmp_path / "adapter", seed=1))

    adapter = build_adapter(model_dir, tmp_path / "adapter", seed=2, rank=16)

    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 16
    assert not any(np.array_equal(first[name], tensor) for name, tensor in weights(adapter).items())
    assert [path.name for path in adapter.iterdir() if path.name.startswith(".adapter-")] == []


def test_a_missing_file_is_written_again(model_dir: Path, tmp_path: Path) -> None:
    adapter = build_adapter(model_dir, tmp_path / "adapter", seed=1)
    expected = weights(adapter)
    (adapter / "adapter_model.safetensors").unlink()

    build_adapter(model_dir, tmp_path / "adapter", seed=1)

    assert all(np.array_equal(expected[name], tensor) for name, tensor in weights(adapter).items())
