"""`scripts/dev demo --keep`, as a new user runs it: the demo ends on the viewer's address, and the gateway
keeps serving the rollouts it made until the user stops it."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from support import TIMEOUT

pytestmark = pytest.mark.engine


def test_the_demo_ends_on_the_viewer_of_its_rollouts_and_keeps_serving_them_until_stopped(
    model_dir, work_dir
):
    workdir = work_dir / "demo-keep"
    shutil.copytree(model_dir, workdir / "model")  # the demo's own build finds it made
    command = [sys.executable, "-m", "testbed.demo", "--keep", "--workdir", str(workdir)]
    command += ["--groups", "1", "--group-size", "2", "--turns", "1"]
    demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, demo.kill)
    watchdog.start()
    try:
        said = []
        for line in demo.stdout:
            said.append(line.rstrip())
            if line.startswith("The gateway and vLLM stay up"):
                break
        viewer = next(
            line.split(": ", 1)[1] for line in said if line.startswith("The rollouts, token by token: ")
        )

        page = httpx.get(viewer, timeout=TIMEOUT)
        listed = httpx.get(viewer + "/api/rollouts", timeout=TIMEOUT).json()["rollouts"]
        demo.send_signal(signal.SIGTERM)
        rest = demo.stdout.read()
        assert demo.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        demo.kill()

    assert page.status_code == 200 and "/ui/assets/overview.js" in page.text
    assert [(r["status"], r["turns"]) for r in listed] == [("completed", 1), ("completed", 1)]
    assert "Stopped the gateway and vLLM." in rest
    with pytest.raises(httpx.ConnectError):
        httpx.get(viewer, timeout=TIMEOUT)
