"""A `verifiers` environment plays through the gateway, unmodified: each of its rollouts is a gateway rollout
(its OpenAI client pointed at the rollout's base URL), the gateway stores the exact ids of every call, and
the environment's rubric score is posted as the rollout's reward. verifiers runs in an environment of its own
(verifiers 0.3 asks for mcp < 2, which the agent clients the suite drives do not meet)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from typing import Any

import httpx

from support import TIMEOUT

ROLLOUTS = 4

IN_VERIFIERS = """
import asyncio, json, sys
import httpx
import verifiers as vf
from datasets import Dataset
from openai import AsyncOpenAI

gateway_url, rollouts = sys.argv[1], int(sys.argv[2])

def writes_es(completion, **_):
    return min(1.0, completion[-1]["content"].count("e") / 4)

env = vf.SingleTurnEnv(
    dataset=Dataset.from_list([{"question": "Write a word with the letter e.", "answer": ""}]),
    system_prompt="Answer in one line.",
    rubric=vf.Rubric(funcs=[writes_es]),
)

async def play(control):
    rollout = (await control.post("/rollouts", json={"group_id": "verifiers"})).json()
    client = vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=rollout["base_url"], api_key="-"))
    # a reply of words: sampled freely, the tiny model may end at once, which verifiers aborts as empty
    sampling = {"max_tokens": 8, "temperature": 1.0,
                "extra_body": {"structured_outputs": {"regex": "[a-z]+( [a-z]+)*[.]"}}}
    results = await env.evaluate(
        client=client, model="tiny", sampling_args=sampling, num_examples=1, rollouts_per_example=1,
    )
    (output,) = results["outputs"]
    finished = await control.post(
        f"/rollouts/{rollout['rollout_id']}/finish", json={"status": "completed", "reward": output["reward"]}
    )
    finished.raise_for_status()
    return {"rollout_id": rollout["rollout_id"], "reward": output["reward"],
            "completion": output["completion"][-1]["content"],
            "prompt": [{"role": m["role"], "content": m["content"]} for m in output["prompt"]]}

async def main():
    async with httpx.AsyncClient(base_url=gateway_url, timeout=120) as control:
        played = await asyncio.gather(*(play(control) for _ in range(rollouts)))
    print(json.dumps(played))

asyncio.run(main())
"""


def verifiers_python() -> str:
    python = os.environ.get("GATEWAY_VERIFIERS_PYTHON")
    assert python, "run the suite with scripts/dev test: it builds the verifiers environment"
    return python


def test_a_verifiers_environment_plays_through_the_gateway_its_calls_stored_and_its_rubric_score_the_reward(
    start_gateway, databases
):
    gateway = start_gateway(databases.new("sqlite"))

    ran = subprocess.run(
        [verifiers_python(), "-c", IN_VERIFIERS, gateway.url, str(ROLLOUTS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    played: list[dict[str, Any]] = json.loads(ran.stdout.splitlines()[-1])

    assert len(played) == ROLLOUTS
    for episode in played:
        answer = httpx.get(
            f"{gateway.url}/rollouts/{episode['rollout_id']}",
            params={"include_tokens": "true", "include_messages": "true"},
            timeout=TIMEOUT,
        )
        rollout = answer.json()
        (turn,) = rollout["turns"]
        assert (rollout["status"], rollout["reward"], rollout["group_id"]) == (
            "completed",
            episode["reward"],
            "verifiers",
        )
        assert episode["reward"] == min(1.0, turn["content"].count("e") / 4)  # the rubric, on what was stored
        assert (turn["status"], turn["content"]) == ("ok", episode["completion"])
        assert turn["messages"] == episode["prompt"]
        assert 0 < len(turn["completion_token_ids"]) <= 8
        assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"])
        assert len(turn["prompt_token_ids"]) == turn["prompt_tokens"] > 0


IN_VERIFIERS_TOKENS = """
import asyncio, json, sys
import httpx
import verifiers as vf
from datasets import Dataset
from openai import AsyncOpenAI
from verifiers.clients.openai_chat_completions_token_client import OpenAIChatCompletionsTokenClient

gateway_url = sys.argv[1]

class MoreEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "More."}]

env = MoreEnv(
    max_turns=3,
    dataset=Dataset.from_list([{"question": "Say something.", "answer": ""}]),
    rubric=vf.Rubric(funcs=[lambda completion, **_: 1.0]),
)

async def main():
    async with httpx.AsyncClient(base_url=gateway_url, timeout=120) as control:
        rollout = (await control.post("/rollouts", json={"group_id": "verifiers-tokens"})).json()
        client = OpenAIChatCompletionsTokenClient(AsyncOpenAI(base_url=rollout["base_url"], api_key="-"))
        results = await env.evaluate(
            client=client, model="tiny", num_examples=1, rollouts_per_example=1, state_columns=["trajectory"],
            # replies that end with the model's own stop token: the client stitches ids only after those
            sampling_args={
                "max_tokens": 16, "temperature": 1.0,
                "extra_body": {"structured_outputs": {"regex": "(Hi|Yes|No)[.]"}},
            },
        )
        (output,) = results["outputs"]
        steps = [
            {"prompt_ids": step["tokens"]["prompt_ids"], "completion_ids": step["tokens"]["completion_ids"]}
            for step in output.get("trajectory") or ()
        ]
        print(json.dumps({"rollout_id": rollout["rollout_id"], "steps": steps}))

asyncio.run(main())
"""


def test_verifiers_token_client_plays_a_multi_turn_environment_its_own_ids_stored_turn_for_turn(
    start_gateway, databases
):
    gateway = start_gateway(databases.new("sqlite"))

    ran = subprocess.run(
        [verifiers_python(), "-c", IN_VERIFIERS_TOKENS, gateway.url],
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert ran.returncode == 0, ran.stderr[-3000:]
    played = json.loads(ran.stdout.splitlines()[-1])
    turns = httpx.get(
        f"{gateway.url}/rollouts/{played['rollout_id']}", params={"include_tokens": "true"}, timeout=TIMEOUT
    ).json()["turns"]
    assert len(turns) == 3 and all(turn["status"] == "ok" for turn in turns)
    assert [(t["prompt_token_ids"], t["completion_token_ids"]) for t in turns] == [
        (step["prompt_ids"], step["completion_ids"]) for step in played["steps"]
    ]
    for turn in turns:
        assert len(turn["completion_token_ids"]) == len(turn["completion_logprobs"])
    for earlier, later in itertools.pairwise(
        turns
    ):  # the client stitched its ids: each turn extends the last
        sequence = earlier["prompt_token_ids"] + earlier["completion_token_ids"]
        assert later["prompt_token_ids"][: len(sequence)] == sequence
        assert later["parent_turn"] == earlier["index"] and later["drift_tokens"] == 0
