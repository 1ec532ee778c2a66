"""A causal LM made trainable as LoRA (`trainer_client.lora`): a fresh adapter answers as the base model does,
only A and B train, the adapted model computes what a server computes from the saved files (the base weight
plus alpha / rank times B A), and a version is saved in PEFT's files, names and shapes as a new directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from testbed.adapters import build_adapter
from trainer_client.lora import LoRAAdapter, LoRAConfig

IDS = torch.tensor([[5, 17, 300, 41, 9, 1200, 77]])


def tiny_model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits  # type: ignore[no-any-return]


def trained(adapter: LoRAAdapter, seed: int = 0) -> LoRAAdapter:
    """The adapter with random B as well as A, as after some steps."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in adapter.layers.values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.02)
    return adapter


def test_a_fresh_adapter_answers_exactly_as_the_base_model(model_dir: Path) -> None:
    base = logits(tiny_model(model_dir))
    model = tiny_model(model_dir)

    LoRAAdapter.attach(model, LoRAConfig(rank=8, alpha=16))

    assert torch.equal(logits(model), base)


def test_only_the_adapters_a_and_b_of_every_decoder_linear_layer_train(model_dir: Path) -> None:
    model = tiny_model(model_dir)

    adapter = LoRAAdapter.attach(model, LoRAConfig(rank=4, alpha=8))

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"model.layers.{layer}.{block}.{module}.{part}"
        for layer in (0, 1)
        for block, modules in (("self_attn", ("q", "k", "v", "o")), ("mlp", ("gate", "up", "down")))
        for module in (f"{m}_proj" for m in modules)
        for part in ("lora_A", "lora_B")
    }
    assert [id(p) for p in adapter.parameters()] == [
        id(p) for name, p in model.named_parameters() if p.requires_grad
    ]
    assert all(not layer.lora_B.any() and layer.lora_A.abs().sum() > 0 for layer in adapter.layers.values())


def test_the_adapted_model_computes_the_base_weights_plus_alpha_over_rank_times_b_a(model_dir: Path) -> None:
    """What vLLM serves from the saved adapter: every target weight W + (lora_alpha / r) B A."""
    model = tiny_model(model_dir)
    adapter = trained(LoRAAdapter.attach(model, LoRAConfig(rank=8, alpha=32)))
    merged = tiny_model(model_dir)
    saved = adapter.state_dict()
    with torch.no_grad():
        for path in adapter.layers:
            a = saved[f"base_model.model.{path}.lora_A.weight"]
            b = saved[f"base_model.model.{path}.lora_B.weight"]
            merged.get_submodule(path).weight += (32 / 8) * b @ a

    assert not torch.allclose(logits(model), logits(tiny_model(model_dir)), atol=1e-3)
    torch.testing.assert_close(logits(model), logits(merged), rtol=1e-5, atol=1e-5)


def test_a_saved_version_holds_the_files_names_shapes_and_config_peft_writes(
    model_dir: Path, tmp_path: Path
) -> None:
    adapter = trained(LoRAAdapter.attach(tiny_model(model_dir), LoRAConfig(rank=16, alpha=32)))
    peft_like = build_adapter(model_dir, tmp_path / "peft", seed=1, rank=16)

    saved = adapter.save(tmp_path / "adapters" / "v3")

    assert saved == (tmp_path / "adapters" / "v3").resolve()
    assert sorted(path.name for path in saved.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    written = load_file(str(saved / "adapter_model.safetensors"))
    expected = load_file(str(peft_like / "adapter_model.safetensors"))
    assert {name: tensor.shape for name, tensor in written.items()} == {
        name: tensor.shape for name, tensor in expected.items()
    }
    for path, layer in adapter.layers.items():
        assert torch.equal(written[f"base_model.model.{path}.lora_A.weight"], layer.lora_A.detach())
        assert torch.equal(written[f"base_model.model.{path}.lora_B.weight"], layer.lora_B.detach())
    config = json.loads((saved / "adapter_config.json").read_text())
    peft_config = json.loads((peft_like / "adapter_config.json").read_text())
    # peft's fields all there, as peft writes them for a fresh LoRA of the model (B initialised to zero)
    assert config == peft_config | {"init_lora_weights": True, "lora_alpha": 32}
    assert config["base_model_name_or_path"] == str(model_dir)


def test_a_version_is_not_saved_over_an_existing_directory(model_dir: Path, tmp_path: Path) -> None:
    adapter = LoRAAdapter.attach(tiny_model(model_dir))
    first = adapter.save(tmp_path / "v1")
    before = (first / "adapter_model.safetensors").read_bytes()
    trained(adapter)

    with pytest.raises(FileExistsError, match="save each adapter version to a new directory"):
        adapter.save(tmp_path / "v1")

    assert (first / "adapter_model.safetensors").read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["v1"]  # no staging left behind


def test_a_model_with_none_of_the_target_layers_is_refused() -> None:
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )

    with pytest.raises(ValueError, match=r"no linear layer of the model is named one of qkv_proj"):
        LoRAAdapter.attach(Qwen2ForCausalLM(config), LoRAConfig(target_modules=("qkv_proj",)))
