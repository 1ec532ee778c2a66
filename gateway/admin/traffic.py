"""Admission of agent calls: counts those in flight, and holds new ones while the gateway is paused."""

from __future__ import annotations

import asyncio
import time

from gateway.errors import ApiError


class Traffic:
    def __init__(self, pause_timeout: float) -> None:
        self.pause_timeout = pause_timeout
        self.in_flight = 0
        self.waiting = 0
        """Calls held at the door by a pause."""
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._left_at = 0.0
        """When a call last ended (monotonic)."""

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def enter(self) -> None:
        """Admit a call, waiting (up to the pause timeout) while a weight sync is in progress."""
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
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        self._left_at = time.monotonic()
        if self.in_flight == 0:
            self._idle.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def drained(self, timeout: float) -> bool:
        """Wait until no call is in flight; False if some still are after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def settled(self, quiet: float, timeout: float, first: float | None = None) -> None:
        """Wait until calls stop ending: none in flight, or none ended for `quiet` seconds (those left wait
        for something else, such as vLLM's queue), or, while none has ended yet, for `first` seconds (default
        `quiet`); at most `timeout` seconds."""
        started = time.monotonic()
        deadline = started + timeout
        while self.in_flight:
            now = time.monotonic()
            ended = self._left_at > started
            still = (quiet if ended else first or quiet) - (now - (self._left_at if ended else started))
            if still <= 0 or now >= deadline:
                return
            await asyncio.sleep(min(still, deadline - now))
