"""What the gateway knows of each server's prefix cache: from the calls it sent, and from the server's
KV-cache events (their reading is tested here on a ZMQ publisher of our own, speaking vLLM's wire format,
and on real servers in tests/engine/test_fleet.py)."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Iterator, Sequence

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gateway.cli import build_parser, settings_from
from gateway.fleet import kv_events, prefixes
from gateway.fleet.collector import KvEventsCollector
from gateway.fleet.kv_events import KvEvents, endpoint_for
from gateway.fleet.prefixes import MAX_BLOCK_SIZE, PrefixIndex, adapter_key, keys
from gateway.metrics import samples
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


def test_a_history_an_adapter_computed_is_found_under_that_adapter_alone():
    index, agent, judge = PrefixIndex(), adapter_key("agent@1-c1dcfbda"), adapter_key("judge@1-489afc00")
    index.saw(A, ids(64), agent)
    index.stored(B, 16, None, [b"h0", b"h1"], ids(32).tolist(), judge)
    index.stored(B, 16, b"h1", [b"h2"], ids(16, start=32).tolist(), judge)

    assert (index.cached(ids(64), [A, B], agent), index.cached(ids(64), [A, B], judge)) == ({A: 64}, {B: 48})
    assert index.cached(ids(64), [A, B]) == {}  # the base model computed none of it
    assert adapter_key(None) == 0


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
async def test_an_adapters_stored_blocks_are_keyed_by_its_name_and_those_with_other_extra_keys_skipped(
    publisher: tuple[zmq.Socket[bytes], str],
):
    socket, endpoint = publisher
    index, name = PrefixIndex(), "agent@1-c1dcfbda"
    events = KvEvents(index, [f"{A}={endpoint}"])
    events.follow(A)
    adapters = stored([1, 2], None, 0) | {"lora_id": 1, "lora_name": name, "extra_keys": [[name], [name]]}
    salted = stored([3], None, 100) | {"extra_keys": [["salt"]]}
    unnamed = stored([4], None, 200) | {"lora_id": 2}
    try:
        await subscribed(socket, events)
        await send(socket, events, 1, batch(adapters, salted, unnamed))

        assert index.cached(ids(64), [A], adapter_key(name)) == {A: 32}
        assert index.cached(ids(64), [A]) == {}
        assert index.servers[A].size == 2
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


# -- what a publisher may send ------------------------------------------------------------------------------


def test_an_endpoint_zmq_cannot_connect_to_is_refused_when_settings_are_read(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GATEWAY_KV_EVENTS", "tcp://{host}:55 57")
    with pytest.raises(ValueError, match=r"'tcp://\{host\}:55 57': not a ZMQ endpoint"):
        Settings()
    monkeypatch.setenv("GATEWAY_KV_EVENTS", "tcp://[fd00::9]:5557,http://c:9000=tcp://vllm-c:5557")
    assert Settings().kv_events == ["tcp://[fd00::9]:5557", "http://c:9000=tcp://vllm-c:5557"]


def read_metrics(events: KvEvents) -> dict[tuple[str, tuple[str, ...]], float]:
    registry = CollectorRegistry()
    registry.register(KvEventsCollector(lambda: events))
    return {
        (name, tuple(labels.values())): value
        for name, (_, _, found) in samples(registry).items()
        for _, labels, value in found
    }


MALFORMED = [
    [1.0, 7, 0],  # events: an integer
    {"ts": 1.0, "events": []},  # a map, not vLLM's array
    [1.0, [{**stored([5], None, 0), "token_ids": ["1"] * 16}], 0],  # ids as strings
    [1.0, [{**stored([5], None, 0), "block_hashes": [[5]]}], 0],  # a list as a block's hash
    [1.0, [{"type": "BlockRemoved", "block_hashes": 5, "medium": "GPU"}], 0],
]


@pytest.mark.anyio
async def test_malformed_batches_and_events_are_skipped_and_counted_and_the_events_after_them_are_applied(
    publisher: tuple[zmq.Socket[bytes], str],
):
    socket, endpoint = publisher
    index = PrefixIndex()
    events = KvEvents(index, [f"{A}={endpoint}"])
    events.follow(A)
    try:
        await subscribed(socket, events)
        await send(socket, events, 1, batch(stored([1, 2], None, 0)))
        for sequence, payload in enumerate(MALFORMED, start=2):
            socket.send_multipart([b"", sequence.to_bytes(8, "big"), msgspec.msgpack.encode(payload)])
        await send(socket, events, 7, batch({"type": "Unknown"}, 3, stored([3], 2, 32)))  # one bad of three
        assert index.cached(ids(64), [A]) == {A: 48}
        await send(socket, events, 8, batch({"type": "AllBlocksCleared"}))
        assert index.cached(ids(64), [A]) == {}
        assert read_metrics(events) == {
            ("gateway_kv_events_skipped", (A, "batch")): 2,
            ("gateway_kv_events_skipped", (A, "event")): 4,
            ("gateway_kv_events_failures", (A,)): 0,
            ("gateway_kv_events_down", (A,)): 0,
        }
    finally:
        await events.close()


@pytest.mark.anyio
async def test_blocks_of_a_size_no_server_has_are_skipped_without_the_memory_they_would_take(
    publisher: tuple[zmq.Socket[bytes], str],
):
    socket, endpoint = publisher
    index = PrefixIndex()
    events = KvEvents(index, [f"{A}={endpoint}"])
    events.follow(A)
    try:
        await subscribed(socket, events)
        huge = [{**stored([], None, 0), "block_size": (1 << 23) + size} for size in range(3)]
        tracemalloc.start()
        try:
            await send(socket, events, 1, batch(*huge))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20
        assert events.readers[A].skipped == {"batch": 0, "event": 3}
    finally:
        await events.close()


def test_a_servers_events_keep_the_blocks_stored_last_up_to_the_bound(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(prefixes, "EVENT_BLOCKS", 8)  # a generation is four blocks
    index = PrefixIndex()
    index.stored(A, 16, None, [1, 2, 3], ids(48).tolist())
    index.stored(A, 16, 3, [4, 5], ids(32, start=48).tolist())  # five: the first generation, kept as older
    index.stored(A, 16, None, [11, 12], ids(32, start=1000).tolist())
    index.stored(A, 16, 5, [6], ids(16, start=80).tolist())  # chained from the older generation
    assert index.cached(ids(96), [A]) == {A: 96}
    index.removed(A, [2])  # from the older generation
    assert index.cached(ids(96), [A]) == {A: 16}
    index.stored(
        A, 16, None, [21, 22, 23], ids(48, start=2000).tolist()
    )  # fills the next: the first is dropped
    assert index.servers[A].size == 6
    assert index.cached(ids(16), [A]) == {}
    assert index.cached(ids(32, start=1000), [A]) == {A: 32}
    assert index.cached(ids(48, start=2000), [A]) == {A: 48}


@pytest.mark.anyio
async def test_a_large_batch_is_applied_in_slices_between_which_other_tasks_run(
    publisher: tuple[zmq.Socket[bytes], str],
):
    socket, endpoint = publisher
    index = PrefixIndex()
    events = KvEvents(index, [f"{A}={endpoint}"])
    events.follow(A)
    seen: set[int] = set()
    loop = asyncio.get_running_loop()

    def watch() -> None:
        """Run at each turn of the event loop: the index's size as other tasks see it."""
        nonlocal watching
        server = index.servers.get(A)
        seen.add(server.size if server is not None else 0)
        watching = loop.call_soon(watch)

    watching = loop.call_soon(watch)
    try:
        await subscribed(socket, events)
        await send(socket, events, 1, batch(*(stored([n], None, 16 * n) for n in range(1, 4_001))))
        assert index.servers[A].size == 4_000
        assert any(0 < size < 4_000 for size in seen)  # the loop ran while the batch was half applied
    finally:
        watching.cancel()
        await events.close()


