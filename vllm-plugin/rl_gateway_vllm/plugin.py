"""The endpoint plugin vLLM loads (`VLLM_PLUGINS=rl_gateway`): it wraps the chat and completions serving
objects' reply builders once they exist, and answers `GET /rl-gateway/plugin` so that a gateway can tell a
server with it from one without."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from rl_gateway_vllm import __version__, spans
from rl_gateway_vllm.hooks import (
    CHAT_STREAM,
    CHAT_WHOLE,
    COMPLETION_STREAM,
    COMPLETION_WHOLE,
    Hook,
    check,
    check_version,
)

ROUTE = "/rl-gateway/plugin"
WRAPPERS = {
    CHAT_STREAM: spans.chat_stream,
    CHAT_WHOLE: spans.chat_whole,
    COMPLETION_STREAM: spans.completion_stream,
    COMPLETION_WHOLE: spans.completion_whole,
}
FIELDS = [spans.FIELD]


def describe() -> dict[str, Any]:
    """What `GET /rl-gateway/plugin` answers: the plugin's version and the fields it adds."""
    return {"plugin": "rl-gateway-vllm", "version": __version__, "fields": FIELDS}


def install(state: Any) -> list[Hook]:
    """Wrap every hook's method on the serving objects `state` holds (a server without the completions or
    chat API has none to wrap); every method is checked before any is wrapped."""
    found = [(hook, getattr(state, hook.serving, None)) for hook in WRAPPERS]
    present = [(hook, serving) for hook, serving in found if serving is not None]
    signatures = [check(hook, serving) for hook, serving in present]
    for (hook, serving), signature in zip(present, signatures, strict=True):
        setattr(serving, hook.method, WRAPPERS[hook](getattr(serving, hook.method), signature))
    return [hook for hook, _ in present]


class WeightVersionsPlugin:
    name = "rl_gateway"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        import vllm

        check_version(vllm.__version__)
        app.add_api_route(ROUTE, describe, methods=["GET"])

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        install(state)
