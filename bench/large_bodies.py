"""Large agent bodies: the gateway's cost per call as an agent's request grows to what coding-agent harnesses
send (100-400 KB of JSON a call, and more), and whether it grows faster than the body.

    python bench/large_bodies.py [--sizes 64K,256K,1M] [--turns 20] [--concurrency 8] [--seconds 10]
                                 [--repeats 2] [--db sqlite|postgresql] [--stream]
                                 [--py-spy OUT.txt --py-spy-bin PATH --py-spy-seconds 15]

Each of `--concurrency` agents runs rollouts of `--turns` chat calls, as a harness does: the first call sends
a system prompt, tool definitions and a task; every later call sends the whole history back with the
previous reply (its text and tool call, as the upstream answered them) and a new tool result (a mix of file
contents, test runs, grep hits, diffs and listings). The history grows linearly, so that the last call's
body is about the named size. Rollouts are created with `POST /rollouts` and finished with a reward.

The upstream (`LargeUpstream`, a child process) answers at once, as vLLM does with `return_token_ids` and
`logprobs`: a reply with a tool call, 64 sampled ids and their logprobs, and one prompt id per 4 bytes of the
request (its bytes read as ids, so that a turn's prompt ids extend the previous turn's prompt as a
tokenizer's would, up to the previous reply); streamed (`--stream`) as a first event with the prompt's ids,
one event per sampled token, the tool call, the finish and the usage.

For every size, each of `--repeats` measured phases runs for `--seconds` (the agents finish the rollout in
progress); the repeats are interleaved across sizes, after a warm-up of one rollout per agent. Printed per
phase: calls/s, the gateway process's CPU per call (user + system from /proc; its event loop's thread and
its other threads, the store writer above all, apart), CPU per KB of request body (the mean body of the
phase's calls), p50/p99 latency, the mean and last body, the ratios of CPU per call and of mean body to the
smallest size's first phase, the CPU per call of the upstream, of the load generator and (PostgreSQL) of
the machine's `postgres` processes, and the gateway's RSS; then per size the mean over the repeats, +- half
their range. Then, from the store: every answered turn stored, each later turn linked to its parent, and
how many bytes of messages and prompt ids a turn stores (delta storage).

`--py-spy OUT.txt` runs one more phase at the largest size under `py-spy record --threads --nonblocking -f
raw -r 200` (py-spy is not a dependency: `pip install --target /tmp/pyspy py-spy`, then `--py-spy-bin
/tmp/pyspy/bin/py-spy`) and prints the functions with the most samples, by self and by inclusive time
(time in C code is charged to the Python function that called it; a thread waiting for the GIL, the CPU
or an fsync counts as busy unless `--py-spy-gil` samples only the thread holding the GIL);
`--summarize OUT.txt` prints that summary of an existing raw profile.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fake_vllm
import numpy as np
import orjson
import sqlalchemy as sa
import stream_load

from rollout_store.database import make_engine
from testbed.launcher import GatewayProcess

POSTGRES_URL = os.environ.get("GATEWAY_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
VOCAB = 151_000
TOOL_TOKENS = 16  # of the completion: the tool call's markup and arguments
REPLY_TEXT = (
    "Let me look at this more closely. The failure comes from the request handler, so I will read the "
    "relevant module and run the tests again to see whether the change fixed the regression."
)

# -- the conversation ----------------------------------------------------------------------------------------

WORDS = [
    "request",
    "handler",
    "cache",
    "session",
    "token",
    "parser",
    "config",
    "buffer",
    "stream",
    "record",
    "writer",
    "reader",
    "index",
    "batch",
    "queue",
    "lock",
    "retry",
    "timeout",
    "payload",
    "schema",
    "router",
    "backend",
    "client",
    "server",
    "worker",
    "message",
    "result",
    "state",
    "value",
    "offset",
    "length",
    "digest",
    "prefix",
    "suffix",
    "lineage",
    "commit",
    "engine",
    "metric",
    "policy",
]
MODULES = ["core", "api", "store", "utils", "models", "routing", "workers", "io", "auth", "cli"]


def _name(rng: random.Random) -> str:
    return "_".join(rng.sample(WORDS, 2))


def _camel(rng: random.Random) -> str:
    return "".join(w.capitalize() for w in rng.sample(WORDS, 2))


def _code_line(rng: random.Random) -> str:
    fn, arg, cls = _name(rng), rng.choice(WORDS), _camel(rng)
    return rng.choice(
        [
            f"def {fn}(self, {arg}: {cls} | None = None, *, strict: bool = False) -> dict[str, Any]:",
            f'    """Return the {arg} of the {rng.choice(WORDS)}, or None if it is "{rng.choice(WORDS)}"."""',
            f"    if {arg} is None:",
            f'        raise ValueError(f"{arg} must not be None (got {{{arg}!r}})")',
            f"    result = self._{fn}.get({arg}, default={rng.randint(0, 999)})",
            f"    for index, item in enumerate(self.{arg}s):",
            f'        logger.debug("processing %s (%d of %d)", item, index, len(self.{arg}s))',
            f'    return {{"status": "ok", "{arg}": {arg}, "count": len(result)}}',
            f"class {cls}({_camel(rng)}):",
            f"# TODO: the {arg} can be stale here \u2014 see issue #{rng.randint(100, 9999)}",
            "",
            f"from {rng.choice(MODULES)}.{rng.choice(WORDS)} import {cls}, {fn}",
            f"        self.{arg} = {arg} or {cls}.default()",
            f"    @property\n    def {fn}(self) -> int:\n        return self._{arg}_count",
        ]
    )


def _file_lines(rng: random.Random) -> Iterator[str]:
    """A file as Claude Code's Read tool shows it: numbered lines."""
    number = 0
    while True:
        for line in _code_line(rng).split("\n"):
            number += 1
            yield f"{number:>6}\t{line}"


