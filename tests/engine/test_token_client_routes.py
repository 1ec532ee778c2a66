"""The token routes against the real vLLM: a client that keeps its own ids (as verifiers' token client does)
tokenizes through the gateway and sends its next prompt as ids; the turn holds exactly those ids."""

from __future__ import annotations

import httpx
import pytest

from support import TIMEOUT, VLLM_HEADERS, on_store, stored_rollout

pytestmark = on_store("sqlite")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_stitches_its_own_ids_gets_a_turn_of_exactly_those_ids(gateway, vllm, stream):
    created = httpx.post(gateway.url + "/rollouts", json={"group_id": "token-client"}, timeout=TIMEOUT).json()
    base, root = created["base_url"], created["base_url"].removesuffix("/v1")
    messages = [{"role": "user", "content": "Say something."}]
    first = httpx.post(
        base + "/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 8, "return_token_ids": True, "seed": 1},
        timeout=TIMEOUT,
    ).json()
    reply = first["choices"][0]
    # The bridge: the tokens the template puts after the reply, up to the next generation prompt.
    follow = [{"role": "user", "content": "More."}]
    bridge_body = {"model": "tiny", "messages": follow, "add_generation_prompt": True}
    bridge = httpx.post(root + "/tokenize", json=bridge_body, timeout=TIMEOUT).json()["tokens"]
    direct = httpx.post(
        vllm.url + "/tokenize", json=bridge_body, headers=VLLM_HEADERS, timeout=TIMEOUT
    ).json()
    assert bridge == direct["tokens"]
    stitched = first["prompt_token_ids"] + reply["token_ids"] + bridge
    conversation = [*messages, {"role": "assistant", "content": reply["message"]["content"]}, *follow]

    body = {"model": "tiny", "messages": conversation, "tokens": stitched, "max_tokens": 8, "seed": 2}
    body |= {"return_token_ids": True, "stream": stream}
    with httpx.stream("POST", base + "/chat/completions/tokens", json=body, timeout=TIMEOUT) as second:
        assert second.status_code == 200
        second.read()

    turns = stored_rollout(gateway, created["rollout_id"])["turns"]
    assert len(turns) == 2
    assert turns[1]["prompt_token_ids"] == stitched
    assert turns[1]["splice"] is None and turns[1]["status"] == "ok"
    assert len(turns[1]["completion_token_ids"]) == len(turns[1]["completion_logprobs"]) > 0


def test_detokenize_through_the_gateway_is_vllms(gateway, vllm):
    created = httpx.post(gateway.url + "/rollouts", json={"group_id": "token-client"}, timeout=TIMEOUT).json()
    root = created["base_url"].removesuffix("/v1")
    body = {"model": "tiny", "tokens": [100, 200, 300]}

    through = httpx.post(root + "/detokenize", json=body, timeout=TIMEOUT)
    direct = httpx.post(vllm.url + "/detokenize", json=body, headers=VLLM_HEADERS, timeout=TIMEOUT)

    assert (through.status_code, through.json()) == (200, direct.json())
