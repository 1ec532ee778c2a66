"""The viewer in process: its pages and assets come from the gateway alone, its JSON lists the store's
rollouts with their counts and filters them, gives a group's advantages and a rollout's trainer samples, and
it sits behind the control token."""

from __future__ import annotations

import re

import pytest

from gateway.fleet.replies import BackendFailure

from support.fake_engine import chat_reply

pytestmark = pytest.mark.anyio
SVG_NAMESPACE = "http://www.w3.org/2000/svg"


async def rollout_with_turns(gw, rollout_id: str, turns: int, **body) -> None:
    created = await gw.client.post("/rollouts", json={"rollout_id": rollout_id, **body})
    assert created.status_code == 201, created.text
    for index in range(turns):
        gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3], [7, 8], "ok"))
        messages = [{"role": "user", "content": f"step {index}"}]
        assert (await gw.chat(rollout_id, messages=messages)).status_code == 200


@pytest.mark.parametrize(
    ("path", "script"),
    [("/ui", "overview.js"), ("/ui/rollouts/r1", "rollout.js"), ("/ui/groups/g1", "group.js")],
)
async def test_each_page_and_its_assets_are_served_by_the_gateway_alone(gw, path, script):
    page = await gw.client.get(path)

    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="(/ui/assets/[^"]+)"', page.text)
    assert sorted(assets) == ["/ui/assets/common.js", f"/ui/assets/{script}", "/ui/assets/viewer.css"]
    for text in [page.text] + [(await gw.client.get(asset)).text for asset in assets]:
        assert set(re.findall(r"https?://[^\s\"'`]+", text)) <= {SVG_NAMESPACE}  # a name, never fetched


async def test_unknown_assets_and_pages_as_assets_are_404(gw):
    assert (await gw.client.get("/ui/assets/nothing.js")).status_code == 404
    assert (await gw.client.get("/ui/assets/overview.html")).status_code == 404


async def test_the_overview_lists_rollouts_newest_first_with_rewards_and_counts(gw):
    await rollout_with_turns(gw, "a", 2, group_id="g1")
    await rollout_with_turns(gw, "b", 1, group_id="g1", tags=["eval"])
    await gw.client.post("/rollouts/a/finish", json={"reward": 0.75})

    listed = (await gw.client.get("/ui/api/rollouts")).json()

    rows = {row["rollout_id"]: row for row in listed["rollouts"]}
    assert [row["rollout_id"] for row in listed["rollouts"]] == ["b", "a"]
    assert (rows["a"]["status"], rows["a"]["reward"], rows["a"]["group_id"]) == ("completed", 0.75, "g1")
    assert (rows["a"]["turns"], rows["a"]["prompt_tokens"], rows["a"]["completion_tokens"]) == (2, 6, 4)
    assert (rows["a"]["errors"], rows["a"]["policy_version"]) == (0, "0")
    assert (rows["b"]["status"], rows["b"]["reward"], rows["b"]["tags"]) == ("running", None, ["eval"])
    assert listed["versions"]["training"] == [
        {"policy_version": "0", "rollouts": 1, "failed": 0, "tasks": 1, "reward_mean": 0.75, "pass@1": 0.0}
    ]
    assert "api_key_hash" not in rows["a"]


async def test_the_reward_per_version_orders_numeric_versions_first_and_look_alikes_as_names(gw):
    for rollout_id, version in [("a", "7"), ("b", "--3"), ("c", "²"), ("d", "-3"), ("e", "v7")]:
        await gw.client.post("/admin/policy_version", json={"version": version})
        await rollout_with_turns(gw, rollout_id, 1)
        await gw.client.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0})

    answer = await gw.client.get("/ui/api/rollouts")

    assert answer.status_code == 200, answer.text
    training = answer.json()["versions"]["training"]
    assert [v["policy_version"] for v in training] == ["-3", "7", "--3", "v7", "²"]


