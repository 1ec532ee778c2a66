"""Common mistakes end `gateway` and `trainer-client` in one line, `PROG: error: WHAT`, never a traceback:
exit 2 for what the command line, the environment or the configuration file says, 1 for what the command met
(a store it cannot reach or that is not there, a port already taken). Secrets stay out of the lines."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli import main as gateway
from rollout_store.database import ensure_schema
from trainer_client.cli import main as trainer_client

ACCEPTED = "use sqlite:///PATH, postgresql://USER@HOST/DB (or postgresql+psycopg://...)"
LEVELS = "'critical', 'error', 'warning', 'info', 'debug', 'trace'"
TRAINER_COMMANDS = [
    ["stats"],
    ["export", "-o", "samples.jsonl"],
    ["score", "--teacher", "http://127.0.0.1:9", "--model", "teacher"],
    ["eval"],
    ["tail"],
]


def stopped(command, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str]:
    """The exit code and standard error of a command stopped by a usage error (argparse's way: SystemExit)."""
    with pytest.raises(SystemExit) as stop:
        command(argv)
    return stop.value.code, capsys.readouterr().err


def failed(command, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit code and standard error of a command that stopped at what it met."""
    code = command(argv)
    return code, capsys.readouterr().err


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound but not listening: connections to it are refused, and no other program takes it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another program listens on."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        yield listening.getsockname()[1]


@pytest.fixture
def in_empty_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


UNRESOLVED = (
    "cannot reach the store at postgresql://nohost:5432/x: failed to resolve host 'nohost': Name or service "
    "not known"
)


def test_an_unresolvable_database_host_is_one_line_in_every_command(
    capsys: pytest.CaptureFixture[str], in_empty_dir: Path
):
    url = "postgresql://nohost/x"

    assert failed(gateway, ["serve", "--db", url, "--port", "0"], capsys) == (
        1,
        f"gateway serve: error: {UNRESOLVED}\n",
    )
    assert failed(gateway, ["db", "upgrade", "--db", url], capsys) == (
        1,
        f"gateway db upgrade: error: {UNRESOLVED}\n",
    )
    assert failed(gateway, ["db", "current", "--db", url], capsys) == (
        1,
        f"gateway db current: error: {UNRESOLVED}\n",
    )
    for argv in TRAINER_COMMANDS:
        assert failed(trainer_client, [*argv, "--db", url], capsys) == (
            1,
            f"trainer-client {argv[0]}: error: {UNRESOLVED}\n",
        )
    assert list(in_empty_dir.iterdir()) == []


def test_a_refused_database_port_is_one_line_without_the_password(
    capsys: pytest.CaptureFixture[str], closed_port: int
):
    url = f"postgresql://postgres:hunter2@127.0.0.1:{closed_port}/test"
    shown = f"postgresql://postgres:***@127.0.0.1:{closed_port}/test"
    line = f"cannot reach the store at {shown}: connection refused"

    assert failed(gateway, ["serve", "--db", url, "--port", "0"], capsys) == (
        1,
        f"gateway serve: error: {line}\n",
    )
    assert failed(gateway, ["db", "upgrade", "--db", url], capsys) == (
        1,
        f"gateway db upgrade: error: {line}\n",
    )
    assert failed(gateway, ["db", "current", "--db", url], capsys) == (
        1,
        f"gateway db current: error: {line}\n",
    )
    for argv in TRAINER_COMMANDS:
        assert failed(trainer_client, [*argv, "--db", url], capsys) == (
            1,
            f"trainer-client {argv[0]}: error: {line}\n",
        )


def test_a_database_url_that_does_not_parse_is_one_line_without_the_password(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    url = "postgresql://user:S3CRET@db:54x2/gw"
    why = f"'postgresql://user:***@db:54x2/gw' is not a database URL; {ACCEPTED}"
    config = tmp_path / "gateway.yaml"
    config.write_text(f"db: {url}\n")

    assert stopped(gateway, ["serve", "--db", url], capsys) == (2, f"gateway serve: error: --db: {why}\n")
    assert stopped(gateway, ["serve", "--config", str(config)], capsys) == (
        2,
        f"gateway serve: error: {config}: db: {why}\n",
    )
    assert stopped(gateway, ["db", "upgrade", "--db", url], capsys) == (
        2,
        f"gateway db upgrade: error: --db: {why}\n",
    )
    assert stopped(trainer_client, ["stats", "--config", str(config)], capsys) == (
        2,
        f"trainer-client stats: error: {config}: db: {why}\n",
    )


@pytest.mark.parametrize("key", [[], ["--backend-api-key", "k"]], ids=["alone", "with --backend-api-key"])
def test_a_backend_url_with_user_info_is_one_line_without_the_password(
    key: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    url = "http://user:S3CRET@127.0.0.1:9"
    why = (
        "http://user:***@127.0.0.1:9: a backend URL's user info is not sent to the server; "
        "give the gateway's credentials with --backend-api-key (vLLM's --api-key)"
    )
    config = tmp_path / "gateway.yaml"
    config.write_text(f"backend: [{url}]\n")
    serve = ["serve", "--db", f"sqlite:///{tmp_path}/gateway.db", "--port", "0", *key]

    assert stopped(gateway, [*serve, "--backend", url], capsys) == (
        2,
        f"gateway serve: error: --backend: {why}\n",
    )
    assert stopped(gateway, [*serve, "--config", str(config)], capsys) == (
        2,
        f"gateway serve: error: {config}: backend: {why}\n",
    )
    monkeypatch.setenv("GATEWAY_BACKEND", f"http://127.0.0.1:8,{url}")
    assert stopped(gateway, serve, capsys) == (2, f"gateway serve: error: GATEWAY_BACKEND: {why}\n")
    assert list(tmp_path.iterdir()) == [config]  # refused before the store is made


def test_an_unreachable_teacher_is_one_line_without_the_password(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, closed_port: int
):
    store = f"sqlite:///{tmp_path}/gateway.db"
    ensure_schema(store)
    teacher = f"http://user:S3CRET@127.0.0.1:{closed_port}"
    score = ["score", "--db", store, "--teacher", teacher, "--model", "teacher"]

    assert failed(trainer_client, score, capsys) == (
        1,
        f"trainer-client score: error: http://user:***@127.0.0.1:{closed_port}/v1/models: "
        "ConnectError('[Errno 111] Connection refused')\n",
    )


def test_a_postgresql_url_without_the_postgres_extra_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setitem(
        sys.modules, "psycopg", None
    )  # as an install without psycopg finds it: not importable
    url = "postgresql://postgres@127.0.0.1:5432/test"
    why = "a PostgreSQL store needs the postgres extra: pip install 'rl-gateway[postgres]'"

    assert stopped(gateway, ["serve", "--db", url], capsys) == (2, f"gateway serve: error: --db: {why}\n")
    assert stopped(gateway, ["db", "upgrade", "--db", url], capsys) == (
        2,
        f"gateway db upgrade: error: --db: {why}\n",
    )
    assert stopped(trainer_client, ["stats", "--db", url], capsys) == (
        2,
        f"trainer-client stats: error: --db: {why}\n",
    )


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("postgresql+asyncpg://user@host/db", "the store cannot use 'postgresql+asyncpg' URLs"),
        ("sqlite+aiosqlite:///x.db", "the store cannot use 'sqlite+aiosqlite' URLs"),
        ("mysql://user@host/db", "the store cannot use 'mysql' URLs"),
        ("gateway.db", "'gateway.db' is not a database URL"),
    ],
)
def test_an_unusable_database_url_is_one_line_naming_the_urls_the_store_takes(
    url: str, why: str, capsys: pytest.CaptureFixture[str]
):
    assert stopped(gateway, ["serve", "--db", url], capsys) == (
        2,
        f"gateway serve: error: --db: {why}; {ACCEPTED}\n",
    )
    assert stopped(gateway, ["db", "upgrade", "--db", url], capsys) == (
        2,
        f"gateway db upgrade: error: --db: {why}; {ACCEPTED}\n",
    )
    assert stopped(trainer_client, ["stats", "--db", url], capsys) == (
        2,
        f"trainer-client stats: error: --db: {why}; {ACCEPTED}\n",
    )


def test_an_unknown_log_level_lists_the_valid_ones(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    assert stopped(gateway, ["serve", "--log-level", "verbose"], capsys) == (
        2,
        f"gateway serve: error: argument --log-level: invalid choice: 'verbose' (choose from {LEVELS})\n",
    )
    monkeypatch.setenv("GATEWAY_LOG_LEVEL", "verbose")
    assert stopped(gateway, ["serve"], capsys) == (
        2,
        "gateway serve: error: GATEWAY_LOG_LEVEL: Input should be 'critical', 'error', 'warning', 'info', "
        "'debug' or 'trace'\n",
    )


def test_several_workers_or_heartbeats_on_sqlite_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    db = f"sqlite:///{tmp_path}/gateway.db"

    assert stopped(gateway, ["serve", "--workers", "2", "--db", db], capsys) == (
        2,
        "gateway serve: error: --workers: several workers need a PostgreSQL store (--db postgresql://...): "
        "SQLite takes one writer\n",
    )
    assert stopped(gateway, ["serve", "--process-timeout", "3", "--db", db], capsys) == (
        2,
        "gateway serve: error: --process-timeout: for gateway processes sharing a PostgreSQL store; a SQLite "
        "store has one process\n",
    )


def test_a_port_already_taken_is_one_line_naming_it_before_the_store_is_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], taken_port: int
):
    store = tmp_path / "gateway.db"

    assert failed(gateway, ["serve", "--port", str(taken_port), "--db", f"sqlite:///{store}"], capsys) == (
        1,
        f"gateway serve: error: cannot listen on 127.0.0.1:{taken_port}: address already in use\n",
    )
    assert not store.exists()


def test_a_usage_mistake_is_one_line_without_the_usage_and_comes_before_the_store(
    capsys: pytest.CaptureFixture[str], in_empty_dir: Path
):
    score = ["score", "--teacher", "http://127.0.0.1:9", "--model", "teacher"]

    assert stopped(gateway, ["serve", "--port", "eighty"], capsys) == (
        2,
        "gateway serve: error: argument --port: invalid int value: 'eighty'\n",
    )
    assert stopped(trainer_client, ["export"], capsys) == (
        2,
        "trainer-client export: error: the following arguments are required: --output/-o\n",
    )
    assert stopped(trainer_client, [*score, "--since", "yesterday"], capsys) == (
        2,
        "trainer-client score: error: argument --since: 'yesterday' is neither ISO 8601 nor seconds\n",
    )
    assert stopped(trainer_client, [*score, "--batch-tokens", "0"], capsys) == (
        2,
        "trainer-client score: error: argument --batch-tokens: must be at least 1\n",
    )
    assert stopped(trainer_client, ["export", "--format", "hf", "-o", "-"], capsys) == (
        2,
        "trainer-client export: error: --format hf writes a directory: give it with -o DIR\n",
    )
    assert stopped(trainer_client, ["export", "--format", "hf", "-o", "out", "--group-id", "g"], capsys) == (
        2,
        "trainer-client export: error: --format hf writes every ready group: --group-id and --since take "
        "jsonl or parquet\n",
    )
    assert list(in_empty_dir.iterdir()) == []


def test_an_unknown_revision_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    upgrade = ["db", "upgrade", "--db", f"sqlite:///{tmp_path}/gateway.db", "--revision", "nope"]

    assert stopped(gateway, upgrade, capsys) == (
        2,
        "gateway db upgrade: error: --revision: Can't locate revision identified by 'nope'\n",
    )


def test_a_store_that_is_not_there_is_one_line_and_is_not_created(
    capsys: pytest.CaptureFixture[str], in_empty_dir: Path
):
    for argv in TRAINER_COMMANDS:
        assert failed(trainer_client, argv, capsys) == (
            1,
            f"trainer-client {argv[0]}: error: no store at sqlite:///gateway.db: "
            f"{in_empty_dir}/gateway.db does not exist\n",
        )
    assert list(in_empty_dir.iterdir()) == []


def test_an_empty_database_is_no_store(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    empty = tmp_path / "empty.db"
    empty.touch()

    assert failed(trainer_client, ["stats", "--db", f"sqlite:///{empty}"], capsys) == (
        1,
        f"trainer-client stats: error: no store at sqlite:///{empty}: the database is empty (a gateway "
        "creates the store when it starts)\n",
    )


def test_the_store_is_the_db_flag_then_gateway_db_then_the_config_files_db_then_gateway_db_file(
    capsys: pytest.CaptureFixture[str], in_empty_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    (in_empty_dir / "gateway.yaml").write_text("db: sqlite:///from-file.db\nmax_turns: 3\n")

    def named(*argv: str) -> str:
        """The store the command looked for (none of them exists)."""
        assert trainer_client(["stats", *argv]) == 1
        return capsys.readouterr().err.split(": ")[2]

    assert named() == "no store at sqlite:///gateway.db"
    assert named("--config", "gateway.yaml") == "no store at sqlite:///from-file.db"
    monkeypatch.setenv("GATEWAY_CONFIG", "gateway.yaml")
    assert named() == "no store at sqlite:///from-file.db"
    monkeypatch.setenv("GATEWAY_DB", "sqlite:///from-variable.db")
    assert named() == "no store at sqlite:///from-variable.db"
    assert named("--db", "sqlite:///from-flag.db") == "no store at sqlite:///from-flag.db"


def test_the_config_files_store_is_read(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    store = tmp_path / "store.db"
    ensure_schema(f"sqlite:///{store}")
    (tmp_path / "gateway.yaml").write_text(f"db: sqlite:///{store}\n")

    assert trainer_client(["stats", "--json", "--config", str(tmp_path / "gateway.yaml")]) == 0
    assert '"rollouts"' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("- db\n", "not a mapping of settings (`name: value` lines)"),
        ("db: [sqlite:///x.db]\n", "db: not a database URL"),
        ("db: mysql://x/y\n", f"db: the store cannot use 'mysql' URLs; {ACCEPTED}"),
    ],
)
def test_a_config_file_trainer_client_cannot_use_is_one_line(
    text: str, error: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    path = tmp_path / "gateway.yaml"
    path.write_text(text)

    assert stopped(trainer_client, ["stats", "--config", str(path)], capsys) == (
        2,
        f"trainer-client stats: error: {path}: {error}\n",
    )
