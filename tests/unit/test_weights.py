"""The served directory's weights as both trainer seams write them, for a model whose output head is its
input embedding (tied, as Qwen3-0.6B's): written once, read back equal, the untied tensors all there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainer_client.weights import save_tensors, save_weights


def tiny(tied: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config)


def test_a_tied_models_weights_are_written_once_under_the_input_embeddings_name(tmp_path: Path) -> None:
    model = tiny(tied=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    save_weights(model, tmp_path)

    written = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in written
    assert torch.equal(written["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert set(written) == set(model.state_dict()) - {"lm_head.weight"}


def test_a_tied_model_reloads_from_what_was_written_with_the_same_outputs(tmp_path: Path) -> None:
    model = tiny(tied=True)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)  # a training step moved the shared tensor
    save_weights(model, tmp_path)
    model.config.save_pretrained(tmp_path)

    again = Qwen2ForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, model(ids).logits)


def test_an_untied_model_keeps_both_its_embedding_and_its_head(tmp_path: Path) -> None:
    model = tiny(tied=False)

    save_weights(model, tmp_path)

    written = load_file(str(tmp_path / "model.safetensors"))
    assert set(written) == set(model.state_dict())
    assert torch.equal(written["lm_head.weight"], model.lm_head.weight)


def test_streamed_copies_of_a_tied_models_tensors_are_written_under_every_name(tmp_path: Path) -> None:
    """The asynchronous trainer's transfer hands over copies: nothing is shared, and vLLM skips the head."""
    model = tiny(tied=True)
    streamed = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}

    save_tensors(streamed, tmp_path)

    written = load_file(str(tmp_path / "model.safetensors"))
    assert set(written) == set(model.state_dict())
    assert torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])


@pytest.mark.parametrize("tied", [True, False])
def test_writing_weights_replaces_the_file_whole_and_leaves_no_partial_file(
    tmp_path: Path, tied: bool
) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"old")

    save_weights(tiny(tied), tmp_path)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert load_file(str(tmp_path / "model.safetensors"))