async def test_the_overview_filters_by_group_tag_status_and_version(gw):
    await rollout_with_turns(gw, "a", 1, group_id="g1")
    await rollout_with_turns(gw, "b", 1, group_id="g2", tags=["eval", "math"])
    await gw.client.post("/rollouts/b/finish", json={"reward": 1.0})

    async def listed(**filters: str) -> list[str]:
        answer = await gw.client.get("/ui/api/rollouts", params=filters)
        return [row["rollout_id"] for row in answer.json()["rollouts"]]

    assert await listed(group="g1") == ["a"]
    assert await listed(tag="eval") == ["b"]
    assert await listed(tag="math") == ["b"]
    assert await listed(tag="mat") == []
    assert await listed(status="running") == ["a"]
    assert await listed(version="0") == ["b", "a"]
    assert await listed(version="9") == []


async def test_a_rollouts_page_data_holds_every_turn_with_its_ids_and_each_ids_text(gw):
    await rollout_with_turns(gw, "a", 2)

    data = (await gw.client.get("/ui/api/rollouts/a")).json()

    turns = data["rollout"]["turns"]
    assert [t["index"] for t in turns] == [0, 1]
    assert [(t["prompt_token_ids"], t["completion_token_ids"]) for t in turns] == [([1, 2, 3], [7, 8])] * 2
    assert turns[1]["messages"] == [{"role": "user", "content": "step 1"}]
    assert data["texts"] == {"tiny": {"1": "<1>", "2": "<2>", "3": "<3>", "7": "<7>", "8": "<8>"}}
    detokenized = [body["tokens"] for path, body in gw.engine.requests if path == "/detokenize"]
    assert sorted(detokenized) == [[1], [2], [3], [7], [8]]

    await gw.client.get("/ui/api/rollouts/a")  # the texts are remembered: the engine is not asked again
    assert len([path for path, _ in gw.engine.requests if path == "/detokenize"]) == 5


async def test_without_a_reachable_engine_the_rollout_shows_its_ids_without_texts(gw):
    await rollout_with_turns(gw, "a", 1)
    gw.engine.detokenize_failure = BackendFailure("unreachable", "no backend serving 'tiny' reachable")

    data = (await gw.client.get("/ui/api/rollouts/a")).json()

    assert data["texts"] == {"tiny": {}}
    assert data["rollout"]["turns"][0]["completion_token_ids"] == [7, 8]


async def test_an_unknown_rollout_is_a_404_and_its_page_still_loads(gw):
    answer = await gw.client.get("/ui/api/rollouts/nope")

    assert answer.status_code == 404 and answer.json()["error"]["code"] == "rollout_not_found"
    page = await gw.client.get("/ui/rollouts/nope")
    assert page.status_code == 200 and "/ui/assets/rollout.js" in page.text


async def test_an_out_of_range_limit_is_a_422(gw):
    answer = await gw.client.get("/ui/api/rollouts", params={"limit": 0})

    assert answer.status_code == 422
    assert answer.json()["error"]["param"] == "limit"


async def test_a_groups_data_gives_each_rollout_its_reward_and_the_advantage_a_trainer_would_give_it(gw):
    for rollout_id in ("a", "b", "c"):
        await rollout_with_turns(gw, rollout_id, 1, group_id="g")
    await gw.client.post("/rollouts/a/finish", json={"reward": 1.0})
    await gw.client.post("/rollouts/b/finish", json={"reward": 0.0})

    data = (await gw.client.get("/ui/api/groups/g")).json()

    rows = data["rollouts"]
    assert [r["rollout_id"] for r in rows] == ["a", "b", "c"]  # in the order they were created
    assert [r["reward"] for r in rows] == [1.0, 0.0, None]
    assert [round(r["advantage"], 5) if r["advantage"] is not None else None for r in rows] == [
        1.0,
        -1.0,
        None,
    ]
    assert [r["skip_reason"] for r in rows] == [None, None, "late"]
    assert [r["last_reply"] for r in rows] == ["ok", "ok", "ok"]
    assert (data["trained"], data["reward_mean"], data["normalized"]) == (2, 0.5, True)


