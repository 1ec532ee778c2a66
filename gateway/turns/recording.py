"""Where every turn's outcome goes: the store (a call's turns commit together), the metrics, the traces,
and the policy version the turn finished under. Every status a turn can end with is written here, and only
here."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np

from gateway.errors import StoreUnavailable
from gateway.fleet.prefixes import PrefixIndex, adapter_key
from gateway.metrics import Metrics
from gateway.store.lineage import Node
from gateway.store.records import RolloutState, StoreError, TurnRecord
from gateway.store.store import Store
from gateway.telemetry import TurnSpans
from gateway.turns.capture import TurnCapture
from rollout_store.status import Limit, TurnStatus

log = logging.getLogger(__name__)

CANCELLED = (
    "cancelled before the end of the stream: the client disconnected, or the gateway stopped at its "
    "--shutdown-timeout"
)
"""A cancelled turn's error: from inside the call, an agent leaving and a shutdown cutting it look alike."""


class Recorder:
    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        policy_version: str,
        spans: TurnSpans | None = None,
        prefixes: PrefixIndex | None = None,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._prefixes = prefixes
        """Told each answered turn's ids: its server's prefix cache holds them (`gateway.fleet.prefixes`)."""
        self.spans = spans
        """Each ended turn's trace span, with --otlp-endpoint."""
        self.policy_version = policy_version
        """Stamped on every new turn; the admin API changes it when the trainer publishes weights."""
        self.cache_kept = False
        """Whether the last pause kept the servers' caches (the run state's): stamped on the turns that
        spanned the update it made room for."""

    def in_flight(self, change: int) -> None:
        self._metrics.in_flight.inc(change)

    def timed(self, stage: str, since: float) -> None:
        """A call spent the time since `since` (`time.perf_counter`) in `stage` (`gateway.metrics.STAGES`)."""
        self._metrics.stage[stage].observe(time.perf_counter() - since)

    def relayed(self, tokens: int) -> None:
        self._metrics.relayed.inc(tokens)

    async def rollout_state(self, rollout_id: str) -> RolloutState | None:
        return await self._store.rollout_state(rollout_id)

    async def parent_of(self, rollout_id: str, messages: list[dict[str, Any]]) -> Node | None:
        return await self._store.writer.parent_of(rollout_id, messages)

    async def response_turn(self, rollout_id: str, response_id: str) -> dict[str, Any] | None:
        """The stored turn a Responses agent refers to, with its full messages."""
        return await self._store.response_turn(rollout_id, response_id)

    async def commit(self, records: list[TurnRecord]) -> None:
        """Commit a call's answered turns (one per choice) together, before the agent gets the reply."""
        for record in records:
            if record.policy_version_end is None:  # a whole reply ends as it commits
                record.policy_version_end = self.policy_version
            self._spanned(record)
        started = time.perf_counter()
        try:
            await self._store.writer.insert_turns(records)
        except StoreError:
            raise
        except Exception as exc:
            log.exception("could not commit turn of rollout %s", records[0].rollout_id)
            raise StoreUnavailable(exc) from exc
        self.timed("commit", started)
        for record in records:
            self._account(record, 200)
        if self._prefixes is not None and records[0].backend is not None:
            longest = max(records, key=lambda record: record.completion_ids.shape[0])
            ids = np.concatenate([longest.prompt_ids, longest.completion_ids])
            self._prefixes.saw(records[0].backend, ids, adapter_key(records[0].adapter))

    async def failed(self, capture: TurnCapture, status: int, message: str) -> None:
        """The call failed after it was admitted: an error turn with what had been captured."""
        records = self._ended(capture, TurnStatus.ERROR, message)
        for record in records:
            record.http_status = status
            self._account(record, status)
        self._metrics.errors.labels(reason=str(status)).inc()
        await self._store.writer.insert_turns(records)

    async def refused(self, capture: TurnCapture, limit: Limit, message: str) -> None:
        """A rollout limit stopped the call before any engine time: a refused turn, the rollout's end
        reason."""
        record = self._ended(capture, TurnStatus.REFUSED, message)[0]
        record.http_status = 400
        record.refused_by = limit
        self._account(record, 400)
        await self._store.writer.insert_turns([record])

    def cancelled(self, capture: TurnCapture) -> None:
        """The agent went away (or a shutdown cut the call): store what was generated, without awaiting (this
        task is being cancelled)."""
        records = self._ended(capture, TurnStatus.CANCELLED, CANCELLED)
        for record in records:
            self._account(record, 499)
        self._metrics.errors.labels(reason="cancelled").inc()
        self._store.writer.enqueue_turns(records).add_done_callback(_log_failure)

    def _ended(self, capture: TurnCapture, status: TurnStatus, message: str) -> list[TurnRecord]:
        records = capture.finish()
        for record in records:
            record.status = status
            record.error = message
            if record.adapter is None:  # an adapter version's weights never change
                record.policy_version_end = self.policy_version
            record.finished_at = time.time()
            self._spanned(record)
        return records

    def _spanned(self, record: TurnRecord) -> None:
        """A turn that spanned a weight update says whether the servers' caches were kept through it."""
        if record.policy_version_end != record.policy_version:
            record.cache_kept = self.cache_kept

    def _account(self, record: TurnRecord, status: int) -> None:
        self._metrics.call(
            record.endpoint,
            status,
            record.finished_at - record.started_at,
            record.prompt_ids.shape[0],
            record.completion_ids.shape[0],
        )
        if self.spans is not None:
            self.spans.record(record)


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("could not store a cancelled turn: %s", future.exception())
