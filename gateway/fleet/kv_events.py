"""`--kv-events`: each server's KV-cache events (vLLM's `--kv-events-config`, published over ZMQ), read into
the prefix index (`gateway.fleet.prefixes`), so that it knows exactly which blocks a server holds, evictions
included.

vLLM publishes on a PUB socket each batch of events its engine produced in a step, numbered: `(topic,
sequence, payload)`, the payload a msgpack array `[ts, events, data_parallel_rank]` whose events are maps
tagged by `type` (BlockStored, BlockRemoved, AllBlocksCleared). A subscriber sees only what is published
after it connects, and a publisher drops what a slow subscriber cannot take: a gap in the numbering means
blocks may be held that the index will never hear of, or gone while it still counts them, so the index of that
server starts afresh; a numbering that goes back means the server restarted, with an empty cache. What the
server cached before the gateway subscribed is unknown until it is computed again (a prompt reused is
announced again).

What the reader takes is bounded, since a publisher may send anything: a message of `MAX_MESSAGE` bytes (ZMQ
drops a larger one, and the numbering shows the gap), `BATCH_EVENTS` events a batch, blocks of up to
`MAX_BLOCK_SIZE` ids, and the index keeps `EVENT_BLOCKS` blocks a server (`gateway.fleet.prefixes`). A batch
that is not vLLM's, and an event that is not well formed, is skipped and counted; a large batch is applied in
slices, the event loop running calls between them. Should reading fail all the same (an endpoint that cannot
be connected to, an error of its own), the server's index is fed from its calls again while reading is
retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
import zmq
import zmq.asyncio

from gateway.fleet.prefixes import EVENT_BLOCKS, MAX_BLOCK_SIZE, POSITIONS, PrefixIndex, adapter_key

log = logging.getLogger(__name__)

MAX_MESSAGE = 16 << 20
"""Bytes of the largest message read (a step that computes a million ids publishes about 7 MB)."""
BATCH_EVENTS = 1 << 18
"""Events of the largest batch read."""
SLICE = 0.005
"""Seconds a batch is applied for before the event loop runs what else is ready."""
RETRY_FIRST, RETRY_LAST = 1.0, 60.0
"""Seconds before reading a server's events again after a failure, doubling from the first to the last."""

_Hash = int | Annotated[bytes, msgspec.Meta(max_length=64)]
"""A server's hash of a block: an integer, or a digest."""
_Id = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class _Batch(msgspec.Struct, array_like=True):
    ts: msgspec.Raw
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=BATCH_EVENTS)]
    """Each event decoded alone: one that is not well formed is skipped, not the batch."""


class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=POSITIONS)]
    parent_block_hash: _Hash | None
    token_ids: Annotated[list[_Id], msgspec.Meta(max_length=POSITIONS * 16)]
    block_size: Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCK_SIZE)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=EVENT_BLOCKS)]


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Kind(msgspec.Struct):
    type: str


_batch = msgspec.msgpack.Decoder(_Batch).decode
_event = msgspec.msgpack.Decoder(_Stored | _Removed | _Cleared).decode
_kind = msgspec.msgpack.Decoder(_Kind).decode
_KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def endpoint_for(url: str, entries: Iterable[str]) -> str | None:
    """The events endpoint `--kv-events` names for the server `url`: its own entry (`URL=ENDPOINT`), else the
    entry for every server (`ENDPOINT`, with `{host}` the server's host)."""
    every = None
    for entry in entries:
        named, _, endpoint = entry.rpartition("=")
        if named and named.rstrip("/") == url:
            return endpoint
        if not named:
            every = endpoint
    if every is None:
        return None
    host = url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    return every.replace("{host}", host)


@dataclass
class Reader:
    """One server's subscription, as `/admin/state` and the metrics show it."""

    endpoint: str
    state: Literal["reading", "down"] = "reading"
    """down: reading failed, and is retried; the server's index is fed from its calls meanwhile."""
    error: str | None = None
    """Why reading last failed, while down."""
    failures: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {"batch": 0, "event": 0})
    """Batches that were not vLLM's, and events that were not well formed, skipped."""


