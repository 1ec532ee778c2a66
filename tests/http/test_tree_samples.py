"""Rollouts that are trees, as a harness with sub-agents and compaction makes them: each chain of the lineage
tree trains as one merged sample, whatever other chains' calls came between its turns, in the library, the
CLI's export and the documented SQL alike. The engine is scripted with ids that extend each other exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy as sa

from rollout_store.database import make_engine
from trainer_client import SampleOptions, TrainerClient
from trainer_client.cli import main as trainer_cli

from support.fake_engine import chat_reply

pytestmark = pytest.mark.anyio

SYSTEM = {"role": "system", "content": "You are a coding agent."}
TASK = {"role": "user", "content": "Fix the failing test."}
SUB_SYSTEM = {"role": "system", "content": "You are a search sub-agent."}


def task_call(call_id: str, prompt: str) -> dict[str, Any]:
    arguments = orjson.dumps({"prompt": prompt}).decode()
    return {"id": call_id, "type": "function", "function": {"name": "Task", "arguments": arguments}}


def said(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def called(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def answered(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


async def call(
    gw,
    messages: list[dict[str, Any]],
    prompt: list[int],
    completion: list[int],
    reply: dict[str, Any],
    **headers: str,
) -> None:
    """One model call of rollout "r": the engine saw `prompt` and sampled `completion`, replying `reply`."""
    gw.engine.answer(
        "/v1/chat/completions",
        chat_reply(prompt, completion, reply.get("content") or "", tool_calls=reply.get("tool_calls")),
    )
    answer = await gw.client.post(
        "/rollouts/r/v1/chat/completions", json={"model": "tiny", "messages": messages}, headers=headers
    )
    assert answer.status_code == 200, answer.text


async def sub_agent_then_compaction(gw) -> None:
    """The main call (0), a sub-agent's two calls (1, 2), the main conversation resumed with its answer (3),
    a summary call that extends it (4), the conversation restarted from the summary (5) and continued (6)."""
    assert (await gw.client.post("/rollouts", json={"rollout_id": "r", "group_id": "g"})).status_code == 201
    main = [SYSTEM, TASK]
    delegate = called(task_call("t1", "find the test"))
    await call(gw, main, [1, 2], [10], delegate)
    sub = [SUB_SYSTEM, {"role": "user", "content": "find the test"}]
    grep = called({"id": "g1", "type": "function", "function": {"name": "Grep", "arguments": '{"q":"x"}'}})
    await call(gw, sub, [7, 8], [40], grep)
    sub += [grep, answered("g1", "tests/test_x.py")]
    await call(gw, sub, [7, 8, 40, 41], [42], said("It is tests/test_x.py"))
    main += [delegate, answered("t1", "It is tests/test_x.py")]
    await call(gw, main, [1, 2, 10, 43], [11], said("Fixed."))
    main += [said("Fixed."), {"role": "user", "content": "Summarize the conversation."}]
    await call(gw, main, [1, 2, 10, 43, 11, 50], [12], said("Summary: fixed test_x."))
    restart = [SYSTEM, {"role": "user", "content": "Summary: fixed test_x. Go on."}]
    await call(gw, restart, [1, 9, 12], [13], said("Running the suite."))
    restart += [said("Running the suite."), {"role": "user", "content": "It passes."}]
    await call(gw, restart, [1, 9, 12, 13, 60], [14], said("Done."))
    finished = await gw.client.post("/rollouts/r/finish", json={"reward": 1.0})
    assert finished.status_code == 200, finished.text


CHAINS = [[0, 3, 4], [1, 2], [5, 6]]


async def test_each_chain_of_a_rollout_with_a_sub_agent_and_a_compaction_trains_as_one_sample(gw):
    await sub_agent_then_compaction(gw)

    with TrainerClient(gw.db) as client:
        batch = client.read(SampleOptions(merged=True, normalize_std=False))

    assert [s.turn_indices for s in batch.samples] == CHAINS
    main, sub, restart = batch.samples
    assert main.input_ids.tolist() == [1, 2, 10, 43, 11, 50, 12]
    assert main.loss_mask.tolist() == [0, 0, 1, 0, 1, 0, 1]
    assert main.token_logprobs.tolist() == [0.0, 0.0, -0.5, 0.0, -0.5, 0.0, -0.5]
    assert (sub.input_ids.tolist(), sub.loss_mask.tolist()) == ([7, 8, 40, 41, 42], [0, 0, 1, 0, 1])
    assert (restart.input_ids.tolist(), restart.loss_mask.tolist()) == (
        [1, 9, 12, 13, 60, 14],
        [0] * 3 + [1, 0, 1],
    )
    assert [(s.reward, s.advantage, s.is_last_step) for s in batch.samples] == [
        (1.0, 0.0, False),
        (1.0, 0.0, False),
        (1.0, 0.0, True),
    ]


async def test_the_lineage_of_a_tree_shaped_rollout_names_every_parent(gw):
    await sub_agent_then_compaction(gw)

    turns = (await gw.rollout("r"))["turns"]

    assert [(t["parent_turn"], t["drift_tokens"]) for t in turns] == [
        (None, None),
        (None, None),
        (1, 0),
        (0, 0),
        (3, 0),
        (None, None),
        (5, 0),
    ]


async def test_the_rollout_chains_view_lists_the_chains_that_train(gw):
    await sub_agent_then_compaction(gw)

    engine = make_engine(gw.db)
    with engine.connect() as conn:
        chains = conn.execute(
            sa.text(
                "SELECT chain, turns, turn_indices, sampled_tokens, last_turn FROM rollout_chains "
                "WHERE rollout_id = 'r' ORDER BY chain"
            )
        ).all()
        positions = conn.execute(
            sa.text(
                "SELECT turn_index, chain, position FROM chain_turns "
                "WHERE rollout_id = 'r' ORDER BY turn_index"
            )
        ).all()
    engine.dispose()

    assert [tuple(row) for row in chains] == [(0, 3, "0,3,4", 3, 4), (1, 2, "1,2", 2, 2), (5, 2, "5,6", 2, 6)]
    assert [tuple(row) for row in positions] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 1, 1),
        (3, 0, 1),
        (4, 0, 2),
        (5, 5, 0),
        (6, 5, 1),
    ]


async def test_the_merged_export_has_one_line_per_chain(gw, tmp_path: Path, capsys):
    await sub_agent_then_compaction(gw)
    out = tmp_path / "samples.jsonl"

    assert trainer_cli(["export", "--db", gw.db, "--merged", "--output", str(out)]) == 0

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line["turn_indices"], sum(line["loss_mask"])) for line in lines] == [
        ([0, 3, 4], 3),
        ([1, 2], 2),
        ([5, 6], 2),
    ]


async def test_two_sub_agents_at_once_are_two_chains_beside_the_main_one(gw):
    assert (await gw.client.post("/rollouts", json={"rollout_id": "r", "group_id": "g"})).status_code == 201
    main = [SYSTEM, TASK]
    both = called(task_call("a", "read the code"), task_call("b", "read the tests"))
    await call(gw, main, [1, 2], [10], both)
    code = [SUB_SYSTEM, {"role": "user", "content": "read the code"}]
    tests = [SUB_SYSTEM, {"role": "user", "content": "read the tests"}]
    await call(gw, code, [7, 8], [40], said("The code reads x."))  # the two run at once: interleaved
    await call(gw, tests, [7, 9], [50], said("The tests read y."))
    main += [both, answered("a", "The code reads x."), answered("b", "The tests read y.")]
    await call(gw, main, [1, 2, 10, 44, 45], [11], said("Fixed."))
    await gw.client.post("/rollouts/r/finish", json={"reward": 0.5})

    with TrainerClient(gw.db) as client:
        batch = client.read(SampleOptions(merged=True))

    assert [s.turn_indices for s in batch.samples] == [[0, 3], [1], [2]]
    assert batch.samples[0].loss_mask.tolist() == [0, 0, 1, 0, 0, 1]


async def test_a_retried_call_continues_the_chain_and_the_attempt_it_repeats_trains_nothing(gw):
    assert (await gw.client.post("/rollouts", json={"rollout_id": "r", "group_id": "g"})).status_code == 201
    main = [SYSTEM, TASK]
    await call(gw, main, [1, 2], [10], said("Looking."))
    main += [said("Looking."), {"role": "user", "content": "Go on."}]
    await call(gw, main, [1, 2, 10, 20], [11], said("Lost reply."))  # the client timed out on this one
    await call(gw, main, [1, 2, 10, 20], [12], said("Found it."), **{"x-stainless-retry-count": "1"})
    main += [said("Found it."), {"role": "user", "content": "Thanks."}]
    await call(gw, main, [1, 2, 10, 20, 12, 30], [13], said("Done."))
    await gw.client.post("/rollouts/r/finish", json={"reward": 1.0})

    with TrainerClient(gw.db) as client:
        batch = client.read(SampleOptions(merged=True))

    assert [(s.turn_indices, int(s.loss_mask.sum()), s.masked) for s in batch.samples] == [
        ([0, 2, 3], 3, False),
        ([1], 0, True),
    ]
    engine = make_engine(gw.db)
    with engine.connect() as conn:
        chains = (
            conn.execute(sa.text("SELECT turn_indices FROM rollout_chains ORDER BY chain")).scalars().all()
        )
    engine.dispose()
    assert chains == ["0,2,3", "1"]