def _pytest_lines(rng: random.Random) -> Iterator[str]:
    yield "============================= test session starts =============================="
    yield "platform linux -- Python 3.11.9, pytest-8.2.0, pluggy-1.5.0"
    yield f"rootdir: /workspace/project\ncollected {rng.randint(200, 900)} items\n"
    while True:
        if rng.random() < 0.9:
            dots = "".join(rng.choice("......................Fs") for _ in range(rng.randint(10, 60)))
            yield f"tests/unit/test_{_name(rng)}.py {dots:<60} [{rng.randint(1, 99):>3}%]"
        else:
            fn, arg = _name(rng), rng.choice(WORDS)
            yield f"________________________ test_{fn}_handles_{arg} ________________________"
            yield f"    def test_{fn}_handles_{arg}():\n        result = {fn}({arg}={rng.randint(0, 99)})"
            yield f"E       AssertionError: assert {{'{arg}': {rng.randint(0, 9)}}} == {{'{arg}': 1}}"
            yield f"tests/unit/test_{fn}.py:{rng.randint(10, 900)}: AssertionError"


def _grep_lines(rng: random.Random) -> Iterator[str]:
    while True:
        path = f"src/{rng.choice(MODULES)}/{rng.choice(WORDS)}.py"
        yield f"{path}:{rng.randint(1, 2000)}:{_code_line(rng).split(chr(10))[0]}"


def _diff_lines(rng: random.Random) -> Iterator[str]:
    while True:
        path = f"src/{rng.choice(MODULES)}/{rng.choice(WORDS)}.py"
        yield f"diff --git a/{path} b/{path}"
        yield f"index {rng.getrandbits(28):07x}..{rng.getrandbits(28):07x} 100644"
        yield f"--- a/{path}\n+++ b/{path}"
        start = rng.randint(1, 900)
        yield f"@@ -{start},7 +{start},9 @@ def {_name(rng)}(self):"
        for _ in range(rng.randint(4, 14)):
            yield rng.choice(" -++ ") + _code_line(rng).split("\n")[0]


def _ls_lines(rng: random.Random) -> Iterator[str]:
    yield f"total {rng.randint(100, 900)}"
    while True:
        size, day = rng.randint(0, 99999), rng.randint(1, 28)
        name = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}.py"
        hour, minute = rng.randint(0, 23), rng.randint(0, 59)
        yield f"-rw-r--r--  1 agent agent {size:>6} Mar {day:>2} {hour:02}:{minute:02} {name}"


