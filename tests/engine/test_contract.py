"""The public surface as a contract: `/openapi.json` documents every route, and a schema-driven fuzzer
(schemathesis) finds no server error, no error outside the OpenAI format and no 2xx that breaks its schema,
against the running gateway on the real engine, on SQLite and PostgreSQL: each route on its own, and agent
calls on the rollouts `POST /rollouts` creates (its answer's `rollout_id` linked to the agent routes' path),
under a context limit, so that the gateway counts, packs and records what the fuzzer sends."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.generation.stateful import run_state_machine_as_test
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from support import TIMEOUT, admin

MAX_EXAMPLES = 25
"""Per operation: bounded, so that the run costs about a minute of engine time."""
LINKED_SCENARIOS = 12
"""Scenarios of the linked run (a rollout created, then calls on it): a few seconds of engine time."""
AGENT_ROUTE = re.compile(r"^/rollouts/\{rollout_id\}/(v1/|tokenize$|detokenize$)")


def test_every_route_documents_its_request_and_its_answers(gateway):
    document = httpx.get(gateway.url + "/openapi.json", timeout=TIMEOUT).json()

    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            name = f"{method.upper()} {path}"
            responses = operation["responses"]
            assert "200" in responses or "201" in responses, name
            ok = responses.get("200") or responses["201"]
            assert ok["content"], name
            if (method == "post" and not path.startswith("/admin/")) or path == "/admin/policy_version":
                assert "requestBody" in operation, name
            for status, response in responses.items():
                if status.startswith(("4", "5")):
                    schema = response["content"]["application/json"]["schema"]
                    expected = "Readiness" if name == "GET /readyz" else "ErrorResponse"  # a probe's report
                    assert schema == {"$ref": f"#/components/schemas/{expected}"}, name
    chat = document["paths"]["/rollouts/{rollout_id}/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert {"messages", "model", "stream", "n", "tools"} <= set(
        document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    )


def _checked(response, case) -> None:
    case.validate_response(response, checks=CHECKS)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]


CHECKS = (not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance)


def _bounded(case) -> None:
    """Keep generation cheap on a CPU engine: at most 2 choices of at most 8 tokens."""
    if isinstance(case.body, dict):
        if isinstance(case.body.get("n"), int):
            case.body["n"] = min(max(case.body["n"], 1), 2)
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(case.body.get(key), int) and case.body[key] > 8:
                case.body[key] = 8
        if "messages" in case.body or "prompt" in case.body:
            case.body.setdefault("max_tokens", 8)
        if "input" in case.body:
            case.body.setdefault("max_output_tokens", 8)


@pytest.fixture
def fuzzed(start_gateway, databases, db_kind):
    """A gateway of its own: the fuzzer pauses it, changes its policy version and finishes its rollouts. The
    engine it shares with other tests is resumed and set back to version 0 afterwards."""
    gateway = start_gateway(databases.new(db_kind), "--pause-timeout", "1")
    yield gateway
    admin(gateway, "/resume").raise_for_status()
    admin(gateway, "/policy_version", json={"version": "0"}).raise_for_status()


@pytest.mark.parametrize("kind", ["positive", "negative"])
def test_fuzzed_requests_get_no_server_error_and_only_documented_answers(fuzzed, kind):
    schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")
    schema.config.generation.update(modes=[GenerationMode(kind)])
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 25
    operations.sort(key=lambda operation: operation.path.startswith("/admin"))  # the pause comes last

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case) -> None:
            _bounded(case)
            _checked(case.call(timeout=TIMEOUT), case)

        fuzz()


def _linked(document: dict[str, Any]) -> dict[str, Any]:
    """The document with links from `POST /rollouts`'s answer to every agent route, by the rollout id, and
    only those operations: the rollout is created, then called on as an agent calls."""
    links = {}
    paths = {}
    for path, operations in document["paths"].items():
        if AGENT_ROUTE.match(path):
            paths[path] = operations
            pointer = path.replace("~", "~0").replace("/", "~1")
            for method in operations:
                name = re.sub(r"\W+", "_", f"{method}{path}")
                links[name] = {
                    "operationRef": f"#/paths/{pointer}/{method}",
                    "parameters": {"path.rollout_id": "$response.body#/rollout_id"},
                }
    create = document["paths"]["/rollouts"]["post"]
    create["responses"]["201"]["links"] = links
    paths["/rollouts"] = {"post": create}
    return {**document, "paths": paths}


@pytest.mark.parametrize("kind", ["positive", "negative"])
def test_agent_calls_on_created_rollouts_get_no_server_error(start_gateway, databases, kind):
    limited = start_gateway(databases.new("sqlite"), "--max-context-tokens", "300")
    document = httpx.get(limited.url + "/openapi.json", timeout=TIMEOUT).json()
    schema = schemathesis.openapi.from_dict(_linked(document))
    schema.config.update(base_url=limited.url)
    schema.config.generation.update(modes=[GenerationMode(kind)])
    machine = schema.as_state_machine()
    assert schema.statistic.transitions.total == 10  # POST /rollouts to each agent operation
    linked: list[str] = []

    class Linked(machine):
        def before_call(self, case) -> None:
            _bounded(case)
            if case.path == "/rollouts":
                # A new rollout every time (201, its link followed), so that a scenario replays as it ran
                # and the negative run's agent calls are made: the fuzzer aims at those.
                if isinstance(case.body, dict) and kind == "positive":
                    for key in ("rollout_id", "group_id", "group_size"):
                        case.body.pop(key, None)
                else:
                    case.body = {}

        def get_call_kwargs(self, case) -> dict[str, Any]:
            return {"timeout": 120}

        def validate_response(self, response, case, additional_checks=None, **kwargs) -> None:
            _checked(response, case)
            if AGENT_ROUTE.match(case.path):
                linked.append(f"{case.method} {case.path}")

    run_state_machine_as_test(
        Linked,
        settings=settings(
            max_examples=LINKED_SCENARIOS,
            stateful_step_count=4,
            phases=[Phase.generate],
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )

    assert len(set(linked)) >= 5, linked  # the links are followed: calls on the created rollouts
