"""Trainer-controlled sampling: a rollout's `sampling` (over the gateway's --sampling) replaces the agent's
own fields on every call, `max_tokens` caps what the agent asks, and the turn records what was sent."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.settings import Settings

from support import assert_openai_error
from support.fake_engine import chat_reply

pytestmark = pytest.mark.anyio

FORCED = {"temperature": 0.0, "seed": 7, "max_tokens": 8, "structured_outputs": {"regex": "a+"}}


async def forwarded(gw: Any, rollout_id: str, **body: Any) -> dict[str, Any]:
    """What the engine received for one agent call, and the stored turn's params."""
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [5, 6], "aa"))
    response = await gw.chat(rollout_id, **body)
    assert response.status_code == 200, response.text
    return gw.engine.requests[-1][1]


async def test_rollout_sampling_replaces_the_agents_fields_and_caps_its_max_tokens(gw):
    await gw.client.post("/rollouts", json={"rollout_id": "r1", "sampling": FORCED})

    sent = await forwarded(gw, "r1", temperature=1.5, top_p=0.9, max_tokens=50, seed=1)

    assert {k: sent[k] for k in ("temperature", "top_p", "max_tokens", "seed", "structured_outputs")} == {
        "temperature": 0.0,
        "top_p": 0.9,
        "max_tokens": 8,
        "seed": 7,
        "structured_outputs": {"regex": "a+"},
    }
    (turn,) = (await gw.rollout("r1", include_messages="true"))["turns"]
    assert {k: turn["params"][k] for k in ("temperature", "top_p", "max_tokens", "seed")} == {
        "temperature": 0.0,
        "top_p": 0.9,
        "max_tokens": 8,
        "seed": 7,
    }


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        ({"max_tokens": 3}, {"max_tokens": 3}),  # below the cap: the agent's own
        ({}, {"max_tokens": 8}),  # not asked: the cap
        ({"max_completion_tokens": 20}, {"max_completion_tokens": 8}),  # the field the agent used
    ],
    ids=["lower", "unset", "max_completion_tokens"],
)
async def test_max_tokens_caps_what_the_agent_asks(gw, asked, expected):
    await gw.client.post("/rollouts", json={"rollout_id": "r1", "sampling": {"max_tokens": 8}})

    sent = await forwarded(gw, "r1", **asked)

    assert {k: sent.get(k) for k in expected} == expected
    assert "max_completion_tokens" not in sent or "max_tokens" not in sent


async def test_gateway_sampling_applies_to_every_rollout_and_a_rollouts_own_fields_win(start):
    gw = await start(sampling={"temperature": 1.0, "top_k": 20})
    await gw.client.post("/rollouts", json={"rollout_id": "own", "sampling": {"temperature": 0.0}})

    default = await forwarded(gw, "unregistered", temperature=0.3)
    own = await forwarded(gw, "own", temperature=0.3)

    assert (default["temperature"], default["top_k"]) == (1.0, 20)
    assert (own["temperature"], own["top_k"]) == (0.0, 20)


async def test_the_rollout_shows_its_sampling_and_a_conflicting_creation_is_refused(gw):
    created = await gw.client.post("/rollouts", json={"rollout_id": "r1", "sampling": {"seed": 3}})
    again = await gw.client.post("/rollouts", json={"rollout_id": "r1", "sampling": {"seed": 3}})
    other = await gw.client.post("/rollouts", json={"rollout_id": "r1", "sampling": {"seed": 4}})

    assert (created.status_code, created.json()["sampling"]) == (201, {"seed": 3})
    assert (again.status_code, again.json()["sampling"]) == (200, {"seed": 3})
    assert_openai_error(other, 409, "rollout_conflict")
    assert (await gw.rollout("r1"))["sampling"] == {"seed": 3}


@pytest.mark.parametrize(
    "sampling",
    [
        {"temprature": 1.0},  # a typo must not pass silently
        {"temperature": -1},
        {"top_p": 0},
        {"max_tokens": 0},
        {"structured_outputs": "a+"},
        {"seed": "seven"},
    ],
    ids=["unknown field", "negative temperature", "top_p 0", "max_tokens 0", "not an object", "seed text"],
)
async def test_invalid_sampling_is_refused_and_creates_nothing(gw, sampling):
    response = await gw.client.post("/rollouts", json={"rollout_id": "r1", "sampling": sampling})

    assert_openai_error(response, 422, "invalid_request")
    assert (await gw.client.get("/rollouts/r1")).status_code == 404


def test_the_gateway_flag_takes_a_json_object():
    assert Settings(sampling='{"temperature": 0, "max_tokens": 64}').sampling.model_dump(
        exclude_none=True
    ) == {
        "temperature": 0.0,
        "max_tokens": 64,
    }
    with pytest.raises(ValueError, match="not a JSON object"):
        Settings(sampling="{temperature: 0}")
    with pytest.raises(ValueError, match="temprature"):
        Settings(sampling='{"temprature": 0}')
