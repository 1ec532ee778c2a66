"""A vLLM-shaped upstream that answers every chat completion with the same canned bytes.

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

import orjson

from testbed.process import ManagedProcess, start_until_ready

PROMPT_TOKENS = 3200
COMPLETION_TOKENS = 64


def canned_reply() -> bytes:
    completion = [(i * 37) % 2000 for i in range(COMPLETION_TOKENS)]
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x" * 200, "tool_calls": [], "reasoning": None},
                "logprobs": {
                    "content": [
                        {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}
                        for _ in completion
                    ]
                },
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": completion,
            }
        ],
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS},
        "prompt_logprobs": None,
        "prompt_token_ids": [(i * 13) % 2000 for i in range(PROMPT_TOKENS)],
    }
    return _answer(orjson.dumps(body))


def _answer(payload: bytes) -> bytes:
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    return head.encode() + payload


class Upstream(asyncio.Protocol):
    reply = canned_reply()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            reply = self.reply
            if head.startswith(b"post /detokenize"):
                text = "".join(f"<{t}>" for t in orjson.loads(body)["tokens"])
                reply = _answer(orjson.dumps({"prompt": text}))
            self.transport.write(reply)  # type: ignore[attr-defined]


def start(work: Path) -> tuple[ManagedProcess, int]:
    """This upstream as a child process on a free port (its log in `work`)."""
    return start_child(work, lambda port: [__file__, "--port", str(port)], "fake upstream")


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


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(main(parser.parse_args().port))
