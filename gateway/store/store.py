"""The store as the HTTP layers see it: async writes through the group-commit writer, reads in threads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
from sqlalchemy.engine import Connection

from gateway.store import expiry, pins, reads, versions
from gateway.store.backlog import Backlog, backlog
from gateway.store.checkpoints import Checkpointer
from gateway.store.pins import Pick, Pin
from gateway.store.records import NewRollout, Reward, RolloutState
from gateway.store.writer import StoreWriter
from rollout_store.database import is_sqlite, make_engine

P = ParamSpec("P")
T = TypeVar("T")
_CHECKPOINT_INTERVAL = 0.2
"""Seconds between SQLite's WAL checkpoints while turns are written (`checkpoints`)."""


class Store:
    def __init__(self, url: str) -> None:
        self.engine = make_engine(url, pool_size=8)
        self._writer_engine = make_engine(url, pool_size=1, writer=True)
        self.writer = StoreWriter(self._writer_engine)
        self._checkpoints = (
            Checkpointer(self._writer_engine, self.engine, lambda: self.writer.commits, _CHECKPOINT_INTERVAL)
            if is_sqlite(url)
            else None
        )

    async def rollout_state(self, rollout_id: str) -> RolloutState | None:
        state = self.writer.known_state(rollout_id)
        if state is None:
            state = await asyncio.to_thread(self._read, reads.rollout_state, rollout_id)
        return state

    async def create_rollout(self, new: NewRollout) -> tuple[dict[str, Any], bool]:
        """The rollout's row, and whether it was created (an identical repeat returns the existing one)."""
        return await self.writer.create_rollout(new)

    async def add_reward(self, rollout_id: str, reward: Reward) -> None:
        await self.writer.add_reward(rollout_id, reward)

    async def finish_rollout(self, rollout_id: str, status: str, reward: Reward | None) -> dict[str, Any]:
        return await self.writer.finish_rollout(rollout_id, status, reward)

    async def expire_idle(self, idle: float, now: float | None = None) -> list[str]:
        """Expire the running rollouts with no call and no control request for `idle` seconds before `now`
        (`gateway.store.expiry`); the ones expired."""
        now = time.time() if now is None else now
        cutoff = now - idle
        expired: list[str] = []
        while True:
            idle_ids = await asyncio.to_thread(self._read, expiry.idle_rollouts, cutoff)
            if idle_ids:
                expired += await self.writer.expire(idle_ids, cutoff, now)
            if len(idle_ids) < expiry.BATCH:
                return expired

    async def pin(
        self, rollout_id: str, pick: Pick, usable: Collection[str], cached: dict[str, int] | None = None
    ) -> Pin | str:
        """The server a rollout's calls go to, agreed through the store (`gateway.store.pins`), or MOVES."""
        return await self.writer.pin(rollout_id, pick, tuple(usable), cached)

    async def history(self, rollout_id: str) -> np.ndarray | None:
        """The ids of the rollout's last answered turn (`gateway.store.pins.history`), read off the writer."""
        return await asyncio.to_thread(self._read, pins.history, rollout_id)

    @property
    def commits(self) -> int:
        return self.writer.commits

    async def get_rollout(
        self, rollout_id: str, *, include_tokens: bool = False, include_messages: bool = False
    ) -> dict[str, Any] | None:
        return await asyncio.to_thread(
            self._read,
            reads.get_rollout,
            rollout_id,
            include_tokens=include_tokens,
            include_messages=include_messages,
        )

    async def publish_version(self, policy: str | None, version: str) -> None:
        """Record that the run's `policy` (None: the full weights) is now at `version` (`policy_versions`)."""
        at = time.time()
        await self.writer.submit(lambda conn: versions.publish_version(conn, policy, version, at))

    async def backlog(self) -> Backlog:
        return await asyncio.to_thread(self._read, backlog)

    async def response_turn(self, rollout_id: str, response_id: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._read, reads.response_turn, rollout_id, response_id)

    def _read(self, fn: Callable[Concatenate[Connection, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        with self.engine.connect() as conn:
            return fn(conn, *args, **kwargs)

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()
        self.writer.close()
        self._writer_engine.dispose()
        self.engine.dispose()
