"""The gateway's log lines: one format for every process (the command line's and each worker's)."""

from __future__ import annotations

import logging

from gateway.settings import Settings

_TRACE = 5
"""uvicorn's level below debug, which it names only once imported: logging is configured before that."""


def configure_logging(settings: Settings) -> None:
    logging.addLevelName(_TRACE, "TRACE")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Alembic says which revisions it runs, with each one's docstring, at info: the store's own line ("empty
    # database: creating the schema (revision N)", "upgraded ...") says what matters; --log-level debug shows
    # alembic's.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("alembic").setLevel(logging.WARNING)
