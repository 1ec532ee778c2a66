"""Engines for SQLite and PostgreSQL, and schema upgrades through the Alembic migrations."""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import URL, Connection, Dialect, Engine, make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.sql import Select
from sqlalchemy.sql.expression import Executable

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    """Accept plain `postgresql://` / `postgres://` URLs and use the psycopg 3 driver for them."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


SUPPORTED_URLS = "sqlite:///PATH, postgresql://USER@HOST/DB (or postgresql+psycopg://...)"


def check_url(url: str) -> str:
    """The URL if the store can use it; a ValueError naming the URLs it accepts otherwise, or the extra a
    PostgreSQL URL needs installed. The store's drivers are synchronous (it writes from its own thread):
    asyncpg, aiosqlite and other drivers are not."""
    try:
        parsed = make_url(normalize_url(url))
    except Exception:
        raise ValueError(f"{redacted(url)!r} is not a database URL; use {SUPPORTED_URLS}") from None
    if parsed.drivername not in ("sqlite", "sqlite+pysqlite", "postgresql+psycopg"):
        raise ValueError(f"the store cannot use {parsed.drivername!r} URLs; use {SUPPORTED_URLS}")
    if parsed.drivername == "postgresql+psycopg" and importlib.util.find_spec("psycopg") is None:
        raise ValueError("a PostgreSQL store needs the postgres extra: pip install 'rl-gateway[postgres]'")
    return url


class StoreUnreachable(RuntimeError):
    """No store at the URL, or none that answers: said in one line (where, and why) before any work starts."""


def reach(url: str, *, create: bool = True) -> None:
    """Connect once, so that a store that cannot be reached ends a command in one line rather than in the
    middle of its work. `create=False` for the store's readers: to them a SQLite file that does not exist
    is no store, and connecting would leave an empty one behind."""
    path = _sqlite_file(url)
    if not create and path is not None and not path.exists():
        raise StoreUnreachable(f"no store at {display_url(url)}: {path.resolve()} does not exist")
    engine = make_engine(url)
    try:
        _connect(engine, url).close()
    finally:
        engine.dispose()


def _sqlite_file(url: str) -> Path | None:
    """The file of a SQLite URL (None for PostgreSQL and in-memory SQLite)."""
    parsed = make_url(normalize_url(url))
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def _connect(engine: Engine, url: str) -> Connection:
    try:
        return engine.connect()
    except OperationalError as exc:
        raise StoreUnreachable(f"cannot reach the store at {display_url(url)}: {driver_cause(exc)}") from None


def driver_cause(exc: Exception) -> str:
    """The driver's reason in one line (SQLAlchemy wraps it in `orig`), less what a message naming the store
    already says (the host and port)."""
    reason = getattr(exc, "orig", None) or exc
    lines = str(reason).strip().splitlines()
    cause = lines[0] if lines else type(reason).__name__
    cause = cause.removeprefix("connection failed: ")
    cause = re.sub(r'^connection to server at "[^"]*"( \([^)]*\))?, port \d+ failed: ', "", cause)
    cause = re.sub(r"\[Errno -?\d+\] ", "", cause.removeprefix("FATAL:").strip())
    return cause[:1].lower() + cause[1:]


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, *, pool_size: int = 5, writer: bool = False) -> Engine:
    """An engine for `url`; `writer` marks SQLite transactions as writes from their start (BEGIN IMMEDIATE),
    so that they wait for another process's write lock instead of failing when they upgrade to one."""
    url = normalize_url(url)
    if is_sqlite(url):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            json_serializer=_json_dumps,
            json_deserializer=orjson.loads,
        )
        _configure_sqlite(engine, "BEGIN IMMEDIATE" if writer else "BEGIN")
        return engine
    return create_engine(
        _without_jit(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        json_serializer=_json_dumps_nul_free,
        json_deserializer=orjson.loads,
    )


def _without_jit(url: str) -> URL:
    """PostgreSQL's JIT compiler off for the store's sessions: it compiled a group's 8-rollout read for
    250 ms that then ran in under 1 ms (its cost estimate counts a correlated subquery as a table scan);
    every query here reads a few rows by index."""
    parsed = make_url(url)
    options = parsed.query.get("options")
    joined = " ".join([*([options] if isinstance(options, str) else options or []), "-c jit=off"])
    return parsed.update_query_dict({"options": joined})


def _json_dumps(value: object) -> str:
    return orjson.dumps(value).decode()


def _json_dumps_nul_free(value: object) -> str:
    """JSON for PostgreSQL, whose JSONB refuses the NUL character: it is stored as U+FFFD there."""
    dumped = orjson.dumps(value).decode()
    return orjson.dumps(_without_nul(value)).decode() if "\\u0000" in dumped else dumped


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_without_nul(key): _without_nul(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_without_nul(item) for item in value]
    return value


def _configure_sqlite(engine: Engine, begin: str) -> None:
    """WAL for concurrent readers, full fsync on commit, and real transactions (savepoints included).

    Python's sqlite3 module manages BEGIN itself in a way that breaks SAVEPOINT; the driver's implicit
    transactions are switched off and SQLAlchemy emits BEGIN instead.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:  # type: ignore[no-untyped-def]
        # On the driver's connection: SQLAlchemy's statement machinery took ten times as long for this one.
        conn.connection.driver_connection.execute(begin)


@dataclass(frozen=True)
class _Compiled:
    sql: str
    positional: tuple[str, ...] | None
    """Parameter names in placeholder order (SQLite's `?`); None for named placeholders (psycopg's)."""
    fixed: dict[str, Any]
    """The values the statement carries itself (its literals), by parameter name."""
    binds: tuple[tuple[str, Callable[[Any], Any]], ...]
    results: tuple[Callable[[Any], Any] | None, ...]


class DriverStatement:
    """A Core statement compiled once per dialect and executed on the driver's own cursor, inside the
    connection's transaction.

    For the statements every agent call makes (a rollout's state, its creation, the turn's INSERT):
    SQLAlchemy's per-execution machinery (cache lookup, parameter processing, result and event set-up) took
    longer than the driver's execution of them. The conversions are SQLAlchemy's own (each type's bind and
    result processors, for the dialect), and a driver error is raised as `Connection.execute` raises it
    (`IntegrityError`, ...), so callers cannot tell the difference.
    """

    def __init__(self, statement: Executable) -> None:
        self._statement = statement
        self._compiled: dict[tuple[str, tuple[str, ...]], _Compiled] = {}

    def execute(self, conn: Connection, params: Mapping[str, Any]) -> int:
        """Run with `params`; the rows it changed."""
        cursor = self._run(conn, params)
        try:
            return int(cursor.rowcount)
        finally:
            cursor.close()

    def _run(self, conn: Connection, params: Mapping[str, Any]) -> Any:
        """The driver's cursor, having run the statement with `params`."""
        compiled = self._compiled.get((conn.dialect.name, tuple(params))) or self._compile(
            conn.dialect, params
        )
        values = {**compiled.fixed, **params}
        for key, process in compiled.binds:
            values[key] = process(values[key])
        cursor = conn.connection.cursor()
        try:
            if compiled.positional is None:
                cursor.execute(compiled.sql, values)
            else:
                cursor.execute(compiled.sql, tuple(values[key] for key in compiled.positional))
        except conn.dialect.loaded_dbapi.Error as exc:
            raise DBAPIError.instance(
                compiled.sql, dict(params), exc, conn.dialect.loaded_dbapi.Error, dialect=conn.dialect
            ) from exc
        return cursor

    def first(self, conn: Connection, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """The first row of a SELECT, converted as SQLAlchemy converts it; None if there is none."""
        cursor = self._run(conn, params)
        try:
            row = cursor.fetchone()
        finally:
            cursor.close()
        if row is None:
            return None
        results = self._compiled[conn.dialect.name, tuple(params)].results
        return tuple(
            value if process is None else process(value) for process, value in zip(results, row, strict=True)
        )

    def _compile(self, dialect: Dialect, params: Mapping[str, Any]) -> _Compiled:
        """For the dialect, and (an INSERT) the columns `params` gives."""
        compiled = self._statement.compile(dialect=dialect, column_keys=list(params))  # type: ignore[attr-defined]
        binds, fixed = [], {}
        for key, bind in compiled.binds.items():
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if process is not None:
                binds.append((key, process))
            if bind.value is not None:
                fixed[key] = bind.effective_value
        results = (
            tuple(
                column.type.dialect_impl(dialect).result_processor(dialect, None)
                for column in self._statement.selected_columns
            )
            if isinstance(self._statement, Select)
            else ()
        )
        positional = tuple(compiled.positiontup) if compiled.positional else None
        found = _Compiled(compiled.string, positional, fixed, tuple(binds), results)
        self._compiled[dialect.name, tuple(params)] = found
        return found


def migrations_dir() -> str:
    """The migrations: at the top of a source checkout, inside the package when installed from a wheel."""
    checkout = Path(__file__).resolve().parents[1] / "migrations"
    if (checkout / "env.py").is_file():
        return str(checkout)
    return str(resources.files("rollout_store.migrations"))


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", migrations_dir())
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head() or ""


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


_MIGRATION_LOCK = 0x726C_DB00


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate in one transaction. On PostgreSQL, under a lock of the schema's own: replicas started together
    on an empty database migrate one after the other (the later ones find it done) instead of creating the
    same tables at once."""
    engine = make_engine(url)
    try:
        with _connect(engine, url) as conn, conn.begin():
            if conn.dialect.name == "postgresql":
                conn.execute(
                    text("SELECT pg_advisory_xact_lock(:key, hashtext(current_schema()))"),
                    {"key": _MIGRATION_LOCK},
                )
            config = alembic_config(url)
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
    finally:
        engine.dispose()


class SchemaMismatch(RuntimeError):
    pass


def require_current_schema(engine: Engine) -> None:
    """For readers of a gateway's store: fail clearly on an empty or differently migrated database."""
    current, head = current_revision(engine), head_revision()
    if current is None:
        raise SchemaMismatch(
            f"no store at {display_url(engine.url)}: the database is empty (a gateway creates the store when "
            "it starts)"
        )
    if current != head:
        raise SchemaMismatch(
            f"database is at schema revision {current}, this client needs {head}: "
            "run `gateway db upgrade --db URL`"
        )


def ensure_schema(url: str) -> None:
    """Upgrade an empty database; refuse one at another revision (that is `gateway db upgrade`'s job)."""
    engine = make_engine(url)
    try:
        with _connect(engine, url) as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
    head = head_revision()
    if current is None:
        log.info("empty database: creating the schema (revision %s)", head)
        upgrade(url)
    elif current != head:
        raise SchemaMismatch(
            f"database is at schema revision {current}, this gateway needs {head}: "
            "run `gateway db upgrade --db URL`"
        )


def display_url(url: str | URL) -> str:
    """The URL for messages and logs: any password hidden, PostgreSQL's port shown where the URL leaves it to
    the default, and without the session options the store's engine adds (`_without_jit`)."""
    try:
        parsed = make_url(normalize_url(url) if isinstance(url, str) else url)
    except Exception:
        return redacted(str(url))
    if parsed.get_backend_name() == "postgresql":
        port = parsed.port or (5432 if parsed.host else None)
        parsed = parsed.set(drivername="postgresql", port=port).difference_update_query(["options"])
    return parsed.render_as_string(hide_password=True)


def redacted(url: str) -> str:
    """Any URL (a store's, a backend's) as messages and logs show it: the password of its user info hidden as
    `display_url` hides it (`user:***@`), whether or not the rest parses: a URL refused for its port is still
    named in the refusal."""
    return _PASSWORD.sub(r"\1***@", url, count=1)


_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/?#@]*:)[^@]*@")
"""A URL's `scheme://user:` and its password up to the `@` (a password may hold a raw `/`, as SQLAlchemy
reads it)."""
