"""What each server's prefix cache holds, as far as the gateway can know, so that a rollout that must move
goes to the server holding most of its history (`gateway.fleet.routing`).

A server caches a prompt in blocks of `block_size` ids, each only after the blocks before it, so the cached
part of a history is the run of its leading blocks the server holds. The index keys each block by its ids and
its position, chained to the blocks before it (`keys`), the way vLLM chains its own block hashes: looking a
history up is walking its keys until the first one a server lacks. The keys are computed for a whole history
at once with numpy (0.1 ms for 30,000 ids), since every answered call adds its ids. A LoRA adapter's blocks
hold other keys and values than the base model's for the same ids: vLLM keys them with the adapter's name,
and so does the index (`adapter_key`), so that a history is found where its own adapter computed it.

Two sources, per server. Where the server publishes its KV-cache events (vLLM's `--kv-events-config`, read
by `gateway.fleet.kv_events`), they are its index: blocks stored, blocks evicted, the cache cleared; it keeps
the blocks stored last, `EVENT_BLOCKS` or so. Elsewhere, or while its events cannot be read, the index holds
the ids of the calls this process sent there (prompt and reply), which never say what the server evicted: it
keeps the blocks seen in the last `CAPTURED_BLOCKS` or so, and is a guess. Either way a server's index stays
about 100 MB at most.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

CAPTURED_BLOCK = 16
"""Block size of the index of a server without events (vLLM's default on a GPU): its own is unknown here, and
the index only ranks servers by the tokens of a history each holds."""
CAPTURED_BLOCKS = 1 << 20
"""Blocks remembered per server from its calls (16M tokens at 16 a block, about a large GPU's cache): the
blocks seen since the last `CAPTURED_BLOCKS // 2` new ones, at least."""
EVENT_BLOCKS = 1 << 19
"""Blocks remembered per server from its events (8M tokens at 16 a block; about 100 MB, as the calls' index at
`CAPTURED_BLOCKS`): the blocks stored since the last `EVENT_BLOCKS // 2` new ones, at least."""
POSITIONS = 1 << 16
"""Blocks of a history the index looks at (a million ids at 16 a block)."""
MAX_BLOCK_SIZE = 4096
"""The largest block the index takes (vLLM's attention blocks hold 1 to 256 ids, a hybrid model's some
hundreds): each block size has an array of weights that large."""

_random = np.random.default_rng(0x9E3779B97F4A7C15)
_AT = _random.integers(1, 1 << 63, size=POSITIONS, dtype=np.uint64) | np.uint64(1)
"""A multiplier per block position: a block's key depends on where it is."""
_MIX = np.uint64(0xBF58476D1CE4E5B9)


@lru_cache(maxsize=8)
def _ids_weights(block_size: int) -> np.ndarray:
    """A multiplier per id's place in a block, kept for the few block sizes the fleet's servers have."""
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block size {block_size}: not 1 to {MAX_BLOCK_SIZE}")
    weights: np.ndarray = np.random.default_rng(block_size).integers(
        1, 1 << 63, size=block_size, dtype=np.uint64
    )
    weights |= np.uint64(1)
    weights.flags.writeable = False
    return weights


def _blocks(ids: np.ndarray, block_size: int, first: int) -> np.ndarray:
    """Each whole block's own hash, times its position's multiplier (blocks numbered from `first`)."""
    count = min(len(ids) // block_size, POSITIONS - first)
    blocks = np.asarray(ids[: count * block_size]).astype(np.uint64).reshape(count, block_size)
    with np.errstate(over="ignore"):
        mixed = blocks @ _ids_weights(block_size)
        mixed ^= mixed >> np.uint64(31)
        mixed *= _MIX
        mixed ^= mixed >> np.uint64(29)
        weighted: np.ndarray = mixed * _AT[first : first + count]
        return weighted


def adapter_key(adapter: str | None) -> int:
    """What the keys of an adapter's blocks start from (its name's hash); 0 for a model's own weights."""
    if adapter is None:
        return 0
    return int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8).digest(), "little")


def keys(ids: np.ndarray, block_size: int, adapter: int = 0) -> np.ndarray:
    """The key of each whole block of `ids` with all before it, computed by the weights `adapter` keys."""
    return np.cumsum(_blocks(ids, block_size, 0), dtype=np.uint64) + np.uint64(adapter)


def chained(parent: int, position: int, ids: np.ndarray, block_size: int) -> np.ndarray:
    """The keys of the whole blocks of `ids`, the first at `position`, after the block keyed `parent`."""
    return np.cumsum(_blocks(ids, block_size, position), dtype=np.uint64) + np.uint64(parent)


@dataclass
class ServerBlocks:
    """One server's cached blocks."""

    block_size: int = CAPTURED_BLOCK
    from_events: bool = False
    """Whether its KV-cache events feed it (then the calls it served do not)."""
    held: set[int] = field(default_factory=set)
    older: set[int] = field(default_factory=set)
    """Blocks learned before `held` filled."""
    engine: dict[bytes | int, int] = field(default_factory=dict)
    """The server's own hash of each block its events named -> the block's key and position here, as one
    integer (`key << 16 | position`: a tuple of two would double the index's size), for the blocks in
    `held`."""
    older_engine: dict[bytes | int, int] = field(default_factory=dict)
    """The same for the blocks in `older`."""

    def cached(self, ids: np.ndarray, adapter: int = 0) -> int:
        """How many leading ids of `ids` it holds, as the weights `adapter` keys computed them."""
        blocks = 0
        for key in keys(ids, self.block_size, adapter).tolist():
            if key not in self.held and key not in self.older:
                break
            blocks += 1
        return blocks * self.block_size

    @property
    def size(self) -> int:
        """Blocks held (those learned from calls twice over, before and after `held` last filled, counted
        once)."""
        return len(self.held | self.older) if self.older else len(self.held)

    def clear(self) -> None:
        self.held, self.older = set(), set()
        self.engine, self.older_engine = {}, {}

    def place(self, engine_hash: bytes | int) -> tuple[int, int] | None:
        """The key and position here of the block the server hashes `engine_hash`, if known."""
        known = self.engine.get(engine_hash)
        if known is None:
            known = self.older_engine.get(engine_hash)
        return None if known is None else (known >> 16, known & 0xFFFF)


class PrefixIndex:
    def __init__(self) -> None:
        self.servers: dict[str, ServerBlocks] = {}

    def server_blocks(self, url: str) -> ServerBlocks:
        """The server's index, an empty one the first time the server is heard of."""
        return self.servers.setdefault(url, ServerBlocks())

    def cached(self, ids: np.ndarray, urls: Sequence[str], adapter: int = 0) -> dict[str, int]:
        """The ids of the history `ids` each of `urls` holds, computed by the weights `adapter` keys, for
        those holding any; a server the index does not know counts as holding none."""
        found = {}
        for url in urls:
            server = self.servers.get(url)
            count = server.cached(ids, adapter) if server is not None else 0
            if count:
                found[url] = count
        return found

    def forget(self, url: str) -> None:
        """The server left the fleet."""
        self.servers.pop(url, None)

    # -- from the calls this process sent ------------------------------------------------------------------

    def saw(self, url: str, ids: np.ndarray, adapter: int = 0) -> None:
        """A call's prompt and reply ids, as the server `url` computed them with the weights `adapter`
        keys."""
        server = self.server_blocks(url)
        if server.from_events:
            return
        server.held.update(keys(ids, server.block_size, adapter).tolist())
        if len(server.held) > CAPTURED_BLOCKS // 2:
            server.older, server.held = server.held, set()

    # -- from the server's KV-cache events -------------------------------------------------------------------

    def follow(self, url: str, block_size: int) -> ServerBlocks:
        """The server's events feed its index from now on, at its own block size: what its calls told is
        dropped (the events replayed from the start of its buffer say what it holds)."""
        server = self.server_blocks(url)
        if not server.from_events or server.block_size != block_size:
            server.clear()
            server.from_events, server.block_size = True, block_size
        return server

    def unfollow(self, url: str) -> None:
        """The server's events can no longer be read: its calls feed its index again, from nothing (what the
        events told goes stale from now on)."""
        server = self.servers.get(url)
        if server is not None and server.from_events:
            server.clear()
            server.from_events, server.block_size = False, CAPTURED_BLOCK

    def stored(
        self,
        url: str,
        block_size: int,
        parent: bytes | int | None,
        hashes: Sequence[bytes | int],
        ids: Sequence[int],
        adapter: int = 0,
    ) -> None:
        """BlockStored: the server's blocks `hashes` hold `ids`, block after block, chained from `parent`,
        computed by the weights `adapter` keys."""
        server = self.follow(url, block_size)
        if parent is None:
            key, position = adapter, 0
        else:
            known = server.place(parent)
            if known is None:  # chained from a block stored before the events this process saw
                return
            key, position = known[0], known[1] + 1
        found = chained(key, position, np.asarray(ids), block_size).tolist()
        for offset, (engine_hash, block_key) in enumerate(zip(hashes, found, strict=False)):
            server.engine[engine_hash] = block_key << 16 | (position + offset)
            server.held.add(block_key)
        if len(server.engine) > EVENT_BLOCKS // 2:
            server.older_engine, server.engine = server.engine, {}
            server.older, server.held = server.held, set()

    def removed(self, url: str, hashes: Sequence[bytes | int]) -> None:
        """BlockRemoved: the server evicted these blocks."""
        server = self.servers.get(url)
        if server is None:
            return
        for engine_hash in hashes:
            for engine, blocks in ((server.engine, server.held), (server.older_engine, server.older)):
                known = engine.pop(engine_hash, None)
                if known is not None:
                    blocks.discard(known >> 16)

    def cleared(self, url: str) -> None:
        """AllBlocksCleared: the server reset its prefix cache."""
        server = self.servers.get(url)
        if server is not None:
            server.clear()
