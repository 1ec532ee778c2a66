"""Every turn records the turn it extends, how far its tokens drift from that turn's exact tokens, and
where a harness edited its history, the turn it forked from."""

from __future__ import annotations

import itertools

import httpx
import numpy as np
import sqlalchemy as sa

from rollout_store.database import make_engine
from rollout_store.tokens import common_prefix_len

from support import LS_TMP_REGEX, TIMEOUT, chat, stored_rollout, sync_agent, tokenize_chat


def expected_drift(parent: dict, prompt: list[int]) -> int:
    sequence = np.array(parent["prompt_token_ids"] + parent["completion_token_ids"])
    return len(sequence) - common_prefix_len(np.array(prompt), sequence)


def test_each_turn_records_its_parent_and_exact_drift(gateway, vllm, db_url, rollout_id):
    messages = [{"role": "user", "content": "List /tmp."}]
    for _ in range(3):
        reply = chat(gateway, rollout_id, messages, structured_outputs={"regex": LS_TMP_REGEX})
        messages += [
            reply,
            {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "a.txt"},
        ]

    turns = stored_rollout(gateway, rollout_id)["turns"]
    assert [(t["parent_turn"], t["forked_from"]) for t in turns] == [(None, None), (0, None), (1, None)]
    assert turns[0]["drift_tokens"] is None
    for parent, turn in itertools.pairwise(turns):
        assert turn["drift_tokens"] == expected_drift(parent, turn["prompt_token_ids"])
    # The re-rendered tool call is tokenized differently from the characters the model sampled one by one.
    assert all(t["drift_tokens"] > 0 for t in turns[1:])
    shown = httpx.get(f"{gateway.url}/rollouts/{rollout_id}", timeout=TIMEOUT).json()["turns"]
    assert [(t["parent_turn"], t["drift_tokens"]) for t in shown] == [
        (t["parent_turn"], t["drift_tokens"]) for t in turns
    ]


def test_turn_that_reproduces_its_parent_exactly_has_zero_drift(gateway, vllm, db_url, rollout_id):
    agent = sync_agent(gateway.agent_url(rollout_id))
    first = agent.completions.create(
        model="tiny",
        prompt=tokenize_chat(vllm, [{"role": "user", "content": "Hi"}]),
        max_tokens=5,
        seed=0,  # a reply with text (five tokens of unfinished characters would have none) every run
        extra_body={"min_tokens": 5},
    )
    stored = stored_rollout(gateway, rollout_id)["turns"][0]
    extended = stored["prompt_token_ids"] + stored["completion_token_ids"] + [198]
    agent.completions.create(model="tiny", prompt=extended, max_tokens=3)

    second = stored_rollout(gateway, rollout_id)["turns"][1]
    assert first.choices[0].text
    assert (second["parent_turn"], second["drift_tokens"], second["prefix_tokens"]) == (
        0,
        0,
        len(extended) - 1,
    )
    assert second["prompt_token_ids"] == extended


def test_edited_history_forks_a_new_chain_and_keeps_exact_prompts(gateway, vllm, db_url, rollout_id):
    system = {"role": "system", "content": "Be brief."}
    history = [system, {"role": "user", "content": "First question?"}]
    history += [chat(gateway, rollout_id, history), {"role": "user", "content": "Second?"}]
    chat(gateway, rollout_id, history)
    edited = [system, {"role": "user", "content": "A summary of everything so far."}]
    chat(gateway, rollout_id, edited)

    turns = stored_rollout(gateway, rollout_id)["turns"]
    assert [(t["parent_turn"], t["forked_from"]) for t in turns] == [(None, None), (0, None), (None, 1)]
    assert turns[2]["drift_tokens"] is None
    assert turns[2]["messages"] == edited
    assert turns[2]["prompt_token_ids"] == tokenize_chat(vllm, edited)


def test_drift_views_count_extending_drifted_and_forked_turns(gateway, db_url, rollout_id):
    messages = [{"role": "user", "content": "List /tmp."}]
    reply = chat(gateway, rollout_id, messages, structured_outputs={"regex": LS_TMP_REGEX})
    chat(
        gateway,
        rollout_id,
        [*messages, reply, {"role": "tool", "tool_call_id": "x", "content": "a.txt"}],
        structured_outputs={"regex": LS_TMP_REGEX},
    )
    chat(gateway, rollout_id, [{"role": "user", "content": "Unrelated."}])

    engine = make_engine(db_url)
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT turns, extending_turns, drifted_turns, forked_turns, drift_rate "
                "FROM drift_by_rollout WHERE rollout_id = :r"
            ),
            {"r": rollout_id},
        ).one()
    engine.dispose()
    assert tuple(row) == (3, 1, 1, 0, 1.0)
