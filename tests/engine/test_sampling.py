"""Trainer-controlled sampling on the real engine: whatever the agent asks, the rollout's sampling decides how
the policy samples, on chat (whole and streamed), completions and Responses, and the turn records what was
sent."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from support import TIMEOUT, on_store, stored_rollout, streamed_reply, sync_agent

pytestmark = on_store("postgresql")

SAMPLING = {"temperature": 0.0, "max_tokens": 5, "structured_outputs": {"regex": "[ab]{40}"}}


def rollout_agent(gateway) -> tuple[str, openai.OpenAI]:
    body = {"group_id": "sampling", "sampling": SAMPLING}
    created = httpx.post(gateway.url + "/rollouts", json=body, timeout=TIMEOUT).json()
    return created["rollout_id"], sync_agent(created["base_url"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_rollouts_sampling_decides_how_the_policy_samples_a_chat_reply(gateway, stream):
    rollout_id, agent = rollout_agent(gateway)
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Write anything."}],
        "temperature": 1.7,
        "max_tokens": 200,
    }

    if stream:
        reply = streamed_reply(agent.chat.completions.create(**request, stream=True))
        content, finish = reply["content"], reply["finish_reason"]
    else:
        choice = agent.chat.completions.create(**request).choices[0]
        content, finish = choice.message.content, choice.finish_reason

    assert finish == "length"
    assert re.fullmatch("[ab]+", content)
    (turn,) = stored_rollout(gateway, rollout_id)["turns"]
    assert len(turn["completion_token_ids"]) == 5
    assert {k: turn["params"][k] for k in ("temperature", "max_tokens", "structured_outputs")} == SAMPLING


def test_the_rollouts_sampling_applies_to_completions_too(gateway):
    rollout_id, agent = rollout_agent(gateway)

    choice = agent.completions.create(model="tiny", prompt="Once", temperature=1.7, max_tokens=200).choices[0]

    assert (choice.finish_reason, bool(re.fullmatch("[ab]+", choice.text))) == ("length", True)
    (turn,) = stored_rollout(gateway, rollout_id)["turns"]
    assert len(turn["completion_token_ids"]) == 5
    assert turn["params"]["temperature"] == 0.0


def test_the_rollouts_sampling_applies_to_responses_too(gateway):
    rollout_id, agent = rollout_agent(gateway)

    reply = agent.responses.create(
        model="tiny", input="Write anything.", temperature=1.7, max_output_tokens=200
    )

    assert (reply.status, bool(re.fullmatch("[ab]+", reply.output_text))) == ("incomplete", True)
    (turn,) = stored_rollout(gateway, rollout_id)["turns"]
    assert len(turn["completion_token_ids"]) == 5
    assert {k: turn["params"][k] for k in ("temperature", "max_tokens", "structured_outputs")} == SAMPLING
    assert (turn["request"]["temperature"], turn["request"]["max_output_tokens"]) == (1.7, 200)
