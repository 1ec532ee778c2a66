"""`--backend-file`: the fleet listed in a file, one server URL a line (`#` starts a comment), re-read when it
changes, so that servers can join and leave while the gateway runs without an admin call."""

from __future__ import annotations

import logging
from pathlib import Path

from gateway.fleet.servers import without_user_info

log = logging.getLogger(__name__)


class BackendFile:
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._seen: float | None = None

    def read(self) -> list[str]:
        """The servers listed, less those whose URL names a user (said in the log, password hidden)."""
        lines = (line.split("#", 1)[0].strip() for line in self.path.read_text().splitlines())
        urls = []
        for line in filter(None, lines):
            try:
                urls.append(without_user_info(line))
            except ValueError as exc:
                log.warning("backend file %s: %s; left out", self.path, exc)
        return urls

    def changed(self) -> list[str] | None:
        """The servers listed now if the file changed since last asked, else None (also when it cannot be
        read: the fleet stays as it is)."""
        try:
            mtime = self.path.stat().st_mtime
            if mtime == self._seen:
                return None
            urls = self.read()
        except OSError as exc:
            log.warning("backend file %s unreadable (%s): the fleet stays as it is", self.path, exc)
            return None
        if not urls:
            log.warning("backend file %s lists no server: the fleet stays as it is", self.path)
            return None
        self._seen = mtime
        return urls