@dataclass(frozen=True)
class ToolKind:
    name: str
    arguments: str  # a template of the call's JSON arguments, `{n}` the turn
    lines: Callable[[random.Random], Iterator[str]]  # the result's lines


KINDS = (
    ToolKind("Read", '{{"file_path": "/workspace/project/src/core/module_{n}.py"}}', _file_lines),
    ToolKind("Bash", '{{"command": "python -m pytest tests/unit -x -q", "timeout": 120000}}', _pytest_lines),
    ToolKind("Grep", '{{"pattern": "def handle_{n}", "path": "src", "output_mode": "content"}}', _grep_lines),
    ToolKind("Bash", '{{"command": "git diff HEAD~{n}", "description": "Show recent changes"}}', _diff_lines),
    ToolKind("Bash", '{{"command": "ls -la src/core/pkg_{n}"}}', _ls_lines),
)


def tool_call(n: int) -> dict[str, Any]:
    """The upstream's tool call in reply to a request holding `n` tool results (what the agent echoes)."""
    kind = KINDS[n % len(KINDS)]
    arguments = kind.arguments.format(n=n)
    return {
        "id": f"call_{n:04d}",
        "type": "function",
        "function": {"name": kind.name, "arguments": arguments},
    }


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)[:1]},
        },
    }


TOOLS = [
    _tool(
        "Bash",
        "Executes a given bash command in a persistent shell session with optional timeout, ensuring proper "
        "handling and security measures. Before executing the command, verify the parent directory exists. "
        "Always quote file paths that contain spaces with double quotes.",
        {
            "command": {"type": "string", "description": "The command to execute"},
            "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
            "description": {"type": "string", "description": "Clear, concise description in 5-10 words"},
        },
    ),
    _tool(
        "Read",
        "Reads a file from the local filesystem. The file_path parameter must be an absolute path. By "
        "default it reads up to 2000 lines starting from the beginning of the file; results are returned "
        "using cat -n format, with line numbers starting at 1.",
        {
            "file_path": {"type": "string", "description": "The absolute path to the file to read"},
            "offset": {"type": "number", "description": "The line number to start reading from"},
            "limit": {"type": "number", "description": "The number of lines to read"},
        },
    ),
    _tool(
        "Edit",
        "Performs exact string replacements in files. You must use your Read tool at least once before "
        "editing. The edit will FAIL if old_string is not unique in the file.",
        {
            "file_path": {"type": "string", "description": "The absolute path to the file to modify"},
            "old_string": {"type": "string", "description": "The text to replace"},
            "new_string": {"type": "string", "description": "The text to replace it with"},
            "replace_all": {"type": "boolean", "default": False},
        },
    ),
    _tool(
        "Grep",
        "A powerful search tool built on ripgrep. Supports full regex syntax; filter files with the glob or "
        "type parameter; output modes: content, files_with_matches, count.",
        {
            "pattern": {"type": "string", "description": "The regular expression to search for"},
            "path": {"type": "string", "description": "File or directory to search in"},
            "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
        },
    ),
    _tool(
        "Glob",
        "Fast file pattern matching tool that works with any codebase size; returns matching file paths "
        "sorted by modification time.",
        {"pattern": {"type": "string"}, "path": {"type": "string"}},
    ),
    _tool(
        "Write",
        "Writes a file to the local filesystem, overwriting the existing file if there is one.",
        {"file_path": {"type": "string"}, "content": {"type": "string"}},
    ),
]


def _system_prompt() -> str:
    rng = random.Random(7)
    rules = [
        f"- When you {rng.choice(WORDS)} the {rng.choice(WORDS)}, always check the {rng.choice(WORDS)} "
        f"first; never {rng.choice(WORDS)} a {rng.choice(WORDS)} without reading it."
        for _ in range(60)
    ]
    return (
        "You are an interactive CLI tool that helps users with software engineering tasks. Use the "
        "instructions below and the tools available to you to assist the user.\n\n# Doing tasks\n"
        + "\n".join(rules)
        + "\n\n<env>\nWorking directory: /workspace/project\nIs directory a git repo: Yes\n"
        + "Platform: linux\n</env>"
    )


