"""Admission of agent calls: counts those in flight, holds new ones while the gateway is paused, and turns
them away while this process cannot confirm the run state with the store (`gateway.replicas.shared`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.errors import ApiError


class Traffic:
    def __init__(self, pause_timeout: float) -> None:
        self.pause_timeout = pause_timeout
        self.in_flight = 0
        self.waiting = 0
        """Calls held at the door by a pause."""
        self._open = asyncio.Event()
        self._open.set()
        self.ended = 0
        """Calls that have ended."""
        self.confirmed: Callable[[], bool] = lambda: True
        """Whether this process holds the run state as the store has it (set by `SharedReplica`; on SQLite it
        always does)."""

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def enter(self) -> None:
        """Admit a call, waiting (up to the pause timeout) while a weight sync is in progress."""
        self.check_confirmed()
        if not self._open.is_set():
            self.waiting += 1
            try:
                await asyncio.wait_for(self._open.wait(), self.pause_timeout)
            except TimeoutError:
                raise ApiError(
                    503,
                    f"the gateway is paused for a weight update (waited {self.pause_timeout:.0f} s)",
                    "paused",
                ) from None
            finally:
                self.waiting -= 1
            self.check_confirmed()
        self.in_flight += 1

    def check_confirmed(self) -> None:
        if not self.confirmed():
            raise ApiError(
                503,
                "the gateway cannot reach its store to confirm the policy version; retry shortly",
                "store_unavailable",
            )

    def leave(self) -> None:
        self.in_flight -= 1
        self.ended += 1

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()
