"""Load and soak: many concurrent agent sessions for minutes, against a vLLM-shaped upstream that answers
instantly, on SQLite and PostgreSQL.

    scripts/dev shell -c 'python bench/soak.py --minutes 10 --sessions 500 --turns 20'
    scripts/dev shell -c 'python bench/soak.py --store postgresql --workers 2 --stream --sessions 2000 \\
                          --minutes 10 --turns 20 --reply-tokens 64'

Each session creates a rollout, makes `--turns` chat calls of a growing conversation (each request sends the
history back with the previous reply, as agents do), finishes the rollout with a reward, and starts over,
until the time is up (a rollout the deadline interrupts is finished early). The upstream, a child process
accepting connections with a backlog as deep as vLLM's, answers as bench/fake_vllm.py (64 tokens a reply)
or, with `--stream`, as bench/stream_load.py's streaming upstream (`--reply-tokens` a reply, one chunk per
token, with ids and logprobs as vLLM sends them); a streamed call counts as answered only with status 200,
the stream's `data: [DONE]` and no error event. With `--workers N` the gateway runs as `gateway serve
--workers N` (PostgreSQL only) and its memory is the sum over its worker processes.

Reported per store: errors (must be 0, with their status and message), turns answered against turns stored
with status ok (must be equal), p50/p99 latency per call (the whole call; streamed, also the time to the
first token), calls and tokens per second, and the gateway's resident memory after the warm-up
(`--warmup-seconds`), in the middle and at the end of the run (must stay flat: the end within 10% of the
value after the warm-up). A progress line every 15 s. Load generator, upstream and gateway share the
machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shlex
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import fake_vllm
import orjson
import sqlalchemy as sa
import stream_load

from rollout_store.database import make_engine
from testbed.launcher import GatewayProcess
from testbed.process import ManagedProcess

POSTGRES_URL = os.environ.get("GATEWAY_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
SYSTEM = "You are a coding agent. " + " ".join(f"word{i % 97}" for i in range(1400))
FLAT = 0.10
"""How much the gateway's memory may grow from the end of the warm-up to the end of the run."""
PROGRESS_SECONDS = 15.0
UPSTREAM_BACKLOG = 4096
"""Connections the upstream lets wait to be accepted (vLLM's uvicorn: 2048). asyncio's default, 100, drops the
connections of a gateway that opens one per session at once, and the gateway times out connecting."""


@dataclass
class Tally:
    answered: int = 0
    errors: int = 0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    """Each error's kind (status and message) and how often it happened."""

    def error(self, kind: str) -> None:
        self.errors += 1
        self.kinds[kind[:300]] += 1


class Connection(stream_load.Connection):
    """bench/stream_load.py's raw keep-alive client, with the soak's streamed call."""

    async def stream(self, path: str, body: bytes, tally: Tally, started: float) -> str | None:
        """A streamed call: None when answered (200, `[DONE]`, no error event), else what went wrong. Counts
        the tokens received (events that carry content) and the time to the first one."""
        status, length = await self.request(path, body)
        if status != 200 or length is not None:
            return f"{status}: {(await self.body(length))[:200].decode(errors='replace')}"
        done = False
        error: str | None = None
        tokens = 0
        tail = b""
        while (data := await self.chunk()) is not None:
            content = data.count(b'"content":"') - data.count(b'"content":""')
            if content and not tokens:
                tally.first_token.append((time.perf_counter() - started) * 1000)
            tokens += content
            events = tail + data
            if b'data: {"error"' in events:
                at = events.index(b'data: {"error"')
                error = "200, error event: " + events[at + 6 : events.find(b"\n", at)].decode(
                    errors="replace"
                )
            done = done or b"data: [DONE]" in events
            tail = events[-16:]
        tally.tokens += tokens
        if error:
            return error
        return None if done else "200 without data: [DONE]"


async def session(port: int, args: argparse.Namespace, deadline: float, tally: Tally) -> None:
    reply = {"role": "assistant", "content": "x" * (args.reply_tokens if args.stream else 200)}
    connection = Connection(port)
    await connection.open()
    while time.monotonic() < deadline:
        try:
            status, created = await connection.post(
                "/rollouts", orjson.dumps({"group_id": uuid.uuid4().hex[:8]})
            )
            if status != 201:
                tally.error(f"POST /rollouts {status}: {created[:200].decode(errors='replace')}")
                await asyncio.sleep(1.0)
                continue
            rollout = orjson.loads(created)["rollout_id"]
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the bug."}]
            path = f"/rollouts/{rollout}/v1/chat/completions"
            for _ in range(args.turns):
                if time.monotonic() >= deadline:
                    break
                request = {"model": "tiny", "messages": messages, "max_tokens": args.reply_tokens}
                started = time.perf_counter()
                if args.stream:
                    failure = await connection.stream(
                        path, orjson.dumps({**request, "stream": True}), tally, started
                    )
                else:
                    status, answer = await connection.post(path, orjson.dumps(request))
                    failure = None if status == 200 else f"{status}: {answer[:200].decode(errors='replace')}"
                tally.latencies.append((time.perf_counter() - started) * 1000)
                if failure is None:
                    tally.answered += 1
                else:
                    tally.error(f"chat {failure}")
                messages = [*messages, reply, {"role": "user", "content": "Continue."}]
            status, finished = await connection.post(f"/rollouts/{rollout}/finish", b'{"reward": 1.0}')
            if status != 200:
                tally.error(f"finish {status}: {finished[:200].decode(errors='replace')}")
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
            tally.error(f"connection: {exc!r}")
            connection.close()
            await asyncio.sleep(1.0)
            await connection.open()
    connection.close()


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def children(pid: int) -> list[int]:
    """The processes `pid` started (a `--workers` supervisor's workers)."""
    found: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found.update(int(c) for c in (task / "children").read_text().split())
        return sorted(found)
    except OSError:  # no /proc/<pid>/task/*/children (CONFIG_PROC_CHILDREN): walk /proc
        pass
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.add(int(entry.name))
    return sorted(found)


