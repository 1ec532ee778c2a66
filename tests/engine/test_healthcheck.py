"""The image's HEALTHCHECK probes the port the gateway listens on (GATEWAY_PORT, read when the check runs):
its command, as the Dockerfile has it, run by a shell as Docker runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.process import refusing_port

from support import TIMEOUT
from support.gateways import GatewayThread

pytestmark = pytest.mark.engine

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def healthcheck() -> str:
    """The HEALTHCHECK's command (shell form), its continued lines joined."""
    joined = DOCKERFILE.read_text().replace("\\\n", " ")
    found = re.search(r"^HEALTHCHECK .*?\bCMD +(.+)$", joined, re.M)
    assert found is not None, "the Dockerfile has no HEALTHCHECK with a command"
    return found.group(1)


def check(port: int) -> int:
    """The check's exit status with GATEWAY_PORT set to `port` (0 healthy, anything else not)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python`: this environment's
    env = {**os.environ, "GATEWAY_PORT": str(port), "PATH": path}
    return subprocess.run(
        ["sh", "-c", healthcheck()], env=env, capture_output=True, timeout=TIMEOUT
    ).returncode


def test_the_images_healthcheck_probes_the_port_gateway_port_names(tmp_path):
    gateway = GatewayThread(
        [f"http://127.0.0.1:{refusing_port()}"],
        f"sqlite:///{tmp_path / 'gateway.db'}",
        log_path=tmp_path / "log",
    ).start()
    try:
        assert (check(gateway.port), check(refusing_port())) == (0, 1)
    finally:
        gateway.stop()
