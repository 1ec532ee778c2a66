"""Real chat clients through the gateway on the real engine: LangChain's `ChatOpenAI` and the LiteLLM SDK,
each in a tool round trip (the model forced to call `ls`, the tool's result sent back, a second call), whole
and streamed. Each call must be a turn whose prompt ids are what vLLM renders for the request the client
actually sent (clients rewrite requests: key order, dropped nulls, fields of their own) and whose completion
ids and logprobs are the engine's, and the second turn must extend the first."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from support import (
    LS_TMP_CALL,
    LS_TMP_REGEX,
    TIMEOUT,
    TOOLS,
    detokenize,
    on_store,
    stored_rollout,
    tokenize_chat,
)

# LiteLLM touches pydantic attributes pydantic 2.11 deprecated; its warnings say nothing about the gateway.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Accessing the 'model_:DeprecationWarning"),
    on_store("sqlite"),
]

FORCE_LS = {"structured_outputs": {"regex": LS_TMP_REGEX}}
QUESTION = "What is in /tmp?"
LS_OUTPUT = "a.txt\nb.txt"
LS_ARGUMENTS = '{"path": "/tmp"}'  # as vLLM's hermes parser serializes the forced call's arguments


@tool
def ls(path: str) -> str:
    """List a directory."""
    return LS_OUTPUT


# What LangChain makes of `ls`: TOOLS' schema with its keys in pydantic's order (vLLM renders it as sent).
LANGCHAIN_LS_TOOL = {
    "type": "function",
    "function": {
        "name": "ls",
        "description": "List a directory.",
        "parameters": {"properties": {"path": {"type": "string"}}, "required": ["path"], "type": "object"},
    },
}


@pytest.fixture(scope="module")
def litellm_sdk() -> ModuleType:
    """The LiteLLM SDK, imported without its start-up download of a model price list (no network here)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


def new_rollout(gateway: Any) -> dict[str, Any]:
    response = httpx.post(gateway.url + "/rollouts", json={"group_id": "clients"}, timeout=TIMEOUT)
    response.raise_for_status()
    return response.json()


@pytest.fixture
def recorder() -> Iterator[tuple[httpx.Client, list[dict[str, Any]]]]:
    """An HTTP client for a client library that keeps every JSON body it sends: what the library actually put
    on the wire."""
    sent: list[dict[str, Any]] = []

    def keep(request: httpx.Request) -> None:
        sent.append(json.loads(request.read()))

    with httpx.Client(event_hooks={"request": [keep]}, timeout=TIMEOUT) as client:
        yield client, sent


def assert_engine_turn(vllm: Any, turn: dict[str, Any], request: dict[str, Any], output_tokens: int) -> None:
    """The turn holds vLLM's own render of the request as it arrived, and the engine's sampled ids with one
    logprob each, as many as the client was told it was charged for."""
    assert turn["messages"] == request["messages"]
    assert turn["tools"] == request["tools"]
    assert turn["prompt_token_ids"] == tokenize_chat(vllm, request["messages"], request["tools"])
    assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"]) == output_tokens


# LangChain's ChatOpenAI ---------------------------------------------------------------------------------


