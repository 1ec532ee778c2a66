"""What the writer remembers of rollouts between transactions, so that a turn of a known rollout is one
INSERT.

Owned by the writer thread. Changes made inside a transaction are held apart and published only once it
commits; a failed transaction drops them, a conflict with another replica drops everything.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from gateway.store.lineage import Lineage
from gateway.store.records import RolloutState
from rollout_store.status import RolloutStatus

_MAX_ROLLOUT_STATES = 200_000
_EARLY_RETRIES = 10_000


class LineageCache:
    """Lineages of recent rollouts, bounded by the number of ids held."""

    def __init__(self, max_tokens: int) -> None:
        self._entries: OrderedDict[str, Lineage] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._tokens = 0
        self.max_tokens = max_tokens

    def get(self, rollout_id: str) -> Lineage | None:
        entry = self._entries.get(rollout_id)
        if entry is not None:
            self._entries.move_to_end(rollout_id)
        return entry

    def put(self, rollout_id: str, entry: Lineage) -> None:
        self.drop(rollout_id)
        self._entries[rollout_id] = entry
        self._sizes[rollout_id] = entry.tokens
        self._tokens += self._sizes[rollout_id]
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            self.drop(next(iter(self._entries)))

    def drop(self, rollout_id: str) -> None:
        if self._entries.pop(rollout_id, None) is not None:
            self._tokens -= self._sizes.pop(rollout_id)


class WriterCaches:
    """Rollout states and lineages as of the latest commit, and the changes of the transaction in progress."""

    def __init__(self, lineage_tokens: int) -> None:
        self._lineages = LineageCache(lineage_tokens)
        self._states: dict[str, RolloutState] = {}
        self._batch_lineages: dict[str, Lineage] = {}
        self._batch_states: dict[str, RolloutState] = {}
        self._finished: list[str] = []
        self.early_retries: dict[tuple[str, str, int], dict[int, int]] = {}
        """Retries committed before the attempt they repeat: (rollout, request hash, choice) ->
        {turn: attempt}."""

    def committed_state(self, rollout_id: str) -> RolloutState | None:
        """Safe from the event loop: a plain dict read."""
        return self._states.get(rollout_id)

    def state(self, rollout_id: str) -> RolloutState | None:
        return self._batch_states.get(rollout_id) or self._states.get(rollout_id)

    def set_state(self, rollout_id: str, state: RolloutState) -> None:
        self._batch_states[rollout_id] = state

    def lineage(self, rollout_id: str) -> Lineage | None:
        return self._batch_lineages.get(rollout_id) or self._lineages.get(rollout_id)

    def hold_lineage(self, rollout_id: str, lineage: Lineage) -> None:
        """The lineage this transaction extends; published if it commits."""
        self._batch_lineages[rollout_id] = lineage

    def finished(self, rollout_id: str) -> None:
        self._finished.append(rollout_id)

    def expired(self, rollout_ids: list[str]) -> None:
        """Rollouts this transaction expired: a late call of theirs is refused before it reaches an engine."""
        for rollout_id in rollout_ids:
            known = self.state(rollout_id)
            if known is not None:
                self.set_state(rollout_id, replace(known, status=RolloutStatus.EXPIRED))
            self.finished(rollout_id)

    def remember_early_retry(self, key: tuple[str, str, int], index: int, attempt: int) -> None:
        self.early_retries.setdefault(key, {})[index] = attempt
        if len(self.early_retries) > _EARLY_RETRIES:  # retries whose first attempt never came
            self.early_retries.pop(next(iter(self.early_retries)))

    def begin(self) -> None:
        self._batch_lineages.clear()
        self._batch_states.clear()
        self._finished.clear()

    def commit(self) -> None:
        for rollout_id, lineage in self._batch_lineages.items():
            self._lineages.put(rollout_id, lineage)
        for rollout_id in self._finished:
            self._lineages.drop(rollout_id)
        self._states.update(self._batch_states)
        if len(self._states) > _MAX_ROLLOUT_STATES:
            for key in list(self._states)[: _MAX_ROLLOUT_STATES // 4]:
                del self._states[key]

    def abort(self) -> None:
        """The transaction failed: its lineages hold turns that were not committed."""
        for rollout_id in self._batch_lineages:
            self._lineages.drop(rollout_id)

    def forget(self) -> None:
        """Another writer changed the database: read everything again."""
        self._lineages = LineageCache(self._lineages.max_tokens)
        self._states.clear()
