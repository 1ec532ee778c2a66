"""The OpenAI Responses dialect in process: the `openai` SDK's Responses API against `create_app` and a
scripted engine. Requests become chat requests for the engine; its chat replies, whole or streamed, come back
as responses; a rollout's responses are its turns."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import openai
import orjson
import pytest

from support import assert_openai_error, async_agent
from support.fake_engine import FakeReply, chat_reply, chat_stream, error_reply

pytestmark = pytest.mark.anyio

PROMPT = [1, 10, 11, 2]
TOOL = {
    "type": "function",
    "name": "ls",
    "description": "List a directory.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "ls", "parameters": TOOL["parameters"], "description": "List a directory."},
}
CALL = {
    "id": "chatcmpl-tool-1",
    "type": "function",
    "function": {"name": "ls", "arguments": '{"path": "/tmp"}'},
}


def agent(gw: Any, rollout_id: str = "r1") -> openai.AsyncOpenAI:
    """The SDK on its own HTTP library (httpx2), reaching the app in process."""
    client = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gw.app), base_url="http://gateway")
    return async_agent(f"http://gateway/rollouts/{rollout_id}/v1", http_client=client)


def sent(gw: Any) -> dict[str, Any]:
    """The chat request the engine received last."""
    return gw.engine.requests[-1][1]


def tool_stream(prompt_ids: list[int]) -> FakeReply:
    """A streamed reply with some reasoning, then a tool call whose arguments come in two pieces."""
    chunks: list[dict[str, Any]] = [
        {"prompt_token_ids": prompt_ids, "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "Look."}, "token_ids": [30]}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [{**CALL, "index": 0, "function": {"name": "ls", "arguments": ""}}]
                    },
                    "token_ids": [40],
                }
            ]
        },
        {
            "choices": [
                {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"path": '}}]}}
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"/tmp"}'}}]},
                    "token_ids": [41, 2],
                    "finish_reason": "tool_calls",
                }
            ]
        },
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 4}},
    ]
    for chunk in chunks:
        chunk.update(id="chatcmpl-fake", object="chat.completion.chunk", model="tiny")
    data = [b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks]
    return FakeReply(200, chunks=[*data, b"data: [DONE]\n\n"])


async def test_a_whole_reply_is_a_response_and_the_turn_keeps_the_engines_ids(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [5, 6, 2], "Hello."))

    reply = await agent(gw).responses.create(
        model="tiny",
        instructions="Be brief.",
        input="Hi",
        max_output_tokens=64,
        temperature=0.5,
        extra_body={"seed": 3},
    )

    assert (reply.status, reply.output_text, reply.usage.input_tokens, reply.usage.output_tokens) == (
        "completed",
        "Hello.",
        4,
        3,
    )
    assert reply.id.startswith("resp_") and reply.instructions == "Be brief."
    request = sent(gw)
    assert request["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert (request["max_tokens"], request["temperature"], request["seed"]) == (64, 0.5, 3)
    (turn,) = (await gw.rollout("r1", include_messages="true"))["turns"]
    assert (turn["prompt_token_ids"], turn["completion_token_ids"], turn["content"]) == (
        PROMPT,
        [5, 6, 2],
        "Hello.",
    )
    assert (turn["endpoint"], turn["response_id"]) == ("responses", reply.id)
    assert turn["request"] == {
        "model": "tiny",
        "instructions": "Be brief.",
        "max_output_tokens": 64,
        "temperature": 0.5,
        "seed": 3,
    }


async def test_input_items_become_one_assistant_message_per_reply_and_tool_messages(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [7, 2], "a.txt is there."))
    items = [
        {"role": "developer", "content": "List things."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is in /tmp?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "ls."}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call-1",
            "name": "ls",
            "arguments": '{"path": "/tmp"}',
        },
        {
            "type": "function_call",
            "id": "fc_2",
            "call_id": "call-2",
            "name": "ls",
            "arguments": '{"path": "/"}',
        },
        {"type": "function_call_output", "call_id": "call-1", "output": "a.txt"},
        {
            "type": "function_call_output",
            "call_id": "call-2",
            "output": [{"type": "input_text", "text": "tmp"}],
        },
    ]

    await agent(gw).responses.create(model="tiny", input=items, tools=[TOOL], tool_choice="auto")

    request = sent(gw)
    assert request["messages"] == [
        {"role": "system", "content": "List things."},
        {"role": "user", "content": "What is in /tmp?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "ls.",
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"path": "/tmp"}'},
                },
                {
                    "id": "call-2",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"path": "/"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call-2", "content": "tmp"},
    ]
    assert (request["tools"], request["tool_choice"]) == ([CHAT_TOOL], "auto")


async def test_a_tool_call_is_a_function_call_item_and_previous_response_id_continues_it(gw):
    gw.engine.answer(
        "/v1/chat/completions",
        chat_reply(PROMPT, [40, 41, 2], "", finish_reason="tool_calls", tool_calls=[CALL]),
    )
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [7, 2], "a.txt is there."))
    client = agent(gw)

    first = await client.responses.create(
        model="tiny", instructions="Be brief.", input="What is in /tmp?", tools=[TOOL]
    )
    (call,) = first.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"}
    second = await client.responses.create(
        model="tiny", instructions="Be briefer.", input=[output], previous_response_id=first.id, tools=[TOOL]
    )

    assert (call.type, call.name, call.arguments, call.call_id) == (
        "function_call",
        "ls",
        '{"path": "/tmp"}',
        CALL["id"],
    )
    assert second.output_text == "a.txt is there."
    assert sent(gw)["messages"] == [  # the new instructions replace the old ones
        {"role": "system", "content": "Be briefer."},
        {"role": "user", "content": "What is in /tmp?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": "a.txt"},
    ]
    turns = (await gw.rollout("r1"))["turns"]
    assert [t["response_id"] for t in turns] == [first.id, second.id]


async def test_a_stored_response_reads_back_as_it_was_created(gw):
    gw.engine.answer(
        "/v1/chat/completions",
        chat_reply(PROMPT, [40, 41, 2], "Listing.", finish_reason="tool_calls", tool_calls=[CALL]),
    )
    client = agent(gw)
    created = await client.responses.create(
        model="tiny", input="What is in /tmp?", tools=[TOOL], metadata={"k": "v"}
    )

    fetched = await client.responses.retrieve(created.id)

    assert fetched.model_dump() == created.model_dump()
    assert [item.type for item in fetched.output] == ["message", "function_call"]


async def test_store_false_records_the_turn_but_the_response_cannot_be_fetched_or_continued(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [5, 2], "Hi."))
    created = await agent(gw).responses.create(model="tiny", input="Hi", store=False)

    fetched = await gw.client.get(f"/rollouts/r1/v1/responses/{created.id}")
    continued = await gw.client.post(
        "/rollouts/r1/v1/responses",
        json={"model": "tiny", "input": "More", "previous_response_id": created.id},
    )

    assert_openai_error(fetched, 404, "response_not_found")
    error = assert_openai_error(continued, 400, "previous_response_not_found")
    assert error["param"] == "previous_response_id"
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["status"], turn["content"], turn["response_id"]) == ("ok", "Hi.", None)


async def test_a_streamed_reply_is_the_responses_event_sequence(gw):
    gw.engine.answer("/v1/chat/completions", tool_stream(PROMPT))

    stream = await agent(gw).responses.create(
        model="tiny", input="What is in /tmp?", tools=[TOOL], stream=True
    )
    events = [event async for event in stream]

    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1].response
    reasoning, call = completed.output
    assert (reasoning.type, reasoning.content[0].text) == ("reasoning", "Look.")
    assert (call.name, call.arguments, call.call_id) == ("ls", '{"path": "/tmp"}', CALL["id"])
    assert (completed.usage.input_tokens, completed.usage.output_tokens) == (4, 4)
    assert sent(gw)["stream_options"] == {"include_usage": True}
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["stream"], turn["completion_token_ids"], turn["finish_reason"]) == (
        True,
        [30, 40, 41, 2],
        "tool_calls",
    )
    assert turn["tool_calls"][0]["function"]["arguments"] == '{"path": "/tmp"}'


async def test_the_sdks_stream_helper_assembles_a_streamed_text_reply(gw):
    gw.engine.answer("/v1/chat/completions", chat_stream(PROMPT, [(5, "Hel"), (6, "lo"), (2, "")]))

    async with agent(gw).responses.stream(model="tiny", input="Hi") as stream:
        final = await stream.get_final_response()

    assert (final.status, final.output_text) == ("completed", "Hello")
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["content"], turn["completion_token_ids"], turn["response_id"]) == (
        "Hello",
        [5, 6, 2],
        final.id,
    )


async def test_a_reply_cut_by_max_output_tokens_is_incomplete(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [5, 6], "Hel", finish_reason="length"))

    reply = await agent(gw).responses.create(model="tiny", input="Hi", max_output_tokens=2)

    assert (reply.status, reply.incomplete_details.reason) == ("incomplete", "max_output_tokens")


async def test_custom_and_namespaced_tools_are_shown_as_functions_and_mapped_back(gw):
    call = {
        "id": "call-9",
        "type": "function",
        "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin"}'},
    }
    nested = {"id": "call-8", "type": "function", "function": {"name": "fs__read", "arguments": '{"p": 1}'}}
    gw.engine.answer(
        "/v1/chat/completions",
        chat_reply(PROMPT, [40, 2], "", finish_reason="tool_calls", tool_calls=[call, nested]),
    )
    tools = [
        {"type": "custom", "name": "apply_patch", "description": "Patch files."},
        {
            "type": "namespace",
            "name": "fs",
            "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}],
        },
        {"type": "web_search"},
    ]

    reply = await agent(gw).responses.create(model="tiny", input="Fix it.", tools=tools)  # type: ignore[arg-type]

    assert [tool["function"]["name"] for tool in sent(gw)["tools"]] == ["apply_patch", "fs__read"]
    custom, function = reply.output
    assert (custom.type, custom.name, custom.input, custom.call_id) == (
        "custom_tool_call",
        "apply_patch",
        "*** Begin",
        "call-9",
    )
    assert (function.type, function.name, function.namespace) == ("function_call", "read", "fs")


@pytest.mark.parametrize(
    ("item", "param"),
    [
        (
            {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
            "input.0.content.0.type",
        ),
        ({"type": "item_reference", "id": "msg_1"}, "input.0.type"),
        ({"type": "web_search_call", "id": "ws_1"}, "input.0.type"),
    ],
)
async def test_input_the_model_cannot_take_is_a_400_naming_it(gw, item, param):
    answer = await gw.client.post("/rollouts/r1/v1/responses", json={"model": "tiny", "input": [item]})

    error = assert_openai_error(answer, 400, "unsupported_content")
    assert error["param"] == param
    assert gw.engine.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [({"input": "Hi"}, "model"), ({"model": "tiny"}, "input"), ({"model": "tiny", "input": 3}, "input")],
)
async def test_a_request_without_model_or_input_is_a_422(gw, body, param):
    answer = await gw.client.post("/rollouts/r1/v1/responses", json=body)

    error = assert_openai_error(answer, 422, "invalid_request")
    assert error["param"] == param


async def test_an_unknown_response_is_a_404(gw):
    answer = await gw.client.get("/rollouts/r1/v1/responses/resp_nothing")

    assert_openai_error(answer, 404, "response_not_found")


async def test_a_rollout_key_opens_every_dialect_and_no_other_key_does(start):
    gw = await start(rollout_keys=True)
    created = (await gw.client.post("/rollouts", json={"rollout_id": "keyed"})).json()
    key = created["api_key"]
    for _ in range(3):
        gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [5, 2], "Hi."))
    transport = httpx2.ASGITransport(app=gw.app)
    openai_agent = async_agent(created["base_url"], key, http_client=httpx2.AsyncClient(transport=transport))
    anthropic_agent = anthropic.AsyncAnthropic(
        api_key=key,  # sent as x-api-key, with anthropic-version
        base_url=created["anthropic_base_url"],
        http_client=httpx2.AsyncClient(transport=transport),
        max_retries=0,
    )

    reply = await openai_agent.responses.create(model="tiny", input="Hi")
    await openai_agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    await anthropic_agent.messages.create(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
    )
    fetched = await openai_agent.responses.retrieve(reply.id)

    assert fetched.id == reply.id
    assert [t["endpoint"] for t in (await gw.rollout("keyed"))["turns"]] == ["responses", "chat", "messages"]
    for path, headers in [
        ("/responses", {"authorization": "Bearer wrong"}),
        ("/messages", {"x-api-key": "wrong", "anthropic-version": "2023-06-01"}),
        (f"/responses/{reply.id}", {}),
    ]:
        url = f"/rollouts/keyed/v1{path}"
        body = {
            "model": "tiny",
            "input": "Hi",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hi"}],
        }
        answer = await (
            gw.client.get(url, headers=headers)
            if path.startswith("/responses/")
            else gw.client.post(url, json=body, headers=headers)
        )
        assert_openai_error(answer, 401, "invalid_api_key")
    assert len((await gw.rollout("keyed"))["turns"]) == 3


async def test_a_failed_call_reads_back_as_a_failed_response_that_cannot_be_continued(gw):
    gw.engine.answer("/v1/chat/completions", error_reply(400, "This model's maximum context length is 2048"))

    answer = await gw.client.post("/rollouts/r1/v1/responses", json={"model": "tiny", "input": "Hi"})
    (turn,) = (await gw.rollout("r1"))["turns"]
    fetched = await gw.client.get(f"/rollouts/r1/v1/responses/{turn['response_id']}")
    continued = await gw.client.post(
        "/rollouts/r1/v1/responses",
        json={"model": "tiny", "input": "More", "previous_response_id": turn["response_id"]},
    )

    assert answer.status_code == 400 and turn["status"] == "error"
    assert (fetched.json()["status"], fetched.json()["error"]["code"]) == ("failed", "turn_error")
    assert_openai_error(continued, 400, "previous_response_failed")
    assert len((await gw.rollout("r1"))["turns"]) == 1
