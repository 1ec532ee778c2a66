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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from gateway.fleet.prefixes import PrefixIndex

log = logging.getLogger(__name__)

_decode = msgspec.msgpack.Decoder().decode


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


class KvEvents:
    """One subscription per server while it is in the fleet."""

    def __init__(self, index: PrefixIndex, entries: list[str]) -> None:
        self.index = index
        self.entries = entries
        self._context = zmq.asyncio.Context()
        self._followed: dict[str, asyncio.Task[None]] = {}
        self.batches = 0
        """Batches of events read, from every server."""

    def follow(self, url: str) -> None:
        endpoint = endpoint_for(url, self.entries)
        if endpoint is None or url in self._followed:
            return
        self._followed[url] = asyncio.create_task(self._read(url, endpoint), name=f"kv-events {url}")

    def leave(self, url: str) -> None:
        task = self._followed.pop(url, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._followed.values())
        self._followed.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._context.destroy(linger=0)

    async def _read(self, url: str, endpoint: str) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoint)
        log.info("reading the KV-cache events of %s from %s", url, endpoint)
        expected: int | None = None
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    continue
                sequence = int.from_bytes(frames[1], "big")
                if expected is not None and sequence != expected:
                    why = "restarted" if sequence < expected else f"{sequence - expected} batches lost"
                    log.warning("KV-cache events of %s: %s; its index starts afresh", url, why)
                    self.index.cleared(url)
                expected = sequence + 1
                self._apply(url, frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV-cache events of %s: reading stopped", url)
        finally:
            socket.close(linger=0)

    def _apply(self, url: str, payload: bytes) -> None:
        try:
            batch = _decode(payload)
            events: list[Any] = batch[1]
        except (msgspec.DecodeError, IndexError, TypeError):
            log.warning("KV-cache events of %s: a batch that is not vLLM's, skipped", url)
            return
        self.batches += 1
        for event in events:
            if not isinstance(event, dict):
                continue
            kind = event.get("type")
            if kind == "BlockStored":
                self._stored(url, event)
            elif kind == "BlockRemoved":
                self.index.removed(url, event.get("block_hashes") or [])
            elif kind == "AllBlocksCleared":
                self.index.cleared(url)

    def _stored(self, url: str, event: dict[str, Any]) -> None:
        hashes, ids, size = (
            event.get("block_hashes") or [],
            event.get("token_ids") or [],
            event.get("block_size"),
        )
        # Blocks of a LoRA adapter, or with keys beyond their ids (images, a cache salt), hold other keys and
        # values than the base model's for the same ids; blocks offloaded to another medium are not the
        # engine's cache; a stored run with blocks skipped cannot be aligned with its ids.
        if not isinstance(size, int) or size <= 0 or event.get("lora_id") is not None:
            return
        if any(event.get("extra_keys") or ()) or event.get("medium") not in (None, "GPU"):
            return
        if len(ids) != len(hashes) * size:
            return
        self.index.stored(url, size, event.get("parent_block_hash"), hashes, ids)
