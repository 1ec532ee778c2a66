"""The gateway as a given commit ships it, for benchmarks that compare two versions in one sitting: each is
built from its own wheel and run from its own directory, first on the path, so that neither borrows the
other's code (the environment's other packages are shared)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit_of(ref: str) -> str:
    """The full id of a commit (`HEAD`, a tag, a short id) of this checkout."""
    return subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def installed(ref: str, work: Path) -> Path:
    """A directory holding the packages of the wheel built from `ref`'s tree (not the working tree's)."""
    commit = commit_of(ref)
    site = work / f"site-{commit[:12]}"
    if site.exists():
        return site
    print(f"building the wheel of {ref} ({commit[:12]})", flush=True)
    with tempfile.TemporaryDirectory(prefix="gateway-build-") as scratch:
        source, wheels = Path(scratch) / "source", Path(scratch) / "wheels"
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(source, filter="data")
        pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source], check=True)
        (wheel,) = wheels.glob("*.whl")
        subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True)
    return site


def environment(site: Path) -> dict[str, str]:
    """This process's environment with `site` first on Python's path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env