def workers(gateway: GatewayProcess, count: int) -> list[int]:
    """The processes serving calls: the gateway itself, or its workers (not multiprocessing's helpers)."""
    if count <= 1:
        return [gateway.pid]
    pids = []
    for pid in children(gateway.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in command:
            pids.append(pid)
    return pids


def gateway_rss(gateway: GatewayProcess, count: int) -> tuple[float, list[float], list[int]]:
    pids = workers(gateway, count)
    each = [rss_mb(pid) for pid in pids]
    return sum(each), each, pids


async def soak(gateway: GatewayProcess, args: argparse.Namespace) -> tuple[Tally, list[float], float, str]:
    assert gateway.port is not None
    tally = Tally()
    seconds = args.minutes * 60
    warmup = min(args.warmup_seconds, seconds / 4)
    idle, _, pids_at_start = gateway_rss(gateway, args.workers)
    print(f"  gateway idle: {idle:.0f} MB (pids {pids_at_start})", flush=True)
    started = time.monotonic()
    deadline = started + seconds
    sessions = [
        asyncio.create_task(session(gateway.port, args, deadline, tally)) for _ in range(args.sessions)
    ]
    memory: list[float] = []
    while not all(task.done() for task in sessions):
        elapsed = time.monotonic() - started
        await asyncio.wait(sessions, timeout=PROGRESS_SECONDS - elapsed % PROGRESS_SECONDS)
        elapsed = time.monotonic() - started
        total, each, pids = gateway_rss(gateway, args.workers)
        if (not memory and elapsed >= warmup) or (len(memory) == 1 and elapsed >= seconds / 2):
            memory.append(total)
        print(
            f"  {elapsed:5.0f} s: {tally.answered} calls answered, {tally.errors} errors, "
            f"gateway {total:.0f} MB"
            + (f" ({' + '.join(f'{m:.0f}' for m in each)})" if len(each) > 1 else ""),
            flush=True,
        )
    await asyncio.gather(*sessions)
    elapsed = time.monotonic() - started
    total, each, pids = gateway_rss(gateway, args.workers)
    memory = [*memory, *[float("nan")] * (2 - len(memory)), total]
    restarted = "" if pids == pids_at_start else f"gateway processes changed: {pids_at_start} -> {pids}"
    return tally, memory, elapsed, restarted


async def serve_upstream(port: int, stream: bool, tokens: int) -> None:
    """The upstream (this script's child process): bench/fake_vllm.py's, or bench/stream_load.py's streaming
    one, accepting with a backlog as deep as vLLM's."""
    protocol: type[asyncio.Protocol] = fake_vllm.Upstream
    if stream:
        stream_load.StreamingUpstream.chunks = stream_load.stream_chunks(tokens)
        protocol = stream_load.StreamingUpstream
    server = await asyncio.get_running_loop().create_server(
        protocol, "127.0.0.1", port, backlog=UPSTREAM_BACKLOG
    )
    async with server:
        await server.serve_forever()


def start_upstream(work: Path, stream: bool, tokens: int) -> tuple[ManagedProcess, int]:
    return fake_vllm.start_child(
        work,
        lambda port: [
            __file__,
            "--serve-upstream",
            str(port),
            "--reply-tokens",
            str(tokens),
            *(["--stream"] if stream else []),
        ],
        "streaming upstream" if stream else "fake upstream",
    )


def stored_ok_turns(db_url: str) -> int:
    engine = make_engine(db_url)
    with engine.connect() as conn:
        count = conn.execute(sa.text("SELECT COUNT(*) FROM turns WHERE status = 'ok'")).scalar_one()
    engine.dispose()
    return int(count)


def raise_file_limit(needed: int) -> None:
    """Each session holds a connection: lift the soft limit on open files to the hard one if it is short (the
    gateway and the upstream, started afterwards, inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if soft != resource.RLIM_INFINITY and soft < needed:
        print(f"warning: {soft} open files allowed, {needed} wanted", file=sys.stderr)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="duration of each run (default: %(default)s)"
    )
    parser.add_argument(
        "--sessions", type=int, default=500, help="concurrent agent sessions (default: %(default)s)"
    )
    parser.add_argument("--turns", type=int, default=20, help="calls per rollout (default: %(default)s)")
    parser.add_argument(
        "--store", choices=("sqlite", "postgresql", "both"), default="both", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--stream", action="store_true", help='stream every call ("stream": true) and read its events'
    )
    parser.add_argument(
        "--reply-tokens",
        type=int,
        default=64,
        help="tokens in each streamed reply (with --stream; bench/fake_vllm.py always answers 64) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway worker processes (`gateway serve --workers N`; more than 1 needs --store postgresql) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        help="the gateway's --max-connections: calls each worker has at the upstream at once, the others "
        "wait in its queue (default: --sessions, none wait)",
    )
    parser.add_argument(
        "--gateway-args",
        default="",
        help='more `gateway serve` flags, as one string (e.g. "--process-timeout 30")',
    )
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=30.0,
        help="memory is first measured after this much load (at most a quarter of the run) "
        "(default: %(default)s)",
    )
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)  # the upstream's own process
    args = parser.parse_args()
    if args.serve_upstream:
        asyncio.run(serve_upstream(args.serve_upstream, args.stream, args.reply_tokens))
        return 0
    if args.workers > 1 and args.store != "postgresql":
        parser.error("--workers needs --store postgresql: SQLite takes one writer")
    if not args.stream and args.reply_tokens != fake_vllm.COMPLETION_TOKENS:
        parser.error(
            f"--reply-tokens needs --stream (bench/fake_vllm.py answers {fake_vllm.COMPLETION_TOKENS})"
        )
    raise_file_limit(3 * args.sessions * max(args.workers, 1) + 1024)

    work = Path(tempfile.mkdtemp(prefix="gateway-soak-"))
    upstream, upstream_port = start_upstream(work, args.stream, args.reply_tokens)
    stores = {}
    if args.store in ("sqlite", "both"):
        stores["SQLite"] = f"sqlite:///{work / 'soak.db'}"
    admin = make_engine(POSTGRES_URL)
    schema = f"gw_soak_{uuid.uuid4().hex[:8]}"
    if args.store in ("postgresql", "both"):
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
        stores["PostgreSQL"] = f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    mode = (
        f"streamed, {args.reply_tokens} tokens a reply" if args.stream else "not streamed, 64 tokens a reply"
    )
    print(
        f"{args.sessions} sessions x {args.turns} turns a rollout, {mode}, {args.minutes:g} min per store, "
        f"{args.workers} gateway process{'es' if args.workers > 1 else ''}"
        + (f" ({args.gateway_args})" if args.gateway_args else "")
        + f" (logs in {work})\n"
    )
    results = []
    try:
        for name, db_url in stores.items():
            print(f"{name}:")
            flags = ["--max-connections", str(args.max_connections or args.sessions)]
            if args.workers > 1:
                flags += ["--workers", str(args.workers)]
            flags += shlex.split(args.gateway_args)
            with GatewayProcess(
                [f"http://127.0.0.1:{upstream_port}"], db_url, log_path=work / f"{name}.log", extra_args=flags
            ) as gateway:
                tally, memory, elapsed, restarted = asyncio.run(soak(gateway, args))
            stored = stored_ok_turns(db_url)
            results.append((name, tally, stored, elapsed, memory, restarted))
    finally:
        upstream.stop()
        if args.store in ("postgresql", "both"):
            with admin.begin() as conn:
                conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        admin.dispose()

    ttft = "  TTFT p50  TTFT p99" if args.stream else ""
    print(
        f"\n{'store':<11} {'errors':>6} {'answered':>9} {'stored':>9} {'p50 ms':>7} {'p99 ms':>8}{ttft} "
        f"{'calls/s':>8} {'tokens/s':>9}  gateway RSS MB (after warm-up, middle, end; growth)"
    )
    failed = False
    for name, tally, stored, elapsed, memory, restarted in results:
        growth = memory[-1] / memory[0] - 1
        first = (
            f" {percentile(tally.first_token, 0.5):>9.1f} {percentile(tally.first_token, 0.99):>9.1f}"
            if args.stream
            else ""
        )
        tokens = tally.tokens if args.stream else tally.answered * fake_vllm.COMPLETION_TOKENS
        print(
            f"{name:<11} {tally.errors:>6} {tally.answered:>9} {stored:>9} "
            f"{percentile(tally.latencies, 0.5):>7.1f} {percentile(tally.latencies, 0.99):>8.1f}{first} "
            f"{tally.answered / elapsed:>8.0f} {tokens / elapsed:>9.0f}  "
            + ", ".join(f"{m:.0f}" for m in memory)
            + f"; {growth:+.1%}"
        )
        flat = abs(growth) <= FLAT
        failed |= bool(tally.errors) or stored != tally.answered or not flat or bool(restarted)
        if not flat:
            print(f"  memory not flat: {growth:+.1%} from the end of the warm-up to the end")
        if restarted:
            print(f"  {restarted}")
        for kind, count in tally.kinds.most_common(10):
            print(f"  {count} x {kind}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
