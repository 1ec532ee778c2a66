"""The leader goes first: the members of a GRPO group start from one prompt, and vLLM shares only blocks it
has already computed, so members that reach a server together would each compute the whole prompt. The first
member's call has the server compute the prompt alone (a copy of the call asking for one token, not
streamed), and its siblings' calls that reach the same server meanwhile wait for that copy's reply: then
every one of them, the leader's included, finds the prompt in the server's prefix cache.

A copy, not the leader's own call: a reply that is not streamed shows nothing until it ends, and a streamed
one only shows the prompt is done by its first token, which the relay sees and the fleet does not. The
copy costs one decoded token and a round trip to the first member; the group saves a prompt's prefill per
other member. Each gateway process leads its own calls: siblings that reach a server through two replicas
compute the prompt at most twice.

The copy is bounded by a share of the backend timeout (`EngineClient`), and each call's wait for it counts
against the call's own timeout: the group's calls fail within one timeout, whatever the copy meets. The calls
waiting for a copy are queued calls (`--max-queued`), as those waiting for a connection are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ahead:
    """What a group's first call sends ahead of it."""

    prompt: str
    """The shared prompt's digest: calls with the same one on one server share its computation."""
    path: str
    copy: bytes
    """The call's body asking for one token, not streamed."""


class Leaders:
    def __init__(self) -> None:
        self._computing: dict[tuple[str, str], asyncio.Event] = {}
        self.led = 0
        """Copies sent ahead (a prompt computed once for the calls behind it)."""
        self.followed = 0
        """Calls that waited for a copy another call sent."""

    async def first(
        self,
        url: str,
        ahead: Ahead,
        compute: Callable[[], Awaitable[None]],
        queue: Callable[[Callable[[], Awaitable[object]]], Awaitable[None]],
    ) -> None:
        """Return once the prompt of `ahead` is in the server's cache: when another call of this process that
        is computing it is done (waited for in `queue`, which may refuse the call), else after `compute` has
        had it computed. A copy that fails lets the calls go on: each computes the prompt itself, as without a
        leader."""
        key = (url, ahead.prompt)
        computing = self._computing.get(key)
        if computing is not None:
            await queue(partial(self._behind, computing))
            return
        done = self._computing[key] = asyncio.Event()
        self.led += 1
        try:
            await compute()
        except Exception as exc:  # the calls behind it go on: the fleet's errors are theirs to meet
            log.warning("the prompt sent ahead to %s failed (%r): its calls compute it each", url, exc)
        finally:
            del self._computing[key]
            done.set()

    async def _behind(self, computing: asyncio.Event) -> None:
        self.followed += 1
        await computing.wait()
