"""The project's vLLM plugin (`vllm-plugin/`) as users install it: its wheel, built from the working tree and
installed into a directory of its own, which a vLLM server started with `VLLMServer(..., plugin=site)` puts
first on its path and names in `VLLM_PLUGINS`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "vllm-plugin"
NAME = "rl_gateway"
"""The plugin's entry point, as `VLLM_PLUGINS` names it."""


def install_plugin(site: Path) -> Path:
    """`site` holding the plugin's packages, built from a copy of its source (the build writes beside it)."""
    if (site / "rl_gateway_vllm").is_dir():
        return site
    with tempfile.TemporaryDirectory(prefix="vllm-plugin-") as scratch:
        source, wheels = Path(scratch) / "source", Path(scratch) / "wheels"
        shutil.copytree(SOURCE, source)
        pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source], check=True)
        (wheel,) = wheels.glob("*.whl")
        subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True)
    return site
