"""SQLite's WAL checkpoints run beside the store's commits, never inside one."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from gateway.store.checkpoints import Checkpointer
from rollout_store.database import make_engine


def log_frames(path: Path) -> int:
    """Frames in the write-ahead log, as a checkpoint that copies nothing (another connection's) reports."""
    engine = make_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql("PRAGMA wal_checkpoint(NOOP)").one()[1])
    finally:
        engine.dispose()


def test_commits_leave_checkpoints_to_the_checkpointer_which_copies_the_whole_log(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    writer, readers = make_engine(url, pool_size=1, writer=True), make_engine(url)
    commits = 0
    checkpointer = Checkpointer(writer, readers, lambda: commits, interval=3600)  # only when asked, here
    try:
        with writer.begin() as conn:
            conn.execute(text("CREATE TABLE blobs (data BLOB)"))
        for _ in range(60):  # 60 commits of 100 KB: 1,500 pages, past SQLite's own checkpoint at 1,000
            with writer.begin() as conn:
                conn.execute(text("INSERT INTO blobs VALUES (:data)"), {"data": bytes(100_000)})
            commits += 1

        assert log_frames(tmp_path / "store.db") > 1_500  # no commit checkpointed
        busy, frames, copied = checkpointer.checkpoint()
        assert (busy, copied) == (0, frames)
        with writer.begin() as conn:  # the next commit starts the log over
            conn.execute(text("INSERT INTO blobs VALUES (:data)"), {"data": b"x"})
        assert log_frames(tmp_path / "store.db") < 10
    finally:
        checkpointer.close()
        writer.dispose()
        readers.dispose()