# -- when reading fails -------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_endpoint_that_cannot_be_connected_to_is_logged_shown_and_retried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(kv_events, "RETRY_FIRST", 0.01)
    index = PrefixIndex()
    events = KvEvents(index, ["tcp://{host}:55 57"])  # past the settings' check
    events.follow(A)
    try:
        await until(lambda: events.readers[A].failures >= 3, "three attempts")
        reader = events.readers[A]
        assert (reader.state, reader.error) == ("down", "ZMQError: Invalid argument (addr='tcp://a:55 57')")
        assert read_metrics(events)["gateway_kv_events_down", (A,)] == 1
        assert "KV-cache events of http://a:8000 from tcp://a:55 57: reading failed" in caplog.text
    finally:
        await events.close()


class Failing(PrefixIndex):
    """An index whose first removal fails, as an error of the reader's own would."""

    failed = False

    def removed(self, url: str, hashes: Sequence[bytes | int]) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("an error of its own")
        super().removed(url, hashes)


@pytest.mark.anyio
async def test_while_a_servers_events_cannot_be_read_its_calls_feed_its_index_and_reading_resumes(
    publisher: tuple[zmq.Socket[bytes], str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(kv_events, "RETRY_FIRST", 0.01)
    socket, endpoint = publisher
    index = Failing()
    events = KvEvents(index, [f"{A}={endpoint}"])
    events.follow(A)
    try:
        await subscribed(socket, events)
        await send(socket, events, 1, batch(stored([1], None, 0)))
        socket.send_multipart(
            [b"", (2).to_bytes(8, "big"), batch({"type": "BlockRemoved", "block_hashes": [1]})]
        )
        await until(lambda: events.readers[A].failures == 1, "the failure")
        assert not index.servers[A].from_events and index.cached(ids(16), [A]) == {}
        index.saw(A, ids(32, start=500))
        assert index.cached(ids(32, start=500), [A]) == {A: 32}
        # Reading again: the next stored block makes the events the index's source once more.
        events.batches = 0
        await subscribed(socket, events)
        assert (events.readers[A].state, events.readers[A].error) == ("reading", None)
        await send(socket, events, 1, batch(stored([7], None, 300)))
        assert index.servers[A].from_events and index.cached(ids(16, start=300), [A]) == {A: 16}
        assert read_metrics(events)["gateway_kv_events_failures", (A,)] == 1
    finally:
        await events.close()


# -- anything at all ----------------------------------------------------------------------------------------

VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=70),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-9, 9), inner, max_size=4)
    ),
    max_leaves=12,
)
"""Any msgpack value."""
EVENTS = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]) | VALUES},
    optional={
        "block_hashes": st.lists(st.integers(0, 8) | st.binary(max_size=2), max_size=3) | VALUES,
        "parent_block_hash": st.none() | st.integers(0, 8) | VALUES,
        "token_ids": st.lists(st.integers(0, 3), min_size=2, max_size=6) | VALUES,
        "block_size": st.sampled_from([1, 2, MAX_BLOCK_SIZE + 1, 1 << 26]) | VALUES,
        "lora_id": st.none() | VALUES,
        "medium": st.sampled_from([None, "GPU", "CPU"]) | VALUES,
        "lora_name": st.none() | st.text(max_size=8) | VALUES,
        "extra_keys": st.none() | VALUES,
    },
)
"""Events of vLLM's kinds, each field well formed or anything."""
PAYLOADS = (
    st.tuples(VALUES, st.lists(EVENTS | VALUES, max_size=6), VALUES).map(msgspec.msgpack.encode)
    | VALUES.map(msgspec.msgpack.encode)
    | st.binary(max_size=40)
)
MESSAGES = st.lists(
    st.lists(st.binary(max_size=9), min_size=1, max_size=4) | PAYLOADS.map(lambda p: [b"", b"\0" * 8, p]),
    max_size=8,
)


@pytest.fixture
async def following(
    publisher: tuple[zmq.Socket[bytes], str],
) -> AsyncIterator[tuple[zmq.Socket[bytes], KvEvents]]:
    """A reader of the publisher, subscribed: the same for every example of a property."""
    socket, endpoint = publisher
    events = KvEvents(PrefixIndex(), [f"{A}={endpoint}"])
    events.follow(A)
    try:
        await subscribed(socket, events)
        yield socket, events
    finally:
        await events.close()


@pytest.mark.anyio
@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(messages=MESSAGES)
async def test_whatever_a_publisher_sends_the_reader_goes_on_and_its_index_stays_bounded_and_right(
    following: tuple[zmq.Socket[bytes], KvEvents], messages: list[list[bytes]]
):
    socket, events = following
    for message in messages:
        socket.send_multipart(message)
    # Read after them, a batch clearing the cache and storing two blocks: the index holds exactly those.
    await send(socket, events, 1 << 40, batch({"type": "AllBlocksCleared"}, stored([1, 2], None, 0)))
    assert events.index.cached(ids(40), [A]) == {A: 32}
    assert events.index.servers[A].size == 2
    assert (events.readers[A].state, events.readers[A].failures) == ("reading", 0)
