"""Directories the testbed generates once and reuses: the tiny model and its adapters.

A directory is complete when its marker file records the build's fingerprint (a hash of everything the
files depend on, the generator's source included) and every file exists; a complete one is returned
untouched. Otherwise the files are written to a staging directory inside it and moved in, the marker last,
under an exclusive lock, so that concurrent builders (test workers, a demo and a test) wait for one build and
a reader never sees a half-written file under its final name.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_once(
    out: Path,
    kind: str,
    fingerprint: str,
    files: Sequence[str],
    write: Callable[[Path], dict[str, Any]],
    *,
    force: bool = False,
) -> bool:
    """Make `out` hold `files` as `write(staging)` writes them, unless it already does for `fingerprint`
    (or `force`); `write` returns what the marker records beside the fingerprint. Whether it wrote them."""
    out.mkdir(parents=True, exist_ok=True)
    marker = out / f".{kind}.json"
    with _locked(out / f".{kind}.lock"):
        if not force and _is_complete(out, marker, fingerprint, files):
            return False
        marker.unlink(missing_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=out))
        try:
            recorded = write(staging)
            for name in files:
                os.chmod(staging / name, 0o644)
                os.replace(staging / name, out / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        write_json(marker, {"fingerprint": fingerprint, **recorded})
    return True


def _is_complete(out: Path, marker: Path, fingerprint: str, files: Sequence[str]) -> bool:
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("fingerprint") == fingerprint and all((out / f).is_file() for f in files)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
