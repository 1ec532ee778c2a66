"""The vLLM methods the plugin wraps, and the check that they still are what it was written against: a vLLM
that renamed one, or the parameter the plugin takes from it, stops the server at start-up with the name of
what moved, instead of serving replies without spans."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

SUPPORTED_VLLM = ("0.32.",)
"""vLLM releases the plugin is tested with (prefixes of `vllm.__version__`)."""


@dataclass(frozen=True)
class Hook:
    serving: str
    """The API server's state attribute holding the serving object (`state.openai_serving_chat`)."""
    method: str
    parameters: tuple[str, ...]
    """Parameters the wrapper reads or replaces, by name."""


CHAT_STREAM = Hook("openai_serving_chat", "chat_completion_stream_generator", ("request", "result_generator"))
CHAT_WHOLE = Hook("openai_serving_chat", "chat_completion_full_generator", ("request", "result_generator"))
COMPLETION_STREAM = Hook(
    "openai_serving_completion", "completion_stream_generator", ("request", "result_generator")
)
COMPLETION_WHOLE = Hook(
    "openai_serving_completion", "request_output_to_completion_response", ("final_res_batch", "request")
)
HOOKS = (CHAT_STREAM, CHAT_WHOLE, COMPLETION_STREAM, COMPLETION_WHOLE)


class HookMismatch(RuntimeError):
    """vLLM is not the one the plugin was written against."""


def check_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise HookMismatch(
            f"rl-gateway-vllm supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}, not {version}"
        )


def check(hook: Hook, serving: object) -> inspect.Signature:
    """The wrapped method's signature, once it is known to have the method and parameters the hook needs."""
    method = getattr(serving, hook.method, None)
    if not callable(method):
        raise HookMismatch(
            f"{type(serving).__name__} has no method {hook.method}: the plugin cannot add spans"
        )
    signature = inspect.signature(method)
    missing = [name for name in hook.parameters if name not in signature.parameters]
    if missing:
        raise HookMismatch(
            f"{type(serving).__name__}.{hook.method} has no parameter {', '.join(missing)}: "
            "the plugin cannot add spans"
        )
    return signature
