"""The agent path in process, against a scripted engine: what is recorded and answered for each outcome."""

from __future__ import annotations

import gc

import pytest

from gateway.fleet.replies import BackendFailure

from support.fake_engine import URL, FakeReply, chat_reply, chat_stream, error_reply

pytestmark = pytest.mark.anyio


async def test_a_whole_reply_is_recorded_with_the_engines_ids_and_logprobs(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3], [7, 8, 0], "hey"))

    answer = await gw.chat("r1")

    assert answer.status_code == 200
    turn = (await gw.rollout("r1"))["turns"][0]
    assert turn["status"] == "ok"
    assert turn["prompt_token_ids"] == [1, 2, 3]
    assert turn["completion_token_ids"] == [7, 8, 0]
    assert turn["completion_logprobs"] == [-0.5, -1.0, -1.5]
    assert turn["content"] == "hey"
    assert turn["finish_reason"] == "stop"


async def test_an_agent_call_goes_to_the_server_its_rollout_is_pinned_to_by_the_fleet(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [2], "ok"))
    await gw.client.post("/admin/backends/drain", json={"url": URL})
    refused = await gw.chat("r-drained")  # a draining server takes no new rollout: placement said so
    await gw.client.post("/admin/backends", json={"url": URL})

    assert (await gw.chat("r1")).status_code == 200

    assert refused.status_code == 503
    state = (await gw.client.get("/admin/state")).json()
    assert [(b["url"], b["pinned"]) for b in state["backends"]] == [(URL, 1)]


async def test_the_engine_is_asked_for_ids_and_logprobs_the_agent_did_not_ask_for(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [5], "x"))

    answer = await gw.chat("r1")

    path, sent = gw.engine.requests[0]
    assert (path, sent["return_token_ids"], sent["logprobs"]) == ("/v1/chat/completions", True, True)
    choice = answer.json()["choices"][0]
    assert (answer.json()["prompt_token_ids"], choice["token_ids"], choice["logprobs"]) == (None, None, None)


async def test_an_agent_that_asks_for_ids_receives_them(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [5, 0], "x"))

    answer = await gw.chat("r1", return_token_ids=True, logprobs=True)

    body = answer.json()
    assert body["prompt_token_ids"] == [1, 2]
    assert body["choices"][0]["token_ids"] == [5, 0]
    assert [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]] == [-0.5, -1.0]


async def test_a_streamed_reply_passes_through_and_is_committed_before_done(gw):
    gw.engine.answer("/v1/chat/completions", chat_stream([4, 5], [(10, "a"), (11, "b"), (0, "")]))

    answer = await gw.chat("r1", stream=True)

    events = [line for line in answer.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 5
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["status"], turn["stream"], turn["content"]) == ("ok", True, "ab")
    assert turn["prompt_token_ids"] == [4, 5]
    assert turn["completion_token_ids"] == [10, 11, 0]
    assert turn["completion_logprobs"] == [-0.25, -0.5, -0.75]


async def test_a_stream_that_ends_without_done_is_an_error_event_and_an_error_turn(gw):
    gw.engine.answer("/v1/chat/completions", chat_stream([4], [(10, "a")], done=False))

    answer = await gw.chat("r1", stream=True)

    assert answer.text.endswith(
        'data: {"error":{"message":"backend stream ended without [DONE]","type":"server_error",'
        '"param":null,"code":"backend_error"}}\n\ndata: [DONE]\n\n'
    )
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["status"], turn["http_status"], turn["error"]) == (
        "error",
        502,
        "backend stream ended without [DONE]",
    )
    assert turn["completion_token_ids"] == [10]


async def test_a_stream_that_breaks_off_keeps_what_was_generated_in_its_error_turn(gw):
    gw.engine.answer(
        "/v1/chat/completions", chat_stream([4], [(10, "a"), (11, "b")], done=False, broken=True)
    )

    answer = await gw.chat("r1", stream=True)

    assert '"code":"backend_error"' in answer.text
    turns = (await gw.rollout("r1"))["turns"]
    assert len(turns) == 1
    assert turns[0]["error"] == "backend stream broke off: connection closed mid-reply"
    assert turns[0]["completion_token_ids"] == [10, 11]