async def test_a_declared_group_not_yet_whole_is_shown_waiting_with_its_counts(gw):
    for rollout_id in ("a", "b"):
        await rollout_with_turns(gw, rollout_id, 1, group_id="g", group_size=4)
    await gw.client.post("/rollouts/a/finish", json={"reward": 1.0})

    data = (await gw.client.get("/ui/api/groups/g")).json()

    waiting = data["waiting"]
    assert data["group_size"] == 4
    assert (waiting["created"], waiting["finished"]) == (2, 1)
    assert 0 <= waiting["age_s"] < 600


async def test_a_group_without_a_declared_size_is_never_shown_waiting(gw):
    await rollout_with_turns(gw, "a", 1, group_id="g")

    data = (await gw.client.get("/ui/api/groups/g")).json()

    assert (data["group_size"], data["waiting"]) == (None, None)


async def test_an_evaluation_groups_rollouts_are_shown_untrained(gw):
    await rollout_with_turns(gw, "e", 1, group_id="evals", tags=["eval"])
    await gw.client.post("/rollouts/e/finish", json={"reward": 1.0})

    rows = (await gw.client.get("/ui/api/groups/evals")).json()["rollouts"]

    assert [(r["rollout_id"], r["advantage"], r["skip_reason"]) for r in rows] == [("e", None, "eval")]


async def test_a_rollouts_trainer_samples_carry_its_ids_with_the_loss_mask_and_advantage(gw):
    for rollout_id in ("a", "b"):
        await rollout_with_turns(gw, rollout_id, 2, group_id="g")
    await gw.client.post("/rollouts/a/finish", json={"reward": 1.0})
    await gw.client.post("/rollouts/b/finish", json={"reward": 0.0})

    data = (await gw.client.get("/ui/api/rollouts/b/samples")).json()

    assert (data["group_id"], data["skip_reason"], round(data["advantage"], 5)) == ("g", None, -1.0)
    samples = data["samples"]  # each turn sent a prompt of its own: two chains of one turn
    assert [s["turn_indices"] for s in samples] == [[0], [1]]
    assert [s["input_ids"] for s in samples] == [[1, 2, 3, 7, 8]] * 2
    assert [s["loss_mask"] for s in samples] == [[0, 0, 0, 1, 1]] * 2
    assert [round(s["advantage"], 5) for s in samples] == [-1.0, -1.0]


async def test_a_running_rollouts_samples_say_why_they_do_not_train_yet(gw):
    await rollout_with_turns(gw, "a", 1, group_id="g")

    data = (await gw.client.get("/ui/api/rollouts/a/samples")).json()

    assert (data["skip_reason"], data["advantage"], len(data["samples"])) == ("late", None, 1)
    assert data["samples"][0]["loss_mask"] == [0, 0, 0, 1, 1]


async def test_an_unknown_group_or_rollouts_samples_are_a_404(gw):
    group = await gw.client.get("/ui/api/groups/nope")
    samples = await gw.client.get("/ui/api/rollouts/nope/samples")

    assert (group.status_code, group.json()["error"]["code"]) == (404, "group_not_found")
    assert (samples.status_code, samples.json()["error"]["code"]) == (404, "rollout_not_found")


async def test_with_a_control_token_the_viewer_needs_it_from_the_header_or_its_cookie(start):
    gw = await start(control_token="secret")

    assert (await gw.client.get("/ui")).status_code == 401
    assert (await gw.client.get("/ui/api/rollouts")).status_code == 401
    assert (await gw.client.get("/ui/groups/g")).status_code == 401
    assert (await gw.client.get("/ui/api/groups/g")).status_code == 401
    assert (await gw.client.get("/ui/api/rollouts/r/samples")).status_code == 401
    bearer = {"authorization": "Bearer secret"}
    assert (await gw.client.get("/ui/api/rollouts", headers=bearer)).status_code == 200

    login = await gw.client.get("/ui/login", params={"token": "secret"})
    assert (login.status_code, login.headers["location"]) == (303, "/ui")
    assert "httponly" in login.headers["set-cookie"].lower()
    assert (await gw.client.get("/ui/api/rollouts")).status_code == 200  # the cookie now
    gw.client.cookies.set("gateway_viewer", "wrong", path="/ui")
    assert (await gw.client.get("/ui")).status_code == 401
