"""How fast the viewer's pages load on a large store: a gateway fills its store through the agent API with
100k turns (rollouts of 20 turns in GRPO groups of 8, every tenth group tagged eval, the policy version moving
on ten times, every rollout finished with a reward), then each page is timed twice (the first load, then
again), both as its JSON route and in a real headless Chromium until the page has drawn its rows.

    scripts/dev shell -c 'python bench/viewer_load.py [--turns 100000] [--store sqlite|postgresql|both]'

The upstream answers instantly (bench/fake_vllm.py: 3.2k prompt ids and 64 sampled ids a turn; `/detokenize`
answers `<id>`), so that the time is the gateway's and the browser's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import fake_vllm
import httpx
import orjson
import sqlalchemy as sa
from gateway_overhead import Client
from playwright.sync_api import Page, sync_playwright

from rollout_store.database import make_engine
from testbed.launcher import GatewayProcess

POSTGRES_URL = os.environ.get("GATEWAY_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
TURNS, GROUP_SIZE, CONNECTIONS = 20, 8, 32
SYSTEM = "You are a coding agent. Use the tools, then answer. " * 20


def turn_body(turn: int) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
    for i in range(turn):
        messages += [{"role": "assistant", "content": "x" * 200}, {"role": "user", "content": f"Result {i}."}]
    return orjson.dumps({"model": "tiny", "messages": messages, "max_tokens": 64})


async def fill(port: int, turns: int) -> list[str]:
    """Rollouts of `TURNS` calls each through the agent API until `turns` are stored; the group ids."""
    rollouts = turns // TURNS
    bodies = [turn_body(turn) for turn in range(TURNS)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(rollouts):
        queue.put_nowait(index)
    done = 0
    started = time.perf_counter()
    control = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60)

    async def worker() -> None:
        nonlocal done
        client = Client("127.0.0.1", port)
        await client.connect()
        while not queue.empty():
            index = queue.get_nowait()
            group = index // GROUP_SIZE
            rollout_id = f"r{index:06d}"
            tags = ["eval"] if group % 10 == 9 else []
            created = await control.post(
                "/rollouts", json={"rollout_id": rollout_id, "group_id": f"g{group:05d}", "tags": tags}
            )
            created.raise_for_status()
            for body in bodies:
                if await client.post(f"/rollouts/{rollout_id}/v1/chat/completions", body) != 200:
                    raise RuntimeError(f"a call of {rollout_id} failed")
            finish = {"reward": round(random.random(), 2)}
            (await control.post(f"/rollouts/{rollout_id}/finish", json=finish)).raise_for_status()
            done += 1
            finished = done
            if finished % (rollouts // 10 or 1) == 0:
                rate = finished * TURNS / (time.perf_counter() - started)
                print(f"  {finished * TURNS:>7} turns stored ({rate:.0f} turns/s)", flush=True)
                version = {"version": str(finished * 10 // rollouts)}
                (await control.post("/admin/policy_version", json=version)).raise_for_status()
        client.writer.close()

    await asyncio.gather(*(worker() for _ in range(CONNECTIONS)))
    await control.aclose()
    return [f"g{group:05d}" for group in range(rollouts // GROUP_SIZE)]


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1000


def json_route(url: str) -> Callable[[], object]:
    def get() -> object:
        answer = httpx.get(url, timeout=120)
        answer.raise_for_status()
        return answer.content

    return get


def page_load(page: Page, url: str, selector: str) -> Callable[[], object]:
    def load() -> object:
        page.goto(url)
        return page.wait_for_selector(selector, timeout=120_000)

    return load


def samples_click(page: Page, url: str) -> Callable[[], object]:
    def load() -> object:
        page.goto(url)
        page.wait_for_selector("li.turn")
        started = time.perf_counter()
        page.click("#training summary")
        page.wait_for_selector("#samples .sample", timeout=120_000)
        return time.perf_counter() - started

    return load


def measure(gateway: GatewayProcess, groups: list[str]) -> None:
    rollout, group = "r000042", groups[5]
    base = f"{gateway.url}/ui"
    routes = [
        ("overview JSON (200 newest + reward plot)", json_route(f"{base}/api/rollouts")),
        ("overview JSON, one group", json_route(f"{base}/api/rollouts?group={group}")),
        ("rollout JSON (20 turns, ids, texts)", json_route(f"{base}/api/rollouts/{rollout}")),
        ("trainer samples JSON", json_route(f"{base}/api/rollouts/{rollout}/samples")),
        ("group JSON (8 rollouts, advantages)", json_route(f"{base}/api/groups/{group}")),
    ]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        routes += [
            ("overview page, drawn", page_load(page, base, "tr[data-rollout]")),
            ("rollout page, drawn", page_load(page, f"{base}/rollouts/r000043", "li.turn")),
            ("group page, drawn", page_load(page, f"{base}/groups/{groups[6]}", "tr[data-rollout]")),
        ]
        print(f"  {'':<44} {'first ms':>9} {'again ms':>9}")
        for name, action in routes:
            first, again = timed(action), timed(action)
            print(f"  {name:<44} {first:>9.0f} {again:>9.0f}", flush=True)
        click = samples_click(page, f"{base}/rollouts/r000044")
        print(f"  {'trainer samples, one click, drawn':<44} {click() * 1000:>9.0f} {click() * 1000:>9.0f}")
        browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=100_000, help="turns to store (default: %(default)s)")
    parser.add_argument("--store", choices=["sqlite", "postgresql", "both"], default="both")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gateway-viewer-bench-"))
    upstream, port = fake_vllm.start(work)
    schema = f"gw_viewer_{uuid.uuid4().hex[:8]}"
    admin = make_engine(POSTGRES_URL)
    stores = {
        "SQLite": f"sqlite:///{work / 'viewer.db'}",
        "PostgreSQL": f"{POSTGRES_URL}?options=-csearch_path%3D{schema}",
    }
    if args.store != "both":
        stores = {name: url for name, url in stores.items() if name.lower() == args.store}
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
        for name, db_url in stores.items():
            print(f"{name}: filling the store with {args.turns} turns", flush=True)
            with GatewayProcess(
                [f"http://127.0.0.1:{port}"], db_url, log_path=work / "gateway.log"
            ) as gateway:
                groups = asyncio.run(fill(gateway.port, args.turns))
                measure(gateway, groups)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
        upstream.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