SYSTEM = _system_prompt()


class TextPool:
    """Long runs of each kind's tool output, sliced at random lines for each tool result (cheap: the load
    generator shares the machine)."""

    def __init__(self, chars: int, seed: int = 1) -> None:
        self.texts: list[str] = []
        self.starts: list[list[int]] = []
        self.escaping: list[float] = []  # JSON bytes per character of text
        for i, kind in enumerate(KINDS):
            lines, size, starts = [], 0, []
            for line in kind.lines(random.Random(seed + i)):
                starts.append(size)
                lines.append(line)
                size += len(line) + 1
                if size >= chars:
                    break
            text = "\n".join(lines)
            self.texts.append(text)
            self.starts.append(starts)
            self.escaping.append(len(orjson.dumps(text)) / len(text))

    def result(self, n: int, json_bytes: int, rng: random.Random) -> str:
        """A tool result of about `json_bytes` bytes once in JSON, of the kind of turn `n`."""
        k = n % len(KINDS)
        text, starts = self.texts[k], self.starts[k]
        chars = max(16, int(json_bytes / self.escaping[k]))
        if chars >= len(text):
            return (text * (chars // len(text) + 1))[:chars]
        last = len(text) - chars
        start = starts[min(rng.randrange(len(starts)), max(0, int(np.searchsorted(starts, last)) - 1))]
        return text[start : start + chars]


class Conversation:
    """One rollout's history, as a harness builds it: each request is the whole history so far."""

    def __init__(self, pool: TextPool, target: int, turns: int, stream: bool, rng: random.Random) -> None:
        self.pool, self.rng, self.turns, self.stream = pool, rng, turns, stream
        task = f"[{uuid.uuid4().hex}] The request handler drops the last record of a batch. Find and fix it."
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task},
        ]
        self.n = 0
        first = len(self.body())
        self.step = max(0.0, (target - first) / max(1, turns - 1))
        self.first = first

    def body(self) -> bytes:
        head: dict[str, Any] = {"model": "tiny", "stream": self.stream}
        if self.stream:
            head["stream_options"] = {"include_usage": True}
        head.update(max_tokens=4096, temperature=1.0, tools=TOOLS, messages=self.messages)
        return orjson.dumps(head)

    def extend(self, size: int) -> None:
        """Append the reply to the `n`th call and its tool's result, so the next body grows by one step."""
        call = tool_call(self.n)
        self.messages.append({"role": "assistant", "content": REPLY_TEXT, "tool_calls": [call]})
        want = self.first + (self.n + 1) * self.step - size
        reply_bytes = len(orjson.dumps(self.messages[-1])) + 60
        content = self.pool.result(self.n, max(16, int(want - reply_bytes)), self.rng)
        self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        self.n += 1


# -- the upstream --------------------------------------------------------------------------------------------

