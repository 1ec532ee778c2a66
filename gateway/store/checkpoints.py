"""SQLite's WAL checkpoints, off the commit path.

SQLite copies its write-ahead log back into the database file inside the commit that takes the log past
1,000 pages (about every 150 turns of 3k ids): that commit, and every turn waiting on the store's writer
behind it, waits for the copy and its fsync. The writer's connection leaves checkpoints to this thread, which
runs them on a connection of its own in PASSIVE mode: it copies what no reader still needs without taking the
write lock, so commits go on while it works. Once a checkpoint has copied the whole log, the writer's next
commit starts the log from its beginning again, so it stays about as long as one interval's writes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)

_LOG_LIMIT_BYTES = 64 * 1024 * 1024
"""A log that grew past this (a burst the checkpoints trailed) is cut back to it when it starts over."""


class Checkpointer:
    """Checkpoints `database`'s log every `interval` seconds in which the writer committed."""

    def __init__(self, writer: Engine, database: Engine, commits: Callable[[], int], interval: float) -> None:
        event.listen(writer, "connect", _no_checkpoints_on_commit)
        self._database = database
        self._commits = commits
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-checkpoints", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = self._commits()
        while not self._stop.wait(self._interval):
            commits = self._commits()
            if commits != seen:
                seen = commits
                self.checkpoint()

    def checkpoint(self) -> tuple[int, int, int] | None:
        """One PASSIVE checkpoint: (busy, frames in the log, frames copied), or None if it failed."""
        try:
            connection = self._database.raw_connection()
            try:
                cursor = connection.cursor()
                busy, frames, copied = cursor.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                cursor.close()
            finally:
                connection.close()
        except Exception:  # the next interval tries again; commits never depend on it
            log.warning("WAL checkpoint failed", exc_info=True)
            return None
        return busy, frames, copied

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _no_checkpoints_on_commit(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA wal_autocheckpoint=0")
    cursor.execute(f"PRAGMA journal_size_limit={_LOG_LIMIT_BYTES}")
    cursor.close()
