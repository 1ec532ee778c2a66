"""A scripted stand-in for the gateway's engine client (`gateway.fleet.engine.Engine`), for the in-process
tier: each POST gets the reply the test queued for its path (vLLM's shapes), or raises the transport failure
queued instead. Calls are routed by the app's own fleet (placement, pins in the store) as the real client's
are; only the sending is scripted."""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import orjson

from gateway.fleet.fleet import Fleet
from gateway.fleet.health import Found
from gateway.fleet.leaders import Ahead
from gateway.fleet.replies import BackendFailure, BackendStreamError, Routed
from gateway.fleet.servers import Server

URL = "http://fake-engine"


class FakeReply:
    """What `BackendReply` offers: a status, the whole body, or its chunks read in turn; `broken` cuts it
    off at the end."""

    def __init__(
        self, status: int, content: bytes = b"", chunks: list[bytes] | None = None, broken: bool = False
    ):
        self.status = status
        self._content = content
        self._chunks = list(chunks if chunks is not None else [content])
        self._broken = broken
        self.closed = False

    async def body(self) -> bytes:
        if self._broken:
            raise BackendStreamError("backend reply broke off: connection closed mid-reply")
        return self._content

    async def read(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        if self._broken:
            raise BackendStreamError("backend stream broke off: connection closed mid-reply")
        return b""

    def ended(self) -> None:
        """Let go of at the stream's [DONE], as `close` lets go of it otherwise."""
        self.closed = True

    def close(self) -> None:
        self.closed = True


class HeldReply(FakeReply):
    """A streamed reply whose chunks wait for `release`: a call in flight for as long as the test wants."""

    def __init__(self, reply: FakeReply, release: asyncio.Event) -> None:
        super().__init__(reply.status)
        self._reply, self._release = reply, release

    async def read(self) -> bytes:
        await self._release.wait()
        return await self._reply.read()

    async def body(self) -> bytes:
        return await self._reply.body()

    def ended(self) -> None:
        self._reply.ended()

    def close(self) -> None:
        self._reply.close()


class FakeEngine:
    """An `Engine` on the app's fleet (`create_app(..., engine=FakeEngine)`)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.exact = False
        """Whether the engine offers vLLM's token-in/token-out endpoints (exact mode)."""
        self.queued = 0
        """Calls waiting for a connection: none, the scripted replies wait for nothing."""
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.detokenize_failure: BackendFailure | None = None
        self._replies: defaultdict[str, deque[FakeReply | BackendFailure]] = defaultdict(deque)
        self._failures: defaultdict[str, deque[str]] = defaultdict(deque)
        self.aheads: list[tuple[str, Ahead]] = []
        """The calls that led their group's, with what they sent ahead."""

    @property
    def servers(self) -> dict[str, Server]:
        return self.fleet.servers

    def answer(self, path: str, reply: FakeReply | BackendFailure) -> None:
        self._replies[path].append(reply)

    async def route(self, rollout_id: str, model: str | None) -> tuple[Server, str | None]:
        return await self.fleet.route(rollout_id, model)

    async def send(
        self, rollout_id: str, path: str, body: bytes, model: str | None = None, ahead: Ahead | None = None
    ) -> Routed:
        server, moved_from = await self.route(rollout_id, model)
        self.requests.append((path, orjson.loads(body)))
        if ahead is not None:
            self.aheads.append((rollout_id, ahead))
        reply = self._replies[path].popleft()
        if isinstance(reply, BackendFailure):
            raise reply
        return Routed(server.url, reply, moved_from)  # type: ignore[arg-type]

    async def probe_scale_out(self, url: str) -> bool:
        return False

    async def exact_capable(self, server: Server) -> bool:
        return self.exact

    async def call_all(
        self,
        path: str,
        *,
        params: dict[str, str] | None = None,
        json: object = None,
        done: Callable[[Server], None] = lambda _server: None,
    ) -> None:
        """Every healthy server takes it."""
        self.requests.append((path, params or {}))
        for server in list(self.fleet.servers.values()):
            if server.healthy:
                done(server)

    async def call_one(self, url: str, body: object, params: dict[str, str] | None = None) -> str | None:
        """The failure queued for `url` (a server's URL and path), else success."""
        self.requests.append((url, body if isinstance(body, dict) else {}))
        failures = self._failures[url]
        return failures.popleft() if failures else None

    def fail(self, url: str, failure: str) -> None:
        """The next `call_one` to `url` (a server's URL and path) fails with `failure`."""
        self._failures[url].append(failure)

    async def post_any(self, path: str, body: Any, model: str | None) -> tuple[int, bytes]:
        """`/detokenize` of one id: the engine's text of it is `<id>`."""
        self.requests.append((path, body))
        if self.detokenize_failure is not None:
            raise self.detokenize_failure
        return 200, orjson.dumps({"prompt": f"<{body['tokens'][0]}>"})

    async def get(self, path: str) -> tuple[int, bytes]:
        return 200, orjson.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def check(self, server: Server) -> Found:
        """A check that changes nothing."""
        return Found(server.url, server.models, server.prefix_cache_hit_rate)

    async def close(self) -> None:
        pass


class Scripted:
    """What `create_app(..., engine=...)` is given: it builds the `FakeEngine` on the app's fleet as the app
    starts, for the test to script."""

    def __init__(self) -> None:
        self._engine: FakeEngine | None = None

    def __call__(self, fleet: Fleet) -> FakeEngine:
        self._engine = FakeEngine(fleet)
        return self._engine

    @property
    def engine(self) -> FakeEngine:
        assert self._engine is not None, "the app has not started"
        return self._engine


def chat_completion(
    prompt_ids: list[int],
    token_ids: list[int],
    content: str,
    *,
    finish_reason: str = "stop",
    tool_calls: list[dict[str, Any]] | None = None,
    spans: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A whole chat completion as vLLM answers a request with `return_token_ids` and `logprobs` (with the
    project's vLLM plugin, each choice carries its weight-version `spans`)."""
    logprobs = [{"token": f"t{t}", "logprob": -0.5 * (i + 1), "bytes": None} for i, t in enumerate(token_ids)]
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": tool_calls or []},
                "logprobs": {"content": logprobs},
                "finish_reason": finish_reason,
                "token_ids": token_ids,
                **({"weight_versions": spans} if spans is not None else {}),
            }
        ],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids)},
    }


