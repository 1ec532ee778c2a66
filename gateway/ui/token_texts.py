"""Each token id's text, for the viewer's token view: the served model's tokenizer decoding the id alone
(vLLM's `/detokenize`), remembered per model, so that a page asks the engine only for ids no page asked for
before. Ids are never re-tokenized: the view shows the stored ids, and these texts only label them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

import orjson

from gateway.fleet.engine import Engine
from gateway.fleet.replies import BackendFailure

_CONCURRENT = 16


class TokenTexts:
    def __init__(self, engine: Engine) -> None:
        self._backends = engine
        self._known: dict[str | None, dict[int, str]] = {}

    async def texts(self, model: str | None, ids: Iterable[int]) -> dict[int, str]:
        """The text of each id the engine could decode (none when no server is reachable)."""
        known = self._known.setdefault(model, {})
        wanted = set(ids)
        missing = sorted(wanted - known.keys())
        if missing:
            limit = asyncio.Semaphore(_CONCURRENT)

            async def decode(token: int) -> None:
                async with limit:
                    status, body = await self._backends.post_any("/detokenize", {"tokens": [token]}, model)
                text = orjson.loads(body).get("prompt") if status == 200 else None
                if isinstance(text, str):
                    known[token] = text

            # No engine left (a store read after training): the ids alone.
            with contextlib.suppress(BackendFailure):
                await asyncio.gather(*(decode(token) for token in missing))
        return {token: known[token] for token in wanted if token in known}
