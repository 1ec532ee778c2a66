"""Per-choice extras taken from the engine's outputs on their way to vLLM's reply builders, and put into the
replies those build: a whole reply's choices take them as fields (vLLM's response models accept extra
fields), a stream's on the chunk that carries the choice's `finish_reason` (vLLM computes the spans when an
output finishes, so they are known by then)."""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

FIELD = "weight_versions"
"""The field a choice gains: `[{"version", "start", "end"}]` over its output tokens, as vLLM's generate
endpoint names and shapes it."""
_FINISHED = '"finish_reason":"'
"""How a stream chunk that ends a choice reads (vLLM writes chunks compact; a string inside one escapes its
quotes, so no text can look like this)."""
_DATA = "data: "

Extras = dict[int, dict[str, Any]]
"""A request's finished choices (by the index its reply gives them) and what each adds to its choice."""


def extras_of(output: Any) -> dict[str, Any]:
    """What a finished output adds to its choice. Routed experts (MoE) would be read here too: vLLM has them
    on finished outputs, but returns them on whole replies only."""
    spans = output.weight_versions
    if spans is None:  # tokens no version was reported for
        return {}
    return {FIELD: [{"version": s.version, "start": s.start, "end": s.end} for s in spans]}


def _collect(outputs: Any, base: int, extras: Extras) -> None:
    for output in outputs:
        if output.finish_reason is not None:
            extras[base + output.index] = extras_of(output)


async def _chat_outputs(results: AsyncIterator[Any], extras: Extras) -> AsyncIterator[Any]:
    try:
        async for result in results:
            _collect(result.outputs, 0, extras)
            yield result
    finally:
        await _close(results)


async def _completion_outputs(
    results: AsyncIterator[tuple[int, Any]], choices: int, extras: Extras
) -> AsyncIterator[tuple[int, Any]]:
    """Completions number a reply's choices across its prompts: prompt index times `n`, plus the output's."""
    try:
        async for prompt, result in results:
            _collect(result.outputs, prompt * choices, extras)
            yield prompt, result
    finally:
        await _close(results)


async def _stream(chunks: AsyncIterator[str], extras: Extras) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            if extras and _FINISHED in chunk and chunk.startswith(_DATA):
                chunk = _with_extras(chunk, extras)
            yield chunk
    finally:
        await _close(chunks)


async def _close(iterator: AsyncIterator[Any]) -> None:
    """Close what a wrapper took over as soon as the wrapper is closed (a client that left): the engine
    aborts the request then, as it does without the plugin, not whenever the collector finds it."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


def _with_extras(chunk: str, extras: Extras) -> str:
    payload = json.loads(chunk[len(_DATA) :])
    for choice in payload.get("choices") or ():
        if choice.get("finish_reason") is not None:
            choice.update(extras.get(choice.get("index"), {}))
    return _DATA + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _set(choice: Any, extras: dict[str, Any]) -> None:
    for name, value in extras.items():
        setattr(choice, name, value)


def chat_stream(
    method: Callable[..., AsyncIterator[str]], signature: inspect.Signature
) -> Callable[..., Any]:
    def stream(*args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = signature.bind(*args, **kwargs)
        extras: Extras = {}
        bound.arguments["result_generator"] = _chat_outputs(bound.arguments["result_generator"], extras)
        return _stream(method(*bound.args, **bound.kwargs), extras)

    return stream


def chat_whole(method: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
    async def whole(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        extras: Extras = {}
        bound.arguments["result_generator"] = _chat_outputs(bound.arguments["result_generator"], extras)
        response = await method(*bound.args, **bound.kwargs)
        for choice in getattr(response, "choices", ()):  # an error response has none
            _set(choice, extras.get(choice.index, {}))
        return response

    return whole


def completion_stream(
    method: Callable[..., AsyncIterator[str]], signature: inspect.Signature
) -> Callable[..., Any]:
    def stream(*args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = signature.bind(*args, **kwargs)
        extras: Extras = {}
        choices = bound.arguments["request"].n or 1
        results = bound.arguments["result_generator"]
        bound.arguments["result_generator"] = _completion_outputs(results, choices, extras)
        return _stream(method(*bound.args, **bound.kwargs), extras)

    return stream


def completion_whole(method: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
    """vLLM numbers a whole completions reply's choices in the order of its prompts' outputs."""

    def whole(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        response = method(*bound.args, **bound.kwargs)
        outputs = [output for result in bound.arguments["final_res_batch"] for output in result.outputs]
        for choice, output in zip(response.choices, outputs, strict=True):
            _set(choice, extras_of(output))
        return response

    return whole