async def test_an_error_chunk_in_the_stream_is_passed_on_with_the_engines_message(gw):
    error = FakeReply(200, chunks=[b'data: {"error": {"message": "engine died", "code": 500}}\n\n'])
    gw.engine.answer("/v1/chat/completions", error)

    answer = await gw.chat("r1", stream=True)

    assert '"message":"engine died"' in answer.text
    assert (await gw.rollout("r1"))["turns"][0]["error"] == "engine died"


async def test_the_engines_own_400_is_passed_on_as_it_wrote_it_and_stored_once(gw):
    gw.engine.answer(
        "/v1/chat/completions", error_reply(400, "temperature must be >= 0", param="temperature")
    )

    answer = await gw.chat("r1", temperature=-1)

    assert answer.status_code == 400
    assert answer.headers["x-should-retry"] == "false"
    assert answer.json() == {
        "error": {
            "message": "temperature must be >= 0",
            "type": "BadRequestError",
            "param": "temperature",
            "code": 400,
        }
    }
    turns = (await gw.rollout("r1"))["turns"]
    assert [(t["status"], t["http_status"], t["error"]) for t in turns] == [
        ("error", 400, "temperature must be >= 0")
    ]


async def test_a_prompt_too_long_for_the_engine_is_context_length_exceeded(gw):
    message = "This model's maximum context length is 512 tokens. However, you requested 900 tokens."
    gw.engine.answer("/v1/chat/completions", error_reply(400, message))

    answer = await gw.chat("r1")

    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "context_length_exceeded")


@pytest.mark.parametrize(
    ("reply", "status", "code", "message"),
    [
        (
            error_reply(500, "engine crashed", kind="InternalServerError"),
            502,
            "backend_error",
            "engine crashed",
        ),
        (
            error_reply(401, "Unauthorized"),
            502,
            "backend_error",
            "backend refused the gateway's credentials (HTTP 401): check --backend-api-key",
        ),
        (FakeReply(200, b"<html>"), 502, "backend_error", "backend sent a reply that is not JSON"),
        (
            FakeReply(200, broken=True),
            502,
            "backend_error",
            "backend reply broke off: connection closed mid-reply",
        ),
        (
            BackendFailure("unreachable", "no backend reachable"),
            503,
            "backend_unavailable",
            "no backend reachable",
        ),
        (BackendFailure("busy", "backend busy"), 503, "backend_busy", "backend busy"),
        (BackendFailure("timeout", "backend timed out"), 504, "backend_timeout", "backend timed out"),
        (BackendFailure("failed", "backend failed"), 502, "backend_error", "backend failed"),
    ],
    ids=[
        "engine-500",
        "engine-401",
        "not-json",
        "broken-body",
        "unreachable",
        "busy",
        "timeout",
        "transport",
    ],
)
async def test_a_failing_engine_is_a_gateway_error_and_one_error_turn(gw, reply, status, code, message):
    gw.engine.answer("/v1/chat/completions", reply)

    answer = await gw.chat("r1")

    assert (answer.status_code, answer.json()["error"]["code"], answer.json()["error"]["message"]) == (
        status,
        code,
        message,
    )
    assert answer.headers.get("x-should-retry") == ("true" if status == 503 else None)  # SDKs retry 5xx
    assert answer.headers.get("retry-after") == ("1" if status == 503 else None)
    turns = (await gw.rollout("r1"))["turns"]
    assert [(t["status"], t["http_status"], t["error"]) for t in turns] == [("error", status, message)]


async def test_top_logprobs_without_logprobs_is_refused_in_vllms_words_and_stores_nothing(gw):
    answer = await gw.chat("r1", top_logprobs=2)

    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == (
        "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"
    )
    assert gw.engine.requests == []
    assert (await gw.client.get("/rollouts/r1")).status_code == 404


async def test_the_turn_limit_refuses_the_next_call_and_records_why(start):
    gw = await start(max_turns=1)
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [2], "a"))
    assert (await gw.chat("r1")).status_code == 200

    answer = await gw.chat("r1")

    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "rollout_turn_limit")
    assert answer.json()["error"]["message"] == "rollout 'r1' reached its limit of 1 model calls"
    rollout = await gw.rollout("r1")
    assert rollout["end_reason"] == "max_turns"
    assert [(t["status"], t["http_status"]) for t in rollout["turns"]] == [("ok", 200), ("refused", 400)]
    assert len(gw.engine.requests) == 1