class KvEvents:
    """One subscription per server while it is in the fleet."""

    def __init__(self, index: PrefixIndex, entries: list[str]) -> None:
        self.index = index
        self.entries = entries
        self._context = zmq.asyncio.Context()
        self._followed: dict[str, asyncio.Task[None]] = {}
        self.readers: dict[str, Reader] = {}
        self.batches = 0
        """Batches of events read, from every server."""

    def follow(self, url: str) -> None:
        endpoint = endpoint_for(url, self.entries)
        if endpoint is None or url in self._followed:
            return
        reader = self.readers[url] = Reader(endpoint)
        self._followed[url] = asyncio.create_task(self._read(url, reader), name=f"kv-events {url}")

    def leave(self, url: str) -> None:
        self.readers.pop(url, None)
        task = self._followed.pop(url, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._followed.values())
        self._followed.clear()
        self.readers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._context.destroy(linger=0)

    async def _read(self, url: str, reader: Reader) -> None:
        """Read until cancelled: a failure is logged, the server's index falls back to its calls, and reading
        starts again after a pause that doubles while it keeps failing."""
        delay = RETRY_FIRST
        while True:
            try:
                async for _ in self._batches(url, reader):
                    delay = RETRY_FIRST
            except asyncio.CancelledError:
                raise
            except Exception as error:
                reader.state, reader.error = "down", f"{type(error).__name__}: {error}"
                reader.failures += 1
                self.index.unfollow(url)
                log.warning(
                    "KV-cache events of %s from %s: reading failed (%s); its index is fed from its calls "
                    "until reading resumes, in %g s",
                    url,
                    reader.endpoint,
                    reader.error,
                    delay,
                    exc_info=not isinstance(error, zmq.ZMQError),
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_LAST)

    async def _batches(self, url: str, reader: Reader) -> AsyncIterator[None]:
        """Subscribe and apply each batch published, yielding after each."""
        socket = self._context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(reader.endpoint)
            if reader.state == "down":
                log.info("KV-cache events of %s: reading again from %s", url, reader.endpoint)
            else:
                log.info("reading the KV-cache events of %s from %s", url, reader.endpoint)
            reader.state, reader.error = "reading", None
            expected: int | None = None
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    reader.skipped["batch"] += 1
                    continue
                sequence = int.from_bytes(frames[1], "big")
                if expected is not None and sequence != expected:
                    why = "restarted" if sequence < expected else f"{sequence - expected} batches lost"
                    log.warning("KV-cache events of %s: %s; its index starts afresh", url, why)
                    self.index.cleared(url)
                expected = sequence + 1
                await self._apply(url, reader, frames[2])
                yield
        finally:
            socket.close(linger=0)

    async def _apply(self, url: str, reader: Reader, payload: bytes) -> None:
        try:
            events = _batch(payload).events
        except msgspec.DecodeError as error:
            reader.skipped["batch"] += 1
            log.warning("KV-cache events of %s: a batch that is not vLLM's, skipped (%s)", url, error)
            return
        skipped, started = 0, time.perf_counter()
        for raw in events:
            if not self._event(url, raw):
                skipped += 1
            if time.perf_counter() - started > SLICE:
                await asyncio.sleep(0)
                started = time.perf_counter()
        self.batches += 1
        if skipped:
            reader.skipped["event"] += skipped
            log.warning("KV-cache events of %s: %d events not well formed, skipped", url, skipped)

    def _event(self, url: str, raw: msgspec.Raw) -> bool:
        """Apply one event; False if it is not well formed (an event of a kind not read here is)."""
        try:
            event = _event(raw)
        except msgspec.DecodeError:
            try:
                return _kind(raw).type not in _KINDS
            except msgspec.DecodeError:
                return False
        if isinstance(event, _Stored):
            self._stored(url, event)
        elif isinstance(event, _Removed):
            self.index.removed(url, event.block_hashes)
        else:
            self.index.cleared(url)
        return True

    def _stored(self, url: str, event: _Stored) -> None:
        # A LoRA adapter's blocks are keyed by its name (the index does it alike); blocks with other keys
        # beyond their ids (images, a cache salt) hold other keys and values than their ids alone say, an
        # adapter's known only by its id too; blocks offloaded to another medium are not the engine's cache; a
        # stored run with blocks skipped cannot be aligned with its ids.
        if (event.lora_name is None and event.lora_id is not None) or event.medium not in (None, "GPU"):
            return
        own = [event.lora_name] if event.lora_name is not None else []
        if any(keys and keys != own for keys in event.extra_keys or ()):
            return
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            return
        adapter = adapter_key(event.lora_name)
        hashes, ids = event.block_hashes, event.token_ids
        self.index.stored(url, event.block_size, event.parent_block_hash, hashes, ids, adapter)
