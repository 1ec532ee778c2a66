"""The vLLM plugin (`vllm-plugin/`, from its wheel) against the vLLM installed here: every method it wraps is
where it expects it, and a vLLM that moved one stops the plugin at start-up with the name of what moved."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import vllm
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

SERVING = {"openai_serving_chat": OpenAIServingChat, "openai_serving_completion": OpenAIServingCompletion}


@pytest.fixture
def plugin(vllm_plugin: Path, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    monkeypatch.syspath_prepend(str(vllm_plugin))
    from rl_gateway_vllm import hooks, plugin

    return types.SimpleNamespace(hooks=hooks, plugin=plugin)


def test_every_wrapped_method_is_where_the_installed_vllm_has_it(plugin: Any) -> None:
    plugin.hooks.check_version(vllm.__version__)
    for hook in plugin.hooks.HOOKS:
        signature = plugin.hooks.check(hook, SERVING[hook.serving])
        assert set(hook.parameters) <= set(signature.parameters)


def test_a_vllm_that_renamed_a_method_is_refused_with_its_name(plugin: Any) -> None:
    renamed = types.SimpleNamespace(chat_completion_stream=lambda request, result_generator: None)

    with pytest.raises(plugin.hooks.HookMismatch) as refused:
        plugin.hooks.check(plugin.hooks.CHAT_STREAM, renamed)

    assert str(refused.value) == (
        "SimpleNamespace has no method chat_completion_stream_generator: the plugin cannot add spans"
    )


def test_a_vllm_that_renamed_a_parameter_is_refused_with_its_name(plugin: Any) -> None:
    renamed = types.SimpleNamespace(chat_completion_full_generator=lambda request, results: None)

    with pytest.raises(plugin.hooks.HookMismatch) as refused:
        plugin.hooks.check(plugin.hooks.CHAT_WHOLE, renamed)

    assert str(refused.value) == (
        "SimpleNamespace.chat_completion_full_generator has no parameter result_generator: the plugin cannot "
        "add spans"
    )


def test_nothing_is_wrapped_when_one_method_moved(plugin: Any) -> None:
    chat = types.SimpleNamespace(
        chat_completion_stream_generator=lambda request, result_generator: None,
        chat_completion_full_generator=lambda request, result_generator: None,
    )
    unwrapped = dict(vars(chat))
    completion = types.SimpleNamespace(completion_stream_generator=lambda request, result_generator: None)
    state = types.SimpleNamespace(openai_serving_chat=chat, openai_serving_completion=completion)

    with pytest.raises(plugin.hooks.HookMismatch, match="request_output_to_completion_response"):
        plugin.plugin.install(state)

    assert vars(chat) == unwrapped


def test_a_server_without_the_completions_api_has_its_chat_wrapped(plugin: Any) -> None:
    chat = types.SimpleNamespace(
        chat_completion_stream_generator=lambda request, result_generator: None,
        chat_completion_full_generator=lambda request, result_generator: None,
    )

    wrapped = plugin.plugin.install(types.SimpleNamespace(openai_serving_chat=chat))

    assert wrapped == [plugin.hooks.CHAT_STREAM, plugin.hooks.CHAT_WHOLE]


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0"])
def test_a_vllm_release_it_was_not_tested_with_is_refused(plugin: Any, version: str) -> None:
    with pytest.raises(plugin.hooks.HookMismatch) as refused:
        plugin.hooks.check_version(version)

    assert str(refused.value) == f"rl-gateway-vllm supports vLLM 0.32.x, not {version}"


def test_the_plugin_says_what_it_adds(plugin: Any) -> None:
    assert plugin.plugin.describe() == {
        "plugin": "rl-gateway-vllm",
        "version": "0.1.0",
        "fields": ["weight_versions"],
    }
