"""Exact mode's render in the gateway's own process: vLLM's renderer, built from the backend's arguments.

Rendering through the backend costs a round trip in which vLLM's API server writes the prompt's ids as JSON,
and the chat call then parses and checks them once more: about 20 ms for a 30,000-token prompt, a seventh of
its time to first token. With `--local-render "MODEL [ARGS]"` (what the backend's `vllm serve` got: the
arguments that shape a render are --served-model-name, --chat-template, the tool and reasoning parsers,
--default-chat-template-kwargs) the gateway builds vLLM's own renderer for that model and renders here; the
backend only generates. It needs vLLM importable here (the `engine` extra, the backend's version) and the
model's tokenizer files.

Trust is earned per model: its first turn is rendered both here and by the backend, and the gateway renders
here from then on only if the two agree; otherwise it logs where they differ and keeps asking the backend. A
request this renderer refuses is rendered by the backend, whose answer (or error) is the agent's.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)


class LocalRenderer:
    """vLLM's chat renderer for one model, without an engine (as `vllm launch render` builds it)."""

    def __init__(self, served: tuple[str, ...], serving: Any, request_type: Any) -> None:
        self.served = served
        self._serving = serving
        self._request_type = request_type

    @classmethod
    async def build(cls, arguments: str) -> LocalRenderer:
        from starlette.datastructures import State
        from vllm import AsyncEngineArgs
        from vllm.config import VllmConfig
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.entrypoints.launchers.render.app_state import init_render_app_state
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        words = shlex.split(arguments)
        if words and not words[0].startswith("-"):  # `vllm serve MODEL ...`
            words = ["--model", *words]
        try:
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(words)  # type: ignore[no-untyped-call]
        except SystemExit:  # vLLM's parser has said what is wrong on stderr
            raise RuntimeError(f"--local-render {arguments!r}: not arguments vLLM takes") from None
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None  # a renderer loads no weights
        config = VllmConfig(
            model_config=model_config,
            structured_outputs_config=engine_args.create_structured_outputs_config(),
        )
        state = State()
        await init_render_app_state(config, state, args)
        served = tuple(args.served_model_name or [args.model])
        log.info("exact mode renders %s in the gateway (vLLM's renderer: %s)", ", ".join(served), arguments)
        return cls(served, state.serving_render, ChatCompletionRequest)

    async def render(self, body: dict[str, Any]) -> list[int] | None:
        """The prompt's ids as vLLM renders `body`; None where this renderer cannot (the backend will)."""
        try:
            request = self._request_type.model_validate(body)
            result = await self._serving.render_chat_request(request, None)
        except Exception as exc:  # whatever vLLM's renderer raises, the backend's render is authoritative
            log.debug("local render failed, the backend renders: %s", exc)
            return None
        ids = getattr(result, "token_ids", None)
        return ids if isinstance(ids, list) else None


class LocalRenders:
    """The gateway's local renderers by served model name, each trusted once it has matched its backend."""

    def __init__(self) -> None:
        self._by_model: dict[str, LocalRenderer] = {}
        self._trusted: set[str] = set()

    async def build(self, arguments: list[str]) -> None:
        for each in arguments:
            renderer = await LocalRenderer.build(each)
            self._by_model.update(dict.fromkeys(renderer.served, renderer))

    async def render(
        self, model: str | None, body: dict[str, Any], backend: Callable[[], Awaitable[list[int]]]
    ) -> list[int]:
        """The prompt's ids: rendered here where this model's renderer is trusted, else by `backend`. `model`
        is the served model whose renderer renders: an adapter's call renders as its base model's, under the
        base's name (vLLM's renderer knows no adapter)."""
        if model is None or (renderer := self._by_model.get(model)) is None:
            return await backend()
        if body.get("model") != model:
            body = {**body, "model": model}
        if model in self._trusted:
            return await renderer.render(body) or await backend()
        here, there = await asyncio.gather(renderer.render(body), backend())
        if here is None:
            return there
        if here == there:
            log.info("the gateway's render of %s matches its backend's: rendering here from now on", model)
            self._trusted.add(model)
        elif self._by_model.pop(model, None) is not None:
            shorter = min(len(here), len(there))
            at = next((i for i, (a, b) in enumerate(zip(here, there, strict=False)) if a != b), shorter)
            log.error(
                "the gateway's render of %s differs from its backend's (%d ids against %d, first at %d): "
                "check --local-render's arguments against the backend's; the backend renders %s",
                model,
                len(here),
                len(there),
                at,
                model,
            )
        return there
