"""A client's retry is one call: the retried turn records the attempt it repeats, and trainers never train on
both. Tested with the real openai SDK, whose first attempt times out while the gateway is paused."""

from __future__ import annotations

import threading

import httpx

from trainer_client import TrainerClient

from support import TIMEOUT, admin, on_store, stored_rollout, sync_agent, wait_for

pytestmark = on_store("sqlite")


class ImpatientFirstAttempt(httpx.HTTPTransport):
    """An agent's transport that gives up on a call's first attempt after two seconds without an answer and
    waits the suite's deadline for its retry: the SDK's own timeout is the same for every attempt, so a retry
    would otherwise have to be answered within the time its first attempt was given."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("x-stainless-retry-count", "0") == "0":
            request.extensions["timeout"] = {**request.extensions["timeout"], "read": 2.0}
        return super().handle_request(request)


# min_tokens: a reply that ends at once would be empty text, which the store keeps as null content; the seed:
# so would three tokens that are bytes of characters left unfinished, which vLLM leaves out of the text.
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "seed": 0,
    "extra_body": {"min_tokens": 3},
}


def test_sdk_retry_of_a_timed_out_call_repeats_it_and_is_trained_once(start_gateway, databases, db_kind):
    db_url = databases.new(db_kind)
    gateway = start_gateway(db_url)
    rollout = httpx.post(gateway.url + "/rollouts", json={"group_id": "g"}, timeout=TIMEOUT).json()
    agent = sync_agent(
        rollout["base_url"],
        max_retries=1,
        http_client=httpx.Client(transport=ImpatientFirstAttempt(), timeout=TIMEOUT),
    )
    replies: list = []

    admin(gateway, "/pause", json={"mode": "wait"}).raise_for_status()  # nothing is answered until resume
    caller = threading.Thread(target=lambda: replies.append(agent.chat.completions.create(**CHAT)))
    caller.start()
    wait_for(lambda: admin(gateway, "/state").json()["waiting"] == 2)  # the timed-out attempt and its retry
    admin(gateway, "/resume").raise_for_status()
    caller.join(timeout=TIMEOUT)
    wait_for(lambda: len(stored_rollout(gateway, rollout["rollout_id"])["turns"]) == 2)

    turns = {t["attempt"]: t for t in stored_rollout(gateway, rollout["rollout_id"])["turns"]}
    first, retry = turns[0], turns[1]
    assert (first["status"], retry["status"]) == ("ok", "ok")
    assert retry["retry_of"] == first["index"] and first["retry_of"] is None
    assert retry["content"] == replies[0].choices[0].message.content
    httpx.post(
        f"{gateway.url}/rollouts/{rollout['rollout_id']}/finish", json={"reward": 1.0}, timeout=TIMEOUT
    ).raise_for_status()
    with TrainerClient(db_url) as client:
        samples = client.read().samples
    trained = [(s.turn_index, s.masked) for s in samples]
    assert sorted(trained) == sorted([(first["index"], True), (retry["index"], False)])
