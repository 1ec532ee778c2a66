"""What the gateway answers to malformed or misdirected requests: OpenAI-format errors, nothing stored."""

from __future__ import annotations

import pytest

from support import assert_openai_error
from support.fake_engine import chat_reply

pytestmark = pytest.mark.anyio

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ENGINE_ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions/tokens"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"),
]
"""Every agent route that reaches the engine, under `/rollouts/{rollout_id}`."""


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"model": "tiny"}', 422, "invalid_request"),
        (b'{"model": "tiny", "messages": "hi"}', 422, "invalid_request"),
        (b'{"model": "tiny", "messages": []}', 422, "invalid_request"),
        (b'{"model": "tiny", "messages": [{"content": "no role"}]}', 422, "invalid_request"),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "maybe"}',
            422,
            "invalid_request",
        ),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}',
            422,
            "invalid_request",
        ),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 1.5}',
            422,
            "invalid_request",
        ),
        (b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', 422, "invalid_request"),
        (
            b'{"model": "' + b"m" * 257 + b'", "messages": [{"role": "user", "content": "x"}]}',
            422,
            "invalid_request",
        ),
    ],
)
async def test_malformed_requests_get_openai_errors_and_store_nothing(gw, content, status, code):
    response = await gw.client.post(
        "/rollouts/r1/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )

    assert_openai_error(response, status, code)
    assert response.headers["x-should-retry"] == "false"
    assert gw.engine.requests == []
    assert (await gw.client.get("/rollouts/r1")).status_code == 404


async def test_wrong_type_names_the_offending_parameter(gw):
    response = await gw.chat("r1", n="many")

    assert assert_openai_error(response, 422, "invalid_request")["param"] == "n"


async def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(start):
    gw = await start(max_body_bytes=1000)

    response = await gw.chat("r1", messages=[{"role": "user", "content": "x" * 2000}])

    assert_openai_error(response, 413, "request_too_large")
    assert response.json()["error"]["message"] == "request body exceeds 1000 bytes"


async def test_an_invalid_rollout_id_in_the_path_is_400(gw):
    response = await gw.client.post("/rollouts/bad%20id/v1/chat/completions", json=CHAT)

    assert_openai_error(response, 400, "invalid_rollout_id")


@pytest.mark.parametrize(("method", "path"), [*ENGINE_ROUTES, ("GET", "/v1/responses/resp_1")])
async def test_every_agent_route_refuses_a_bad_rollout_id_before_its_key_or_its_body(start, method, path):
    gw = await start(rollout_keys=True, require_registered_rollouts=True)

    response = await gw.client.request(
        method, f"/rollouts/bad%20id{path}", content=b"{not json", headers={"authorization": "Bearer wrong"}
    )

    assert_openai_error(response, 400, "invalid_rollout_id")
    assert gw.engine.requests == []


@pytest.mark.parametrize(("method", "path"), ENGINE_ROUTES)
async def test_every_route_that_reaches_the_engine_checks_the_key_then_refuses_a_finished_rollout(
    start, method, path
):
    gw = await start(rollout_keys=True)
    key = (await gw.client.post("/rollouts", json={"rollout_id": "r1"})).json()["api_key"]
    await gw.client.post("/rollouts/r1/finish", json={"reward": 1.0})
    url = f"/rollouts/r1{path}"

    wrong = await gw.client.request(method, url, json=CHAT, headers={"authorization": "Bearer wrong"})
    finished = await gw.client.request(method, url, json=CHAT, headers={"authorization": f"Bearer {key}"})

    assert_openai_error(wrong, 401, "invalid_api_key")
    assert_openai_error(finished, 409, "rollout_finished")
    assert gw.engine.requests == []


async def test_a_finished_rollouts_stored_response_still_reads_back_to_its_key_alone(start):
    gw = await start(rollout_keys=True)
    key = (await gw.client.post("/rollouts", json={"rollout_id": "r1"})).json()["api_key"]
    keyed = {"authorization": f"Bearer {key}"}
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 10, 11, 2], [5, 2], "Hi."))
    body = {"model": "tiny", "input": "Hi"}
    response_id = (await gw.client.post("/rollouts/r1/v1/responses", json=body, headers=keyed)).json()["id"]
    await gw.client.post("/rollouts/r1/finish", json={"reward": 1.0})
    url = f"/rollouts/r1/v1/responses/{response_id}"

    fetched = await gw.client.get(url, headers=keyed)
    unkeyed = await gw.client.get(url)

    assert fetched.status_code == 200
    assert (fetched.json()["id"], fetched.json()["status"]) == (response_id, "completed")
    assert_openai_error(unkeyed, 401, "invalid_api_key")