async def test_the_context_limit_counts_the_prompt_and_cuts_the_reply_to_fit(start):
    gw = await start(max_context_tokens=10)
    gw.engine.answer("/tokenize", FakeReply(200, b'{"tokens": [1, 2, 3, 4], "count": 4}'))
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3, 4], [5], "a"))

    answer = await gw.chat("r1", max_tokens=100)

    assert answer.status_code == 200
    assert gw.engine.requests[1][1]["max_tokens"] == 6


async def test_a_prompt_that_fills_the_context_limit_is_a_refused_turn_with_its_ids(start):
    gw = await start(max_context_tokens=4)
    gw.engine.answer("/tokenize", FakeReply(200, b'{"tokens": [1, 2, 3, 4], "count": 4}'))

    answer = await gw.chat("r1")

    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "context_length_exceeded")
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["status"], turn["prompt_token_ids"]) == ("refused", [1, 2, 3, 4])


async def test_a_tokenize_answer_without_tokens_is_a_502_error_turn(start):
    gw = await start(max_context_tokens=4)
    gw.engine.answer("/tokenize", FakeReply(200, b'{"count": 4}'))

    answer = await gw.chat("r1")

    assert (answer.status_code, answer.json()["error"]["message"]) == (
        502,
        "backend's /tokenize answered without tokens",
    )
    assert (await gw.rollout("r1"))["turns"][0]["status"] == "error"


async def test_a_finished_rollout_refuses_further_calls_with_409(gw):
    assert (await gw.client.post("/rollouts", json={"rollout_id": "r1"})).status_code == 201
    assert (await gw.client.post("/rollouts/r1/finish")).status_code == 200

    answer = await gw.chat("r1")

    assert (answer.status_code, answer.json()["error"]["code"]) == (409, "rollout_finished")
    assert gw.engine.requests == []


async def test_the_policy_version_is_stamped_at_the_start_and_the_end_of_a_turn(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [2], "a"))
    assert (await gw.client.post("/admin/policy_version", json={"version": "7"})).status_code == 200

    await gw.chat("r1")

    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["policy_version"], turn["policy_version_end"]) == ("7", "7")


@pytest.mark.parametrize("count", ["²", "-1", "1e3", "99999999999", ""])
async def test_a_retry_count_that_is_no_small_number_counts_as_a_first_attempt(gw, count):
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [5], "x"))

    answer = await gw.client.post(
        "/rollouts/r1/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-stainless-retry-count": count.encode("latin-1")},
    )

    assert answer.status_code == 200
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["status"], turn["attempt"], turn["retry_of"]) == ("ok", 0, None)


async def test_a_retry_count_is_recorded_as_the_attempt(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [5], "x"))

    await gw.client.post(
        "/rollouts/r1/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-stainless-retry-count": "2"},
    )

    assert (await gw.rollout("r1"))["turns"][0]["attempt"] == 2


async def test_a_process_that_cannot_confirm_the_fleet_turns_agent_calls_away_with_a_503_to_retry(gw):
    gw.app.state.turns.traffic.confirmed = lambda: False  # as when its heartbeats have failed for a while

    answer = await gw.chat("r1")

    error = answer.json()["error"]
    assert (answer.status_code, error["code"], answer.headers["x-should-retry"]) == (
        503,
        "store_unavailable",
        "true",
    )
    assert (
        error["message"] == "the gateway cannot reach its store to confirm the policy version; retry shortly"
    )
    assert gw.engine.requests == []  # no engine time spent, nothing stored
    assert (await gw.client.get("/rollouts/r1")).status_code == 404


async def test_while_the_gateway_runs_the_youngest_objects_are_collected_by_ten_thousands(start):
    """Every call keeps hundreds of objects alive while it runs: at the interpreter's default threshold the
    collector ran 200 times a second under load. The process's own setting comes back when the app stops."""
    before = gc.get_threshold()
    gw = await start()
    assert gc.get_threshold() == (10_000, 10, 10)
    await gw.stop()
    assert gc.get_threshold() == before
