"""Several choices in one call (`n > 1`, a GRPO group from one prompt): each choice is a turn of its own with
its choice index, the engine's ids and logprobs, and a training sample of its own; rewarded one by one, the
choices train with advantages across the call."""

from __future__ import annotations

import math

import httpx
import pytest

from trainer_client import SampleOptions, TrainerClient

from support import TIMEOUT, on_store, stored_rollout, sync_agent

pytestmark = on_store("postgresql")

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_is_stored_as_its_own_turn(gateway, rollout_id, stream):
    agent = sync_agent(gateway.agent_url(rollout_id))
    body = {"model": "tiny", "messages": MESSAGES, "n": 3, "max_tokens": 6, "temperature": 1.0}
    extra = {"return_token_ids": True, "min_tokens": 2}

    if stream:
        ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
        texts: dict[int, str] = {0: "", 1: "", 2: ""}
        for chunk in agent.chat.completions.create(**body, stream=True, extra_body=extra):
            for choice in chunk.choices:
                ids[choice.index] += getattr(choice, "token_ids", None) or []
                texts[choice.index] += choice.delta.content or ""
    else:
        reply = agent.chat.completions.create(**body, extra_body=extra)
        ids = {c.index: c.token_ids for c in reply.choices}
        texts = {c.index: c.message.content or "" for c in reply.choices}

    turns = stored_rollout(gateway, rollout_id)["turns"]
    assert [t["choice_index"] for t in turns] == [0, 1, 2]
    assert [t["completion_token_ids"] for t in turns] == [ids[0], ids[1], ids[2]]
    assert [t["content"] or "" for t in turns] == [texts[0], texts[1], texts[2]]
    assert len({tuple(t["prompt_token_ids"]) for t in turns}) == 1
    assert all(len(t["completion_logprobs"]) == len(t["completion_token_ids"]) for t in turns)
    assert {t["status"] for t in turns} == {"ok"}


def test_completions_with_several_choices_store_each(gateway, rollout_id):
    body = {
        "model": "tiny",
        "prompt": [5, 6, 7],
        "n": 2,
        "max_tokens": 3,
        "min_tokens": 3,
        "return_token_ids": True,
    }
    reply = httpx.post(gateway.agent_url(rollout_id) + "/completions", json=body, timeout=TIMEOUT).json()

    turns = stored_rollout(gateway, rollout_id)["turns"]
    assert [(t["choice_index"], t["completion_token_ids"]) for t in turns] == [
        (c["index"], c["token_ids"]) for c in sorted(reply["choices"], key=lambda c: c["index"])
    ]
    assert [t["prompt_token_ids"] for t in turns] == [[5, 6, 7], [5, 6, 7]]


def test_trainer_sees_one_sample_per_choice(start_gateway, databases, db_kind):
    db_url = databases.new(db_kind)
    gateway = start_gateway(db_url)
    rollout = httpx.post(gateway.url + "/rollouts", json={"group_id": "one-call"}, timeout=TIMEOUT).json()
    body = {"model": "tiny", "messages": MESSAGES, "n": 4, "max_tokens": 3, "min_tokens": 3}
    httpx.post(rollout["base_url"] + "/chat/completions", json=body, timeout=TIMEOUT).raise_for_status()
    httpx.post(
        f"{gateway.url}/rollouts/{rollout['rollout_id']}/finish", json={"reward": 1.0}, timeout=TIMEOUT
    ).raise_for_status()

    with TrainerClient(db_url) as client:
        samples = client.read().samples

    turns = stored_rollout(gateway, rollout["rollout_id"])["turns"]
    assert [(s.turn_index, s.completion_ids.tolist()) for s in samples] == [
        (t["index"], t["completion_token_ids"]) for t in turns
    ]
    assert len(samples) == 4 and not any(s.masked for s in samples)


def test_choices_rewarded_one_by_one_train_with_advantages_across_their_call(
    start_gateway, databases, db_kind
):
    db_url = databases.new(db_kind)
    gateway = start_gateway(db_url)
    rollout = httpx.post(gateway.url + "/rollouts", json={"group_id": "one-prompt"}, timeout=TIMEOUT).json()
    rollout_id = rollout["rollout_id"]
    body = {"model": "tiny", "messages": MESSAGES, "n": 3, "max_tokens": 3, "min_tokens": 3}
    httpx.post(rollout["base_url"] + "/chat/completions", json=body, timeout=TIMEOUT).raise_for_status()
    turns = stored_rollout(gateway, rollout_id)["turns"]
    for turn, value in [(0, 0.0), (1, 0.0), (2, 0.5), (0, 1.0)]:  # turn 0's latest reward is 1.0
        reward = {"reward": value, "turn_index": turn}
        httpx.post(
            f"{gateway.url}/rollouts/{rollout_id}/reward", json=reward, timeout=TIMEOUT
        ).raise_for_status()
    httpx.post(
        f"{gateway.url}/rollouts/{rollout_id}/finish", timeout=TIMEOUT
    ).raise_for_status()  # no rollout-level reward

    with TrainerClient(db_url) as client:
        centred = client.read(SampleOptions(normalize_std=False)).samples
        claimed = client.claim("trainer-0", 0).samples

    assert [(t["index"], t["choice_index"]) for t in turns] == [(0, 0), (1, 1), (2, 2)]
    assert [(s.turn_index, s.reward, s.advantage) for s in centred] == [
        (0, 1.0, 0.5),
        (1, 0.0, -0.5),
        (2, 0.5, 0.0),
    ]
    scale = math.sqrt(0.5 / 3) + 1e-6  # the population std of 1.0, 0.0 and 0.5, plus epsilon
    assert [(s.turn_index, s.reward, s.advantage) for s in claimed] == [
        (0, 1.0, 0.5 / scale),
        (1, 0.0, -0.5 / scale),
        (2, 0.5, 0.0),
    ]
    assert [s.completion_ids.tolist() for s in claimed] == [t["completion_token_ids"] for t in turns]