async def test_an_unknown_path_says_which_endpoints_exist(gw):
    response = await gw.client.post("/v1/chat/completions", json=CHAT)

    error = assert_openai_error(response, 404, "unknown_route")
    assert error["message"].startswith(
        "no route POST /v1/chat/completions; the gateway serves: agent API under "
    )
    assert "/rollouts/{rollout_id}/v1: POST chat/completions" in error["message"]


async def test_a_wrong_method_is_405(gw):
    assert_openai_error(await gw.client.get("/rollouts"), 405, "method_not_allowed")


async def test_unregistered_rollouts_are_404_when_registration_is_required(start):
    gw = await start(require_registered_rollouts=True)

    assert_openai_error(await gw.chat("r1"), 404, "rollout_not_found")
    assert gw.engine.requests == []


async def test_a_rollout_with_rewards_reads_back_through_the_api(gw):
    assert (await gw.client.post("/rollouts", json={"rollout_id": "r1"})).status_code == 201
    await gw.client.post("/rollouts/r1/reward", json={"reward": 0.5, "components": {"a": 0.5}})
    await gw.client.post("/rollouts/r1/finish", json={"reward": 1.0})

    response = await gw.client.get("/rollouts/r1")

    assert response.status_code == 200
    rewards = [(r["turn_index"], r["value"], r["components"]) for r in response.json()["rewards"]]
    assert rewards == [(None, 0.5, {"a": 0.5}), (None, 1.0, None)]
    assert (response.json()["status"], response.json()["reward"]) == ("completed", 1.0)


async def test_a_reward_for_a_turn_the_rollout_does_not_have_is_404(gw):
    await gw.client.post("/rollouts", json={"rollout_id": "r1"})

    response = await gw.client.post("/rollouts/r1/reward", json={"reward": 1.0, "turn_index": 3})

    assert_openai_error(response, 404, "turn_not_found")
    assert response.json()["error"]["message"] == "rollout 'r1' has no turn 3"


async def test_a_reward_for_a_turn_index_beyond_any_store_column_is_a_422(gw):
    await gw.client.post("/rollouts", json={"rollout_id": "r1"})

    response = await gw.client.post("/rollouts/r1/reward", json={"reward": 1.0, "turn_index": 75628711779})

    assert_openai_error(response, 422, "invalid_request")
    assert response.json()["error"]["param"] == "turn_index"


@pytest.mark.parametrize(
    ("path", "content", "param"),
    [
        ("/rollouts", b'{"rollout_id": "r2", "metadata": {"score": NaN}}', "metadata"),
        ("/rollouts", b'{"rollout_id": "r2", "metadata": {"runs": [1, {"at": -Infinity}]}}', "metadata"),
        ("/rollouts", b'{"rollout_id": "r2", "metadata": {"big": 1e999}}', "metadata"),
        ("/rollouts", b'{"rollout_id": "r2", "sampling": {"repetition_penalty": Infinity}}', "sampling"),
        ("/rollouts", b'{"rollout_id": "r2", "sampling": {"structured_outputs": {"x": NaN}}}', "sampling"),
        ("/rollouts/r1/reward", b'{"reward": NaN}', "reward"),
        ("/rollouts/r1/reward", b'{"reward": 1.0, "components": {"format": Infinity}}', "components.format"),
        ("/rollouts/r1/finish", b'{"reward": -Infinity}', "reward"),
        ("/rollouts/r1/finish", b'{"reward": 1.0, "components": {"format": NaN}}', "components.format"),
    ],
)
async def test_a_control_body_with_nan_or_infinity_anywhere_is_a_422_and_stores_nothing(
    gw, path, content, param
):
    await gw.client.post("/rollouts", json={"rollout_id": "r1"})

    response = await gw.client.post(path, content=content, headers={"content-type": "application/json"})

    assert_openai_error(response, 422, "invalid_request")
    assert response.json()["error"]["param"] == param
    assert (await gw.client.get("/rollouts/r2")).status_code == 404
    untouched = await gw.rollout("r1")
    assert (untouched["status"], untouched["reward"], untouched["rewards"]) == ("running", None, [])