_MODELS = b'{"object":"list","data":[{"id":"tiny","object":"model","owned_by":"vllm"}]}'
_TEXT_TOKENS = fake_vllm.COMPLETION_TOKENS - TOOL_TOKENS
_PIECES = [
    REPLY_TEXT[i * len(REPLY_TEXT) // _TEXT_TOKENS : (i + 1) * len(REPLY_TEXT) // _TEXT_TOKENS]
    for i in range(_TEXT_TOKENS)
]


def prompt_ids(body: bytes) -> np.ndarray:
    """One id per 4 bytes of the request: a longer history's ids extend a shorter one's."""
    return (np.frombuffer(body, dtype="<u4", count=len(body) // 4) % VOCAB).astype("<i4")


def whole_reply(ids: np.ndarray, n: int) -> bytes:
    message = {"role": "assistant", "content": REPLY_TEXT, "tool_calls": [tool_call(n)], "reasoning": None}
    return fake_vllm.chat_reply(
        message, "tool_calls", ids, fake_vllm.usage(len(ids), fake_vllm.COMPLETION_TOKENS)
    )


def streamed_reply(ids: np.ndarray, n: int) -> list[bytes]:
    """The head and first event (role and prompt ids), then the rest, as two writes."""
    completion = fake_vllm.COMPLETION_IDS
    deltas: list[tuple[dict[str, Any], list[int]]] = [
        ({"content": piece}, [completion[i]]) for i, piece in enumerate(_PIECES)
    ]
    call = tool_call(n)
    opening = {
        "index": 0,
        "id": call["id"],
        "type": "function",
        "function": {"name": call["function"]["name"]},
    }
    arguments = {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
    middle = _TEXT_TOKENS + TOOL_TOKENS // 2
    deltas.append(({"tool_calls": [opening]}, completion[_TEXT_TOKENS:middle]))
    deltas.append(({"tool_calls": [arguments]}, completion[middle:]))
    first, *rest = fake_vllm.stream_events(ids, deltas, "tool_calls")
    return [fake_vllm.STREAM_HEAD + first, b"".join(rest)]


class LargeUpstream(fake_vllm.Requests):
    """Answers each chat call at once (whole or streamed, as asked), anything else with a model list."""

    def answer(self, head: bytes, body: bytes) -> None:
        if not head.startswith(b"post ") or b"chat/completions" not in head.split(b"\r\n", 1)[0]:
            self.transport.write(fake_vllm.http_reply(_MODELS))
            return
        ids, n = prompt_ids(body), body.count(b'"role":"tool"')
        if b'"stream":true' in body[:64]:
            for part in streamed_reply(ids, n):
                self.transport.write(part)
        else:
            self.transport.write(whole_reply(ids, n))


# -- the load ------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    calls: int = 0
    errors: int = 0
    rollouts: int = 0
    body_bytes: int = 0
    last_bodies: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


async def rollout(
    connection: stream_load.Connection, pool: TextPool, args: argparse.Namespace, size: int, tally: Tally
) -> None:
    status, created = await connection.post("/rollouts", orjson.dumps({"group_id": uuid.uuid4().hex[:8]}))
    if status != 201:
        tally.errors += 1
        tally.messages.append(f"POST /rollouts: {status} {created[:200]!r}")
        return
    rollout_id = orjson.loads(created)["rollout_id"]
    conversation = Conversation(pool, size, args.turns, args.stream, random.Random())
    path = f"/rollouts/{rollout_id}/v1/chat/completions"
    body = b""
    for turn in range(args.turns):
        if turn:
            conversation.extend(len(body))
        body = conversation.body()
        started = time.perf_counter()
        status, answer = await connection.post(path, body)
        tally.latencies.append((time.perf_counter() - started) * 1000)
        tally.body_bytes += len(body)
        ok = status == 200 and (not args.stream or answer.endswith(b"data: [DONE]\n\n\r\n"))
        if ok and args.stream:
            ok = b'"error"' not in answer
        if ok:
            tally.calls += 1
        else:
            tally.errors += 1
            tally.messages.append(f"turn {turn}: {status} {answer[-300:]!r}")
    tally.last_bodies.append(len(body))
    status, _ = await connection.post(f"/rollouts/{rollout_id}/finish", b'{"reward": 1.0}')
    tally.errors += status != 200
    tally.rollouts += 1


async def phase(
    port: int, pool: TextPool, args: argparse.Namespace, size: int, seconds: float | None
) -> Tally:
    """`--concurrency` agents starting rollouts until `seconds` have passed (None: one rollout each)."""
    tally = Tally()
    deadline = time.monotonic() + (seconds or 0)

    async def agent() -> None:
        connection = stream_load.Connection(port)
        await connection.open()
        try:
            while True:
                await rollout(connection, pool, args, size, tally)
                if seconds is None or time.monotonic() >= deadline:
                    return
        finally:
            connection.close()

    await asyncio.gather(*(agent() for _ in range(args.concurrency)))
    return tally


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of `pid`'s threads: the event loop's (the main thread) and the others' (the
    store writer's above all; Python does not name its threads for the OS)."""
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = collections.defaultdict(float)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        role = "loop" if tid == str(pid) else "threads"
        found[role] += (int(fields[11]) + int(fields[12])) / ticks
    return found


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_cpu() -> float:
    """CPU seconds of every `postgres` process on the machine (the database server's share of a PostgreSQL
    store; other users of the server count too)."""
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "postgres":
                total += process_cpu(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return total


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Row:
    size: int
    repeat: int
    tally: Tally
    elapsed: float
    cpu: dict[str, float]
    upstream_cpu: float
    client_cpu: float
    database_cpu: float
    rss: float

    @property
    def requests(self) -> int:  # every HTTP call the gateway answered (the turns, and each rollout's 2 more)
        return self.tally.calls + 2 * self.tally.rollouts

    def cpu_ms(self, role: str | None = None) -> float:
        total = sum(self.cpu.values()) if role is None else self.cpu.get(role, 0.0)
        return total * 1000 / max(1, self.tally.calls)

    @property
    def mean_kb(self) -> float:
        return self.tally.body_bytes / max(1, self.tally.calls + self.tally.errors) / 1024


def measure(
    gateway: GatewayProcess,
    upstream_pid: int,
    pool: TextPool,
    args: argparse.Namespace,
    size: int,
    repeat: int,
) -> Row:
    database = postgres_cpu if args.db == "postgresql" else lambda: 0.0
    before, upstream_before, client_before = (
        thread_cpu(gateway.pid),
        process_cpu(upstream_pid),
        time.process_time(),
    )
    database_before = database()
    started = time.perf_counter()
    tally = run_phase(gateway, pool, args, size, args.seconds)
    elapsed = time.perf_counter() - started
    after = thread_cpu(gateway.pid)
    cpu = {role: after[role] - before.get(role, 0.0) for role in after}
    return Row(
        size,
        repeat,
        tally,
        elapsed,
        cpu,
        process_cpu(upstream_pid) - upstream_before,
        time.process_time() - client_before,
        database() - database_before,
        rss_mb(gateway.pid),
    )


def run_phase(
    gateway: GatewayProcess, pool: TextPool, args: argparse.Namespace, size: int, seconds: float | None
) -> Tally:
    """`phase` against the running gateway, from the synchronous main (an event loop a phase: nothing of the
    load generator's outlives it)."""
    assert gateway.port is not None, "started"
    return asyncio.run(phase(gateway.port, pool, args, size, seconds))


def measure_all(
    gateway: GatewayProcess, upstream_pid: int, pool: TextPool, args: argparse.Namespace, sizes: list[int]
) -> list[Row]:
    """The measured phases, each printed as it ends (with its first errors): the repeats interleaved across
    the sizes, so that a drift of the machine's speed reaches every size alike."""
    rows: list[Row] = []
    print(HEADER)
    for repeat in range(1, args.repeats + 1):
        for size in sizes:
            row = measure(gateway, upstream_pid, pool, args, size, repeat)
            print_row(row, rows[0] if rows else None)
            rows.append(row)
            for message in row.tally.messages[:3]:
                print(f"   error: {message}")
    return rows


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * scale)


def label(size: int) -> str:
    return f"{size // (1024 * 1024)}M" if size % (1024 * 1024) == 0 else f"{size // 1024}K"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


HEADER = (
    f"{'size':>5} {'rep':>3} {'calls':>6} {'calls/s':>8} {'CPU ms/call':>11} {'loop':>6} {'threads':>7} "
    f"{'us/KB':>6} {'p50 ms':>7} {'p99 ms':>7} {'mean KB':>8} {'last KB':>8} {'CPU x':>6} {'body x':>6} "
    f"{'upstr ms':>8} {'client ms':>9} {'db ms':>6} {'RSS MB':>7}"
)


def print_row(row: Row, base: Row | None) -> None:
    """One phase; the ratios against `base`, the smallest size's first phase (None: this is it)."""
    cpu = row.cpu_ms()
    base = base or row
    ratio = f"{cpu / base.cpu_ms():>6.2f} {row.mean_kb / base.mean_kb:>6.2f}"
    last = statistics.mean(row.tally.last_bodies) / 1024 if row.tally.last_bodies else float("nan")
    calls = max(1, row.tally.calls)
    print(
        f"{label(row.size):>5} {row.repeat:>3} {row.tally.calls:>6} {row.tally.calls / row.elapsed:>8.1f} "
        f"{cpu:>11.2f} {row.cpu_ms('loop'):>6.2f} {row.cpu_ms('threads'):>7.2f} "
        f"{cpu * 1000 / row.mean_kb:>6.1f} {percentile(row.tally.latencies, 0.5):>7.1f} "
        f"{percentile(row.tally.latencies, 0.99):>7.1f} {row.mean_kb:>8.1f} {last:>8.1f} {ratio} "
        f"{row.upstream_cpu * 1000 / calls:>8.2f} {row.client_cpu * 1000 / calls:>9.2f} "
        f"{row.database_cpu * 1000 / calls:>6.2f} {row.rss:>7.0f}",
        flush=True,
    )


def summary(rows: list[Row], sizes: list[int]) -> None:
    """Per size: the mean over repeats, with the spread (max - min) of calls/s and CPU per call."""
    print(
        f"\n{'size':>5} {'calls/s':>16} {'CPU ms/call':>16} {'us/KB':>6} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'CPU x':>6} {'body x':>6}"
    )
    base = None
    for size in sizes:
        mine = [r for r in rows if r.size == size]
        rates = [r.tally.calls / r.elapsed for r in mine]
        cpus = [r.cpu_ms() for r in mine]
        kb = statistics.mean(r.mean_kb for r in mine)
        cpu = statistics.mean(cpus)
        base = base or (cpu, kb)
        latencies = [x for r in mine for x in r.tally.latencies]
        print(
            f"{label(size):>5} {statistics.mean(rates):>8.1f} \u00b1{(max(rates) - min(rates)) / 2:>6.1f} "
            f"{cpu:>8.2f} \u00b1{(max(cpus) - min(cpus)) / 2:>6.2f} {cpu * 1000 / kb:>6.1f} "
            f"{percentile(latencies, 0.5):>7.1f} {percentile(latencies, 0.99):>7.1f} "
            f"{cpu / base[0]:>6.2f} {kb / base[1]:>6.2f}"
        )


def check_store(db_url: str, tallies: list[Tally]) -> bool:
    """Every turn answered in the phases of `tallies` stored, each later turn linked to its parent, and what
    a turn stores."""
    answered, rollouts = sum(t.calls for t in tallies), sum(t.rollouts for t in tallies)
    engine = make_engine(db_url)
    messages = "LENGTH(CAST(messages AS TEXT))"
    with engine.connect() as conn:
        stored, linked, message_bytes, id_bytes = conn.execute(
            sa.text(
                "SELECT COUNT(*), COUNT(parent_turn), "
                f"COALESCE(SUM({messages}), 0), COALESCE(SUM(LENGTH(prompt_ids)), 0) "
                "FROM turns WHERE status = 'ok'"
            )
        ).one()
    engine.dispose()
    print(
        f"store: {stored} turns stored of {answered} answered; {linked} linked to a parent "
        f"(expected {answered - rollouts}); per turn {message_bytes / max(1, stored) / 1024:.1f} KB of "
        f"messages, {id_bytes / max(1, stored) / 1024:.1f} KB of prompt ids"
    )
    return bool(stored == answered and linked == answered - rollouts)


@contextmanager
def database(kind: str, work: Path, name: str) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{work / f'{name}.db'}"
        return
    schema = f"gw_large_{uuid.uuid4().hex[:8]}"
    admin = make_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        admin.dispose()


# -- the profile ---------------------------------------------------------------------------------------------


def _frame(frame: str) -> str:
    """`function (path/to/file.py:line)` as `path/to/file.py:function`, the path from the package on."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{name}"


def summarize(raw: Path, top: int) -> None:
    """py-spy's raw (collapsed) stacks by self time and by inclusive time, per thread role and overall."""
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        frames = stack.split(";")
        thread = frames[0] if frames and frames[0].startswith(("thread", "process")) else ""
        frames = [_frame(f) for f in frames if " (" in f]
        if not frames:
            continue
        total += samples
        threads[thread.split(" ")[0] + " " + thread.split(" ")[1] if thread.count(" ") >= 1 else thread] += (
            samples
        )
        self_time[frames[-1]] += samples
        for f in set(frames):
            inclusive[f] += samples
    print(
        f"{total} samples; by thread: "
        + ", ".join(f"{t or '?'} {n / total:.0%}" for t, n in threads.most_common(4))
    )
    print(f"\nself time (top {top}):")
    for name, n in self_time.most_common(top):
        print(f"  {n / total:6.1%}  {name}")
    print(f"\ninclusive time of the gateway's functions (top {top}):")
    shown = 0
    for name, n in inclusive.most_common():
        if name.startswith("gateway/"):
            print(f"  {n / total:6.1%}  {name}")
            shown += 1
            if shown == top:
                break


# -- main ----------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64K,256K,1M", help="last-turn body sizes (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=20, help="calls per rollout (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent agents (default: %(default)s)")
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="length of a measured phase (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="measured phases per size (default: %(default)s)"
    )
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--stream", action="store_true", help="streamed calls (default: whole replies)")
    parser.add_argument("--py-spy", metavar="OUT", help="profile one more phase at the largest size into OUT")
    parser.add_argument("--py-spy-bin", default="py-spy", help="the py-spy executable (default: %(default)s)")
    parser.add_argument("--py-spy-seconds", type=int, default=15)
    parser.add_argument(
        "--py-spy-gil", action="store_true", help="sample only the thread holding the GIL (py-spy --gil)"
    )
    parser.add_argument("--top", type=int, default=25, help="functions shown of a profile")
    parser.add_argument("--summarize", metavar="RAW", help="only summarize an existing raw py-spy profile")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the upstream's own process
    args = parser.parse_args()
    if args.serve:
        asyncio.run(fake_vllm.serve(LargeUpstream, args.serve))
        return 0
    if args.summarize:
        summarize(Path(args.summarize), args.top)
        return 0

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="gateway-large-bodies-"))
    pool = TextPool(max(256 * 1024, 2 * max(sizes) // max(1, args.turns - 1)))
    upstream, port = fake_vllm.start(work, script=__file__, name="large-body upstream")
    assert upstream.process is not None
    mode = "streamed" if args.stream else "whole"
    print(
        f"{args.db}, {mode} replies, {args.concurrency} agents, rollouts of {args.turns} turns, "
        f"{args.repeats} x {args.seconds:g} s per size; CPU per call is the gateway process's (user + "
        f"system; loop: its event loop's thread, threads: the others, the store writer above all); x: ratio "
        f"to the first {label(sizes[0])} row\n"
    )
    try:
        with database(args.db, work, f"large-{mode}") as db_url:
            flags = ["--max-connections", str(4 * args.concurrency)]
            with GatewayProcess(
                [f"http://127.0.0.1:{port}"], db_url, log_path=work / "gateway.log", extra_args=flags
            ) as gateway:
                # warm-up: one rollout per agent
                tallies = [run_phase(gateway, pool, args, size, None) for size in sizes]
                rows = measure_all(gateway, upstream.process.pid, pool, args, sizes)
                summary(rows, sizes)
                tallies += [row.tally for row in rows]
                if args.py_spy:
                    tallies.append(_profiled(gateway, pool, args, sizes[-1]))
            ok = check_store(db_url, tallies) and not any(row.tally.errors for row in rows)
    finally:
        upstream.stop()
    print(f"(logs in {work})")
    return 0 if ok else 1


def _profiled(gateway: GatewayProcess, pool: TextPool, args: argparse.Namespace, size: int) -> Tally:
    py_spy = subprocess.Popen(
        [
            args.py_spy_bin,
            "record",
            "-p",
            str(gateway.pid),
            "-d",
            str(args.py_spy_seconds),
            "-r",
            "200",
            "-f",
            "raw",
            "-o",
            args.py_spy,
            "--nonblocking",
            "--threads",
            *(["--gil"] if args.py_spy_gil else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    tally = run_phase(gateway, pool, args, size, args.py_spy_seconds + 1)
    _, errors = py_spy.communicate()
    if py_spy.returncode:
        print(f"py-spy failed: {errors.decode()[-500:]}")
        return tally
    print(f"\nprofile of {tally.calls} calls at {label(size)}, {args.py_spy}:")
    summarize(Path(args.py_spy), args.top)
    return tally


if __name__ == "__main__":
    sys.exit(main())