def chat_reply(
    prompt_ids: list[int],
    token_ids: list[int],
    content: str,
    *,
    finish_reason: str = "stop",
    tool_calls: list[dict[str, Any]] | None = None,
    spans: list[dict[str, Any]] | None = None,
) -> FakeReply:
    """`chat_completion` as the engine sends it."""
    completion = chat_completion(
        prompt_ids, token_ids, content, finish_reason=finish_reason, tool_calls=tool_calls, spans=spans
    )
    return FakeReply(200, orjson.dumps(completion))


def chat_stream(
    prompt_ids: list[int],
    pieces: list[tuple[int, str]],
    *,
    done: bool = True,
    broken: bool = False,
    spans: list[dict[str, Any]] | None = None,
) -> FakeReply:
    """A streamed chat completion: one chunk per (token id, text), the last with the finish reason (and the
    plugin's `spans`, if given), then [DONE]."""
    events: list[dict[str, Any]] = [
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "model": "tiny",
            "prompt_token_ids": prompt_ids,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
    ]
    for i, (token, text) in enumerate(pieces):
        choice = {
            "index": 0,
            "delta": {"content": text},
            "logprobs": {"content": [{"token": text, "logprob": -0.25 * (i + 1)}]},
            "finish_reason": "stop" if i == len(pieces) - 1 else None,
            "token_ids": [token],
        }
        if spans is not None and i == len(pieces) - 1:
            choice["weight_versions"] = spans
        events.append({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [choice]})
    chunks = [b"data: " + orjson.dumps(event) + b"\n\n" for event in events]
    if done:
        chunks.append(b"data: [DONE]\n\n")
    return FakeReply(200, chunks=chunks, broken=broken)


def json_reply(payload: dict[str, Any]) -> FakeReply:
    return FakeReply(200, orjson.dumps(payload))


def error_reply(
    status: int, message: str, *, kind: str = "BadRequestError", param: str | None = None
) -> FakeReply:
    """vLLM's error body."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return FakeReply(status, orjson.dumps(body))