async def test_a_non_finite_number_in_metadata_is_named_where_it_lies(gw):
    response = await gw.client.post(
        "/rollouts",
        content=b'{"metadata": {"runs": [1, {"at": NaN}]}}',
        headers={"content-type": "application/json"},
    )

    assert response.json()["error"]["message"] == (
        "metadata: Value error, metadata.runs.1.at is not a finite number (JSON has no NaN or Infinity)"
    )


async def test_finishing_twice_is_409_and_keeps_the_first_outcome(gw):
    await gw.client.post("/rollouts", json={"rollout_id": "r1"})
    await gw.client.post("/rollouts/r1/finish", json={"status": "failed"})

    again = await gw.client.post("/rollouts/r1/finish", json={"status": "completed", "reward": 1.0})

    assert_openai_error(again, 409, "rollout_finished")
    assert (await gw.rollout("r1"))["status"] == "failed"


async def test_recreating_a_rollout_with_other_fields_is_409(gw):
    await gw.client.post("/rollouts", json={"rollout_id": "r1", "group_id": "g1"})

    response = await gw.client.post("/rollouts", json={"rollout_id": "r1", "group_id": "g2"})

    assert_openai_error(response, 409, "rollout_conflict")


async def test_the_models_list_is_the_engines(gw):
    response = await gw.client.get("/rollouts/r1/v1/models")

    assert response.json() == {"object": "list", "data": [{"id": "tiny", "object": "model"}]}


async def test_a_failing_admin_call_to_the_engines_is_a_502(gw):
    async def failing(path: str, **_: object) -> None:
        from gateway.fleet.replies import BackendFailure

        raise BackendFailure("failed", f"{path} failed on http://fake-engine: HTTP 500")

    gw.engine.call_all = failing  # type: ignore[method-assign]

    response = await gw.client.post("/admin/resume")

    assert_openai_error(response, 502, "backend_error")
    assert response.json()["error"]["message"] == "/resume failed on http://fake-engine: HTTP 500"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/admin/backends", {"url": "http://0\u00b5\u0000"}),
        ("/admin/backends", {"url": "http://host:8000/\u001f"}),
        ("/admin/backends", {"url": "http://host name"}),
        ("/admin/policy_version", {"version": "v\u0000"}),
        ("/admin/policy_version", {"version": "v\n1"}),
    ],
)
async def test_admin_values_with_control_characters_are_422_and_change_nothing(gw, path, body):
    before = (await gw.client.get("/admin/state")).json()

    response = await gw.client.post(path, json=body)

    assert_openai_error(response, 422, "invalid_request")
    after = (await gw.client.get("/admin/state")).json()
    assert (after["policy_version"], after["backends"]) == (before["policy_version"], before["backends"])


async def test_a_backend_url_with_user_info_is_422_without_the_password_and_changes_nothing(gw):
    before = (await gw.client.get("/admin/state")).json()

    response = await gw.client.post("/admin/backends", json={"url": "http://user:S3CRET@host:8000"})

    error = assert_openai_error(response, 422, "invalid_request")
    assert error["message"] == (
        "url: Value error, http://user:***@host:8000: a backend URL's user info is not sent to the server; "
        "give the gateway's credentials with --backend-api-key (vLLM's --api-key)"
    )
    assert "S3CRET" not in response.text
    assert (await gw.client.get("/admin/state")).json()["backends"] == before["backends"]