def langchain_agent(base_url: str, http_client: httpx.Client, stream: bool) -> ChatOpenAI:
    return ChatOpenAI(
        model="tiny",
        base_url=base_url,
        api_key="unused",
        max_retries=0,
        temperature=0.0,
        max_tokens=80,
        streaming=stream,
        stream_usage=True,
        http_client=http_client,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_langchain_tool_round_trip_is_two_turns_with_the_engines_exact_ids(gateway, vllm, recorder, stream):
    created = new_rollout(gateway)
    http_client, sent = recorder
    llm = langchain_agent(created["base_url"], http_client, stream)
    history: list[BaseMessage] = [HumanMessage(QUESTION)]

    first = llm.bind_tools([ls], extra_body=FORCE_LS).invoke(history)
    assert isinstance(first, AIMessage)
    (call,) = first.tool_calls
    history += [first, ls.invoke(call)]  # the tool runs and answers as a ToolMessage
    second = llm.bind_tools([ls]).invoke(history, max_tokens=8)
    assert isinstance(second, AIMessage)

    turns = stored_rollout(gateway, created["rollout_id"])["turns"]
    assert [t["parent_turn"] for t in turns] == [None, 0]
    finishes = [reply.response_metadata["finish_reason"] for reply in (first, second)]
    assert [t["finish_reason"] for t in turns] == finishes
    assert finishes[0] == "tool_calls"
    assert [t["stream"] for t in turns] == [stream, stream]
    # What LangChain sent: its own tool schema, the AIMessage back as a chat message, the tool's result.
    assert [body["tools"] for body in sent] == [[LANGCHAIN_LS_TOOL], [LANGCHAIN_LS_TOOL]]
    assert list(sent[0]["tools"][0]["function"]["parameters"]) == ["properties", "required", "type"]
    # Key order reaches the prompt: the turn holds the schema as LangChain ordered it, not as TOOLS does.
    assert turns[0]["prompt_token_ids"] != tokenize_chat(vllm, sent[0]["messages"], TOOLS)
    assert sent[1]["messages"] == [
        {"content": QUESTION, "role": "user"},
        {
            "content": None,
            "role": "assistant",
            "tool_calls": [
                {"type": "function", "id": call["id"], "function": {"name": "ls", "arguments": LS_ARGUMENTS}}
            ],
        },
        {"content": LS_OUTPUT, "role": "tool", "tool_call_id": call["id"]},
    ]
    # The tool call the agent saw is the stored one.
    assert call == {
        "name": "ls",
        "args": {"path": "/tmp"},
        "id": turns[0]["tool_calls"][0]["id"],
        "type": "tool_call",
    }
    assert turns[0]["tool_calls"] == [
        {"id": call["id"], "type": "function", "function": {"name": "ls", "arguments": LS_ARGUMENTS}}
    ]
    for turn, request, reply in zip(turns, sent, (first, second), strict=True):
        assert reply.usage_metadata is not None
        assert_engine_turn(vllm, turn, request, reply.usage_metadata["output_tokens"])
    assert detokenize(vllm, turns[0]["completion_token_ids"]).startswith(LS_TMP_CALL)
    assert isinstance(second.content, str)
    assert detokenize(vllm, turns[1]["completion_token_ids"]).startswith(second.content)
    assert turns[1]["content"] == (second.content or None)


# The LiteLLM SDK --------------------------------------------------------------------------------------------


def litellm_call(
    litellm: ModuleType, base_url: str, messages: list[Any], stream: bool, **request: Any
) -> tuple[Any, str, int]:
    """One `litellm.completion` as an agent makes it: the reply message, its finish reason and the completion
    tokens LiteLLM reports. A stream is put together with LiteLLM's own `stream_chunk_builder`, as LiteLLM
    users do; the finish reason is the one the stream carried (the builder reports a tool-call reply as
    `stop`)."""
    kwargs = {
        "model": "openai/tiny",
        "api_base": base_url,
        "api_key": "unused",
        "messages": messages,
        "tools": TOOLS,
        "temperature": 0.0,
        "num_retries": 0,
        **request,
    }
    if not stream:
        reply = litellm.completion(**kwargs)
        return reply.choices[0].message, reply.choices[0].finish_reason, reply.usage.completion_tokens
    chunks = list(litellm.completion(**kwargs, stream=True, stream_options={"include_usage": True}))
    (finish,) = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    built = litellm.stream_chunk_builder(chunks, messages=messages)
    return built.choices[0].message, finish, built.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_litellm_tool_round_trip_is_two_turns_with_the_engines_exact_ids(gateway, vllm, litellm_sdk, stream):
    created = new_rollout(gateway)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]

    first, first_finish, first_tokens = litellm_call(
        litellm_sdk, created["base_url"], messages, stream, max_tokens=80, extra_body=FORCE_LS
    )
    (call,) = first.tool_calls
    # LiteLLM users append the reply object itself; LiteLLM serializes it for the next request.
    messages += [first, {"role": "tool", "tool_call_id": call.id, "content": LS_OUTPUT}]
    second, second_finish, second_tokens = litellm_call(
        litellm_sdk, created["base_url"], messages, stream, max_tokens=8
    )

    turns = stored_rollout(gateway, created["rollout_id"])["turns"]
    assert [t["parent_turn"] for t in turns] == [None, 0]
    assert [t["stream"] for t in turns] == [stream, stream]
    assert [t["finish_reason"] for t in turns] == [first_finish, second_finish]
    assert first_finish == "tool_calls"
    # The tool call the agent saw is the stored one.
    assert (call.id, call.function.name, call.function.arguments) == (
        turns[0]["tool_calls"][0]["id"],
        "ls",
        LS_ARGUMENTS,
    )
    # What arrived: LiteLLM passes the tool schema and the sampling fields through (extra_body merged in)...
    assert turns[0]["tools"] == turns[1]["tools"] == TOOLS
    stream_fields = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    assert turns[0]["params"] == {
        "model": "tiny",
        **stream_fields,
        "max_tokens": 80,
        "temperature": 0.0,
        **FORCE_LS,
    }
    # ...but re-serializes its own reply object: `content: null` dropped, `provider_specific_fields` added
    # (a whole reply's carries vLLM's `refusal` and `reasoning`; a built stream's is empty).
    extra = {"provider_specific_fields": {"refusal": None, "reasoning": None}} if not stream else {}
    tool_call = {"function": {"arguments": LS_ARGUMENTS, "name": "ls"}, "id": call.id, "type": "function"}
    arrived = [
        {"messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS},
        {
            "messages": [
                {"role": "user", "content": QUESTION},
                {"role": "assistant", "tool_calls": [tool_call], **extra},
                {"role": "tool", "tool_call_id": call.id, "content": LS_OUTPUT},
            ],
            "tools": TOOLS,
        },
    ]
    for turn, request, tokens in zip(turns, arrived, (first_tokens, second_tokens), strict=True):
        assert_engine_turn(vllm, turn, request, tokens)
    # LiteLLM's additions do not change what vLLM renders: the plain chat history gives the same prompt.
    plain = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call.id, "content": LS_OUTPUT},
    ]
    assert turns[1]["prompt_token_ids"] == tokenize_chat(vllm, plain, TOOLS)
    assert detokenize(vllm, turns[0]["completion_token_ids"]).startswith(LS_TMP_CALL)
    assert detokenize(vllm, turns[1]["completion_token_ids"]).startswith(second.content or "")
    assert turns[1]["content"] == second.content
