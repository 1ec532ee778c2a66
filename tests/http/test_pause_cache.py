"""A pause for a weight update drops the servers' KV and prefix caches, or keeps them when asked
(`clear_cache`, `--pause-clear-cache`): vLLM clears them by default in every mode, preempting the calls a
keep-mode pause holds to compute them again. A turn that spans the update records which it was."""

from __future__ import annotations

import asyncio

import pytest

import support
from support.fake_engine import HeldReply, chat_stream

pytestmark = pytest.mark.anyio


def pauses(gw) -> list[dict[str, str]]:
    """What the servers were asked at each pause."""
    return [params for path, params in gw.engine.requests if path == "/pause"]


async def admin(gw, path: str, body: object = None) -> dict:
    answer = await gw.client.post(f"/admin/{path}", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_a_pause_clears_the_servers_caches_unless_it_asks_to_keep_them(gw):
    cleared = await admin(gw, "pause", {"mode": "keep"})
    await admin(gw, "resume")
    kept = await admin(gw, "pause", {"mode": "keep", "clear_cache": False})
    await admin(gw, "resume")
    await admin(gw, "pause")

    assert pauses(gw) == [
        {"mode": "keep", "clear_cache": "true"},
        {"mode": "keep", "clear_cache": "false"},
        {"mode": "wait", "clear_cache": "true"},
    ]
    assert (cleared["cache_kept"], kept["cache_kept"]) == (False, True)


async def test_the_setting_keeps_the_caches_of_a_pause_that_does_not_say(start):
    gw = await start(pause_clear_cache=False)

    state = await admin(gw, "pause", {"mode": "abort"})

    assert pauses(gw) == [{"mode": "abort", "clear_cache": "false"}]
    assert state["cache_kept"] is True


async def test_a_clear_cache_that_is_not_a_boolean_is_refused(gw):
    answer = await gw.client.post("/admin/pause", json={"mode": "keep", "clear_cache": "no"})

    assert answer.status_code == 422
    assert answer.json()["error"]["param"] == "clear_cache"
    assert pauses(gw) == []


@pytest.mark.parametrize("clear_cache", [False, True])
async def test_a_turn_that_spans_a_weight_update_records_whether_the_caches_were_kept(gw, clear_cache):
    release = asyncio.Event()
    gw.engine.answer("/v1/chat/completions", HeldReply(chat_stream([4], [(10, "a"), (0, "")]), release))
    spanning = asyncio.create_task(gw.chat("spans", stream=True))
    await support.until(lambda: gw.app.state.turns.traffic.in_flight == 1, "the stream in flight")

    await admin(gw, "pause", {"mode": "keep", "clear_cache": clear_cache})
    await admin(gw, "policy_version", {"version": "1"})
    await admin(gw, "resume")
    release.set()
    assert (await spanning).status_code == 200
    gw.engine.answer("/v1/chat/completions", chat_stream([4], [(11, "b"), (0, "")]))
    assert (await gw.chat("after", stream=True)).status_code == 200

    spanned, after = (await gw.rollout("spans"))["turns"][0], (await gw.rollout("after"))["turns"][0]
    assert (spanned["policy_version"], spanned["policy_version_end"], spanned["cache_kept"]) == (
        "0",
        "1",
        not clear_cache,
    )
    assert (after["policy_version"], after["policy_version_end"], after["cache_kept"]) == ("1", "1", None)


@pytest.mark.parametrize("timeout", [b"Infinity", b"NaN", b"1e999"])
async def test_a_pause_timeout_that_is_not_a_finite_number_is_a_422_and_pauses_nothing(gw, timeout):
    answer = await gw.client.post(
        "/admin/pause", content=b'{"timeout": %s}' % timeout, headers={"content-type": "application/json"}
    )

    support.assert_openai_error(answer, 422, "invalid_request")
    assert answer.json()["error"]["param"] == "timeout"
    assert ((await gw.client.get("/admin/state")).json()["paused"], pauses(gw)) == (False, [])
