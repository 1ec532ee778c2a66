"""The gateway's log lines: one format for every process (the command line's and each worker's).

`--log-format json` writes one JSON object a line, for a log shipper (Loki, Elasticsearch, CloudWatch):

    {"time":"2026-11-27T23:01:02.345Z","level":"INFO","logger":"gateway.access","message":"POST ...",
     "replica":"host-4242-1a2b3c","pid":4242,"rollout":"r1","method":"POST","path":"...","status":200,
     "duration_ms":1532.4}

uvicorn's own lines (`uvicorn.error`) go through the same handler, so that a shipper reads one format."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

import orjson

from gateway.settings import LogFormat, Settings

_TRACE = 5
"""uvicorn's level below debug, which it names only once imported: logging is configured before that."""
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
"""The paths a probe or a scraper calls every few seconds: left out of the access log unless asked."""
FIELDS = ("method", "path", "status", "duration_ms")
"""The access log's own fields (its calls' `extra=`), written as keys of their own."""

rollout: ContextVar[str | None] = ContextVar("rollout", default=None)
"""The rollout of the call this task serves (set once per call, by the access log's middleware): every line
logged on that call's path says which rollout it was for, without each call site passing it."""
_replica: str | None = None
_probes_logged = False


def name_replica(process_id: str) -> None:
    """This process's id as the store knows it (`gateway_processes.process_id`), on every line from now on."""
    global _replica
    _replica = process_id


class JsonFormatter(logging.Formatter):
    """One JSON object a line. Keys with nothing to say (no replica yet, no rollout) are left out rather
    than null, so that a shipper's field is either absent or meaningful."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")[:-6] + "Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if _replica is not None:
            line["replica"] = _replica
        line["pid"] = record.process
        call = getattr(record, "rollout", None) or rollout.get()
        if call is not None:
            line["rollout"] = call
        for key in FIELDS:
            if key in record.__dict__:
                line[key] = record.__dict__[key]
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return orjson.dumps(line, default=str).decode()


class QuietProbes(logging.Filter):
    """Drops the access log's lines for the probes and scrapes (`PROBES`), unless `--access-log-probes`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _probes_logged or getattr(record, "path", None) not in PROBES


def configure_logging(settings: Settings) -> None:
    logging.addLevelName(_TRACE, "TRACE")
    json = settings.log_format == LogFormat.JSON
    root = logging.getLogger()
    if not root.handlers:  # as basicConfig: a host that configured logging itself keeps its handlers
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter() if json else logging.Formatter(TEXT))
        root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    if json:
        _uvicorn_to_root()
    configure_access_log(settings)
    # Alembic says which revisions it runs, with each one's docstring, at info: the store's own line ("empty
    # database: creating the schema (revision N)", "upgraded ...") says what matters; --log-level debug shows
    # alembic's.
    if root.level > logging.DEBUG:
        logging.getLogger("alembic").setLevel(logging.WARNING)


def configure_access_log(settings: Settings) -> None:
    """Whether the access log writes the probes' lines (`--access-log-probes`): a flag the access log's
    filter reads, as the command line configures logging before the access log's module is imported."""
    global _probes_logged
    _probes_logged = settings.access_log_probes


def _uvicorn_to_root() -> None:
    """uvicorn configures its loggers with handlers and a format of its own, from `LOGGING_CONFIG`, when its
    server starts (in each worker too, which gets the config by pickle): emptied here, before, that
    configuration leaves its loggers to propagate to the root's JSON handler (but for what uvicorn's own
    settings turn off, as its access log, which the gateway's replaces)."""
    from uvicorn.config import LOGGING_CONFIG

    LOGGING_CONFIG.clear()
    LOGGING_CONFIG.update({"version": 1, "disable_existing_loggers": False})
