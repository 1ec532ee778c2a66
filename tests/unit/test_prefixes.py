"""What the gateway knows of each server's prefix cache: from the calls it sent, and from the server's
KV-cache events (their reading is tested here on a ZMQ publisher of our own, speaking vLLM's wire format,
and on real servers in tests/engine/test_fleet.py)."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq

from gateway.cli import build_parser, settings_from
from gateway.fleet import prefixes
from gateway.fleet.kv_events import KvEvents, endpoint_for
from gateway.fleet.prefixes import PrefixIndex, keys
from gateway.settings import Settings

from support import until

A, B = "http://a:8000", "http://b:8000"


def ids(count: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + count, dtype=np.int32)


def test_a_history_counts_the_leading_whole_blocks_a_server_computed():
    index = PrefixIndex()
    index.saw(A, ids(100))
    assert index.cached(ids(300), [A, B]) == {A: 96}  # six blocks of 16; B never saw it


def test_blocks_after_the_first_that_differs_do_not_count():
    index = PrefixIndex()
    index.saw(A, ids(200))
    changed = ids(200)
    changed[40] = 7
    assert index.cached(changed, [A]) == {A: 32}


def test_the_same_ids_later_in_a_history_are_another_block():
    index = PrefixIndex()
    index.saw(A, np.tile(ids(16), 2))
    assert index.cached(np.tile(ids(16), 4), [A]) == {A: 32}


def test_the_oldest_blocks_learned_from_calls_are_forgotten_past_the_capacity(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(prefixes, "CAPTURED_BLOCKS", 8)  # a generation is four blocks
    index = PrefixIndex()
    index.saw(A, ids(80, start=1000))  # five blocks: a full generation, kept as the older one
    index.saw(A, ids(32, start=2000))
    assert index.cached(ids(80, start=1000), [A]) == {A: 80}
    index.saw(A, ids(80, start=3000))  # fills the next generation: the first is dropped
    assert index.cached(ids(80, start=1000), [A]) == {}
    assert index.cached(ids(80, start=3000), [A]) == {A: 80}


def test_a_server_that_left_is_forgotten():
    index = PrefixIndex()
    index.saw(A, ids(64))
    index.forget(A)
    assert index.cached(ids(64), [A]) == {}


def test_stored_events_chain_blocks_from_their_parents_to_the_same_keys_as_calls():
    index = PrefixIndex()
    index.stored(A, 16, None, [b"h0", b"h1"], ids(32).tolist())
    index.stored(A, 16, b"h1", [b"h2"], ids(16, start=32).tolist())
    index.saw(B, ids(48))
    assert index.cached(ids(60), [A, B]) == {A: 48, B: 48}
    assert index.servers[A].from_events and not index.servers[B].from_events


def test_an_evicted_block_ends_the_cached_run_and_a_cleared_cache_holds_nothing():
    index = PrefixIndex()
    index.stored(A, 16, None, [b"h0", b"h1", b"h2"], ids(48).tolist())
    index.removed(A, [b"h1"])
    assert index.cached(ids(48), [A]) == {A: 16}
    index.cleared(A)
    assert index.cached(ids(48), [A]) == {}


def test_a_block_chained_from_one_never_announced_is_ignored():
    index = PrefixIndex()
    index.stored(A, 16, b"before-the-gateway", [b"h5"], ids(16, start=80).tolist())
    assert index.servers[A].size == 0


def test_once_a_server_publishes_events_the_calls_sent_to_it_no_longer_feed_its_index():
    index = PrefixIndex()
    index.saw(A, ids(64))
    index.stored(A, 128, None, [b"h0"], ids(128, start=500).tolist())
    index.saw(A, ids(256))
    assert index.cached(ids(64), [A]) == {}
    assert index.cached(ids(256, start=500), [A]) == {A: 128}


def test_keys_of_a_history_do_not_depend_on_where_it_is_cut():
    history = ids(1000, start=7)
    assert keys(history[:500], 16).tolist() == keys(history, 16).tolist()[:31]


# -- where a server's events come from ----------------------------------------------------------------------


def test_an_endpoint_for_every_server_takes_each_servers_host_and_a_servers_own_entry_wins():
    entries = ["tcp://{host}:5557", "http://c:9000=tcp://10.0.0.9:6000"]
    assert endpoint_for("http://vllm-0.vllm:8000", entries) == "tcp://vllm-0.vllm:5557"
    assert endpoint_for("http://c:9000", entries) == "tcp://10.0.0.9:6000"
    assert endpoint_for("http://c:9000", ["http://d:9000=tcp://d:1"]) is None


def test_kv_events_settings_split_like_backends_and_refuse_what_is_not_a_zmq_endpoint(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setenv("GATEWAY_KV_EVENTS", "tcp://{host}:5557, http://c:9000=ipc:///run/c.sock")
    assert Settings().kv_events == ["tcp://{host}:5557", "http://c:9000=ipc:///run/c.sock"]
    monkeypatch.setenv("GATEWAY_KV_EVENTS", "http://c:9000=c:5557")
    with pytest.raises(ValueError, match=r"'http://c:9000=c:5557': not a ZMQ endpoint \(tcp://HOST:PORT"):
        Settings()


# -- reading a publisher ------------------------------------------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def publisher() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield socket, f"tcp://127.0.0.1:{port}"
    socket.close(linger=0)
    context.term()


def batch(*events: dict[str, object]) -> bytes:
    """A batch as vLLM's ZMQ publisher encodes it: an array [ts, events, rank], each event a map tagged by
    its type."""
    return msgspec.msgpack.encode([1.0, list(events), 0])


def stored(hashes: list[int], parent: int | None, start: int) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": ids(16 * len(hashes), start=start).tolist(),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


async def subscribed(socket: zmq.Socket[bytes], events: KvEvents) -> None:
    """Batch 0 (a cleared cache) sent until read: a subscription takes a moment to start, and the publisher
    drops what it sends before. Every later batch is then read, in order."""

    def read() -> bool:
        if not events.batches:
            socket.send_multipart([b"", (0).to_bytes(8, "big"), batch({"type": "AllBlocksCleared"})])
        return events.batches > 0

    await until(read, "the subscription started")


async def send(socket: zmq.Socket[bytes], events: KvEvents, sequence: int, payload: bytes) -> None:
    """Publish one batch and wait until it is read."""
    read = events.batches
    socket.send_multipart([b"", sequence.to_bytes(8, "big"), payload])
    await until(lambda: events.batches > read, f"batch {sequence} read")


@pytest.mark.anyio
async def test_a_servers_published_events_build_its_index_and_a_gap_in_their_numbers_starts_it_afresh(
    publisher: tuple[zmq.Socket[bytes], str],
):
    socket, endpoint = publisher
    index = PrefixIndex()
    events = KvEvents(index, [f"{A}={endpoint}"])
    events.follow(A)
    try:
        await subscribed(socket, events)
        await send(socket, events, 1, batch(stored([1, 2], None, 0)))
        assert index.cached(ids(64), [A]) == {A: 32}
        # Batches 2-4 lost (the subscriber was slow): what they said is unknown, so the index starts afresh.
        await send(socket, events, 5, batch(stored([9], None, 100)))
        assert index.cached(ids(64), [A]) == {}
        assert index.cached(ids(16, start=100), [A]) == {A: 16}
        # Numbers starting over: the server restarted, its cache empty.
        await send(socket, events, 0, batch(stored([7], None, 300)))
        assert index.cached(ids(16, start=100), [A]) == {}
        await send(socket, events, 1, batch({"type": "AllBlocksCleared"}))
        assert index.cached(ids(16, start=300), [A]) == {}
    finally:
        await events.close()


@pytest.mark.anyio
async def test_a_payload_that_is_not_vllms_is_skipped_and_reading_goes_on(
    publisher: tuple[zmq.Socket[bytes], str],
):
    socket, endpoint = publisher
    server = "http://127.0.0.1:8000"
    index = PrefixIndex()
    events = KvEvents(index, [endpoint.replace("127.0.0.1", "{host}")])
    events.follow(server)
    try:
        await subscribed(socket, events)
        await send(socket, events, 1, batch(stored([3], None, 0)))
        socket.send_multipart([b"", (2).to_bytes(8, "big"), b"\xc1 not msgpack"])
        await send(socket, events, 3, batch(stored([4], 3, 16)))
        assert index.cached(ids(40), [server]) == {server: 32}
    finally:
        await events.close()


def test_the_kv_events_flag_is_given_once_per_entry():
    command = [
        "serve",
        "--kv-events",
        "tcp://{host}:5557",
        "--kv-events",
        "http://c:9000=tcp://10.0.0.9:6000",
    ]
    assert settings_from(build_parser().parse_args(command)).kv_events == [
        "tcp://{host}:5557",
        "http://c:9000=tcp://10.0.0.9:6000",
    ]
