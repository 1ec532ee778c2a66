"""A vLLM-shaped upstream that answers every chat completion with the same canned bytes; and what the other
benchmarks' upstreams build theirs from (HTTP framing, vLLM's whole and streamed reply shapes, a request
parser, serving and starting as a child process), so that every fake upstream answers as this one does.

For measuring the gateway's own overhead only: it costs next to nothing, so what a client sees through the
gateway minus what it sees directly is the gateway. The reply carries what vLLM sends with
`return_token_ids` and `logprobs`: ~3.2k prompt ids, 64 sampled ids and their logprobs. `/detokenize` of
one id answers `<id>` (what the viewer asks for).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from testbed.process import ManagedProcess, start_until_ready

PROMPT_TOKENS = 3200
COMPLETION_TOKENS = 64
PROMPT_IDS = [(i * 13) % 2000 for i in range(PROMPT_TOKENS)]
COMPLETION_IDS = [(i * 37) % 2000 for i in range(COMPLETION_TOKENS)]
LOGPROB = {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}
"""A sampled token's logprob as vLLM sends it (all alike: the gateway only relays and stores them)."""
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_CHUNK = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
_DONE = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"  # the last event and the chunked body's end, in one write


def http_reply(payload: bytes) -> bytes:
    """A JSON answer with its length (not chunked, so the gateway keeps the connection for its next call)."""
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(payload),
        payload,
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A reply's usage as vLLM reports it (total_tokens too: the gateway's OpenAI models require it)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_reply(message: dict[str, Any], finish: str, prompt_ids: Any, tokens: dict[str, int]) -> bytes:
    """A whole chat completion of `message` (sampled as COMPLETION_IDS) as vLLM answers it with
    `return_token_ids` and `logprobs`, its top-level fields in vLLM's order; `prompt_ids` a list or a numpy
    array, `tokens` its usage."""
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": {"content": [LOGPROB] * COMPLETION_TOKENS},
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": COMPLETION_IDS,
            }
        ],
        "usage": tokens,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids,
    }
    return http_reply(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY))


def canned_reply() -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": "x" * 200, "tool_calls": [], "reasoning": None}
    # No total_tokens: the bytes every overhead figure so far was measured with.
    tokens = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS}
    return chat_reply(message, "stop", PROMPT_IDS, tokens)


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event as one HTTP chunk (a numpy array, a prompt's ids, as a JSON list)."""
    event = b"data: " + orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def token_event(delta: dict[str, Any], ids: list[int], finish: str | None = None) -> bytes:
    """The event of sampled tokens `ids` (with their logprobs; none: the finish) that bring `delta`."""
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": {"content": [LOGPROB] * len(ids)} if ids else None,
        "finish_reason": finish,
        "token_ids": ids,
    }
    return sse({**_CHUNK, "choices": [choice]})


def stream_events(
    prompt_ids: Any, deltas: list[tuple[dict[str, Any], list[int]]], finish: str
) -> list[bytes]:
    """A streamed reply after its head (STREAM_HEAD), one HTTP chunk an event, as vLLM writes it with
    `return_token_ids` and `logprobs`: the role and the prompt's ids, an event per `(delta, sampled ids)`, the
    finish, the usage and `[DONE]`."""
    role = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    completion = sum(len(ids) for _, ids in deltas)
    return [
        sse({**_CHUNK, "choices": [role], "prompt_token_ids": prompt_ids}),
        *(token_event(delta, ids) for delta, ids in deltas),
        token_event({}, [], finish),
        sse({**_CHUNK, "choices": [], "usage": usage(len(prompt_ids), completion)}),
        _DONE,
    ]


class Requests(asyncio.Protocol):
    """A server connection that takes each HTTP/1.1 request (with a content-length body) off the stream and
    hands it to `answer`: no web framework, so that an upstream costs next to nothing beside the gateway."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buffer = bytearray()  # appended to and cut in place: a 1 MB request arrives in many reads

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = bytes(self.buffer[:end]).lower()
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.startswith(b"content-length:")
                ),
                0,
            )
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            self.answer(head, body)

    def answer(self, head: bytes, body: bytes) -> None:
        """Answer the request of `head` (lower-cased: request line and headers) and `body`."""
        raise NotImplementedError


class Upstream(Requests):
    reply = canned_reply()

    def answer(self, head: bytes, body: bytes) -> None:
        reply = self.reply
        if head.startswith(b"post /detokenize"):
            text = "".join(f"<{t}>" for t in orjson.loads(body)["tokens"])
            reply = http_reply(orjson.dumps({"prompt": text}))
        self.transport.write(reply)


async def serve(protocol: Callable[[], asyncio.Protocol], port: int) -> None:
    """An upstream's child process: `protocol` on 127.0.0.1:`port` until it is stopped."""
    server = await asyncio.get_running_loop().create_server(protocol, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def start(
    work: Path, *arguments: str, script: str = __file__, name: str = "fake upstream"
) -> tuple[ManagedProcess, int]:
    """A benchmark's upstream script (this one by default), run with `--serve PORT *arguments`, as a child
    process on a free port (its log in `work`)."""
    return start_child(work, lambda port: [script, "--serve", str(port), *arguments], name)


def start_child(work: Path, arguments: Callable[[int], list[str]], name: str) -> tuple[ManagedProcess, int]:
    """A benchmark's upstream script, run with `arguments(port)`, as a child process on a free port (its log
    in `work`), once it answers."""
    return start_until_ready(
        lambda port: ManagedProcess(
            [sys.executable, *arguments(port)], log_path=work / "upstream.log", name=name
        ),
        "/",
        host="127.0.0.1",
        port=None,
        timeout=30,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", type=int, required=True, metavar="PORT")
    asyncio.run(serve(Upstream, parser.parse_args().serve))
