"""Where rollouts go: the least-loaded healthy server that serves the model, and what vLLM's metrics say of
its prefix cache."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from gateway.fleet.discovery import BackendFile
from gateway.fleet.fleet import Fleet
from gateway.fleet.health import max_loras, prefix_hit_rate
from gateway.fleet.routing import Reason, choose, group_bound, place, share_bound
from gateway.fleet.servers import Server
from gateway.store.pins import MOVES, Loads, Pin
from gateway.store.records import NewRollout, TurnRecord
from gateway.store.store import Store

from support.fleets import fleet_of


def servers(*loads: tuple[int, int]) -> list[Server]:
    return [Server(f"http://s{i}", in_flight=f, pinned=p) for i, (f, p) in enumerate(loads)]


def test_a_new_rollout_goes_to_the_server_with_fewest_calls_in_flight_then_fewest_rollouts():
    assert choose(servers((3, 2), (1, 3), (2, 2)), "r", None).url == "http://s1"
    assert choose(servers((1, 4), (1, 2), (1, 3)), "r", None).url == "http://s1"


def test_a_server_holding_its_share_of_rollouts_takes_no_new_one_even_when_idle():
    # 10 rollouts pinned + 1 new over 3 servers: the bound is ceil(1.25 * 11 / 3) = 5.
    fleet = servers((0, 5), (4, 3), (6, 2))
    assert choose(fleet, "r", None).url == "http://s1"
    assert share_bound(11, 3) == 5


def test_servers_all_at_their_share_still_take_rollouts_by_load():
    assert choose(servers((2, 5), (1, 5)), "r", None).url == "http://s1"


def test_placing_rollouts_one_by_one_keeps_every_server_within_its_share():
    fleet = servers((0, 0), (0, 0), (0, 0))
    fleet[0].in_flight = -100  # a server that always looks idle would take them all without the bound
    for n in range(1, 61):
        choose(fleet, f"r{n}", None).pinned += 1
        assert max(s.pinned for s in fleet) <= share_bound(n, 3)
    assert [s.pinned for s in fleet] == [25, 18, 17]


def test_unhealthy_and_draining_servers_take_no_new_rollout():
    fleet = servers((5, 5), (0, 0), (0, 0))
    fleet[1].healthy = False
    fleet[2].draining = True
    assert choose(fleet, "r", None).url == "http://s0"
    fleet[0].healthy = False
    assert choose(fleet, "r", None) is None


def test_a_model_goes_only_to_servers_that_list_it_and_any_server_before_its_models_are_known():
    fleet = servers((0, 0), (9, 9), (0, 1))
    fleet[0].models = frozenset({"policy"})
    fleet[1].models = frozenset({"judge", "policy"})
    fleet[2].models = frozenset({"policy"})
    assert choose(fleet, "r", "judge").url == "http://s1"
    assert choose(fleet, "r", "policy").url == "http://s0"
    fleet[2].models = frozenset()  # not known yet: the server's own answer will tell
    assert choose(fleet, "r", "judge").url == "http://s2"


def test_equal_loads_spread_rollouts_by_their_id_the_same_way_every_time():
    fleet = servers((0, 0), (0, 0), (0, 0), (0, 0))
    chosen = {rollout: choose(fleet, rollout, None).url for rollout in (f"r{i}" for i in range(64))}
    assert chosen == {rollout: choose(fleet, rollout, None).url for rollout in chosen}
    assert len(set(chosen.values())) == 4


def test_the_prefix_cache_hit_rate_is_hits_over_queries_summed_over_engines():
    metrics = [
        "# HELP vllm:prefix_cache_queries Prefix cache queries, in tokens.",
        'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 300.0',
        'vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 100.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 250.0',
        'vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 50.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9',
    ]
    assert prefix_hit_rate(metrics) == 0.75
    assert prefix_hit_rate(["vllm:prefix_cache_queries_total 0.0"]) is None


def test_a_backend_file_is_read_again_only_when_it_changes(tmp_path: Path):
    path = tmp_path / "backends"
    path.write_text("http://a:8000  # policy\n\n# spare\nhttp://b:8000\n")
    listed = BackendFile(str(path))

    assert listed.changed() == ["http://a:8000", "http://b:8000"]
    assert listed.changed() is None
    path.write_text("http://b:8000\n")
    os.utime(path, (1, 1))
    assert listed.changed() == ["http://b:8000"]
    path.write_text("# nothing\n")
    os.utime(path, (2, 2))
    assert listed.changed() is None  # an empty list would leave no server: the fleet stays


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def placing(store: Store) -> AsyncIterator[tuple[Fleet, Store]]:
    """A fleet of three servers (never called: placement alone) pinning through a real store."""
    fleet = fleet_of(["http://s0", "http://s1", "http://s2"], pins=store)
    try:
        yield fleet, store
    finally:
        await fleet.close()


@pytest.mark.anyio
async def test_rollouts_placed_at_the_same_moment_spread_evenly(placing):
    fleet, store = placing
    placed = await asyncio.gather(*(fleet.route(f"group-{i}", None) for i in range(12)))

    assert Counter(server.url for server, _ in placed) == {"http://s0": 4, "http://s1": 4, "http://s2": 4}
    assert [server.pinned for server in fleet.servers.values()] == [4, 4, 4]
    stored = await asyncio.gather(
        *(store.pin(f"group-{i}", lambda _: "http://s0", fleet.urls) for i in range(12))
    )
    assert [pin.url for pin in stored] == [server.url for server, _ in placed]  # the store agrees


@pytest.mark.anyio
async def test_a_rollout_another_process_placed_stays_there_and_counts_for_the_next_placements(placing):
    fleet, store = placing
    for i in range(3):  # another process placed three rollouts on s2
        await store.pin(f"elsewhere-{i}", lambda _: "http://s2", fleet.urls)

    (server, moved), *others = await asyncio.gather(
        fleet.route("elsewhere-0", None), *(fleet.route(f"r{i}", None) for i in range(3))
    )

    assert (server.url, moved) == ("http://s2", None)
    # By the store's counts s2 holds its share: the three new rollouts go to the other two servers.
    assert Counter(s.url for s, _ in others) in (
        {"http://s0": 2, "http://s1": 1},
        {"http://s0": 1, "http://s1": 2},
    )
    # This process counts the ones it placed (its heartbeat takes the store's count on PostgreSQL).
    assert sum(s.pinned for s in fleet.servers.values()) == 3


@pytest.mark.anyio
async def test_two_calls_of_one_rollout_placing_it_at_once_count_it_once(placing):
    fleet, _ = placing
    (first, _), (second, _) = await asyncio.gather(fleet.route("twice", None), fleet.route("twice", None))

    assert first.url == second.url
    assert sum(s.pinned for s in fleet.servers.values()) == 1
    fleet.forget("twice")
    assert sum(s.pinned for s in fleet.servers.values()) == 0


# Groups: the members of a GRPO group share their first prompt, so they go where their group is.


def loaded(*loads: int) -> list[Server]:
    return [Server(f"http://s{i}", pinned=load) for i, load in enumerate(loads)]


def test_a_member_joins_the_server_holding_most_of_its_group():
    # s1 holds 2 of the group's members, s2 one; s0 is idle.
    fleet = loaded(0, 6, 5)
    assert place(fleet, "g", None, {"http://s1": 2, "http://s2": 1}) == (fleet[1], Reason.GROUP)


def test_a_member_goes_to_the_next_server_of_its_group_when_the_first_holds_its_share_of_other_groups():
    # 28 rollouts + 1 over 3 servers: the bound is ceil(1.25 * 29 / 3) = 13. s1 holds 13 rollouts of other
    # groups besides the group's 2; s2 holds 12 besides its 1.
    fleet = loaded(0, 15, 13)
    assert place(fleet, "g", None, {"http://s1": 2, "http://s2": 1}) == (fleet[2], Reason.GROUP)


def test_a_group_splits_onto_the_least_loaded_server_only_when_all_its_servers_hold_their_share():
    # 40 + 1 over 3 servers: the bound is 18; s1 and s2 hold 18 and 19 of other groups' rollouts.
    fleet = loaded(0, 20, 20)
    assert place(fleet, "g", None, {"http://s1": 2, "http://s2": 1}) == (fleet[0], Reason.SPLIT)


def test_one_large_group_alone_on_an_idle_fleet_fills_a_server_to_twice_the_mean_load_then_the_next():
    # A server takes a member of a group it holds while it holds no more than max(8, ceil(2 x mean)) with
    # it, the new member counted: 12 over 3 servers, the bound is 8 from the first member to the last.
    assert [group_bound(n, 3) for n in (1, 9, 12)] == [8, 8, 8]
    fleet, group, reasons = loaded(0, 0, 0), Counter[str](), []
    for n in range(1, 13):
        server, reason = place(fleet, "g", None, group) or (None, None)
        assert server is not None and server.pinned + 1 <= group_bound(n, 3)
        server.pinned += 1
        group[server.url] += 1
        reasons.append(reason)

    assert sorted(s.pinned for s in fleet) == [0, 4, 8]
    assert reasons == [Reason.LOAD] + [Reason.GROUP] * 7 + [Reason.OVERFLOW] * 4


def test_a_declared_groups_seats_on_its_home_do_not_count_against_its_own_bound():
    # A group of 16 declared on 4 idle servers: its home s0 counts all 16, its members and the seats of those
    # still to come; the bound is max(8, ceil(2 x 16 / 4)) = 8 rollouts with the new member.
    fleet = loaded(16, 0, 0, 0)
    seven_placed = place(fleet, "g", None, {"http://s0": 16}, adds=0, seats={"http://s0": 9})
    eight_placed = place(fleet, "g", None, {"http://s0": 16}, adds=0, seats={"http://s0": 8})

    assert seven_placed == (fleet[0], Reason.GROUP)
    assert eight_placed is not None and eight_placed[0] in fleet[1:] and eight_placed[1] == Reason.OVERFLOW


def test_a_first_member_goes_to_the_least_loaded_server():
    fleet = loaded(4, 0)
    assert place(fleet, "g", None, {}) == (fleet[1], Reason.LOAD)


def test_declared_groups_placed_one_by_one_fill_the_servers_evenly_even_when_one_always_looks_idle():
    fleet = loaded(0, 0, 0)
    fleet[0].in_flight = -100  # without the whole group counted, it would take every group
    for g in range(6):
        server, reason = place(fleet, f"g{g}", None, {}, adds=8) or (None, None)
        assert server is not None and reason == Reason.LOAD
        server.pinned += 8
    assert [s.pinned for s in fleet] == [16, 16, 16]


def test_a_moving_rollout_goes_to_the_server_holding_most_of_its_history_before_its_group_and_load():
    fleet = loaded(2, 3, 3)  # 8 + 1 over 3 servers: the bound is 4
    cached = {"http://s1": 512, "http://s2": 2048}
    assert place(fleet, "g", None, {"http://s1": 3}, cached=cached) == (fleet[2], Reason.HISTORY)


def test_a_server_holding_a_moving_rollouts_history_but_its_share_of_rollouts_is_passed_over():
    # 20 + 1 over 2 servers: the bound is 14; s1 holds it.
    fleet = loaded(6, 14)
    assert place(fleet, "g", None, {}, cached={"http://s1": 4096}) == (fleet[0], Reason.LOAD)


def new(rollout_id: str, group_id: str, size: int | None) -> NewRollout:
    return NewRollout(rollout_id=rollout_id, group_id=group_id, group_size=size)


async def burst(fleet: Fleet, store: Store, groups: int, size: int, declared: bool) -> dict[str, set[str]]:
    """`groups` groups of `size` created, then all their first calls at once, members interleaved as a
    trainer's burst arrives; each group's servers."""
    members = [(f"g{g}", f"g{g}-m{m}") for m in range(size) for g in range(groups)]
    for group_id, rollout_id in members:
        await store.create_rollout(new(rollout_id, group_id, size if declared else None))
    placed = await asyncio.gather(*(fleet.route(rollout_id, None) for _, rollout_id in members))
    servers: dict[str, set[str]] = {}
    for (group_id, _), (server, _) in zip(members, placed, strict=True):
        servers.setdefault(group_id, set()).add(server.url)
    return servers


@pytest.mark.anyio
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
async def test_groups_started_in_one_burst_each_stay_on_one_server_and_the_servers_take_equal_shares(
    placing, declared
):
    fleet, store = placing
    reasons: list[Reason] = []
    fleet.placement.placed = reasons.append

    servers = await burst(fleet, store, groups=6, size=4, declared=declared)

    assert all(len(urls) == 1 for urls in servers.values()), servers
    assert sorted(Counter(url for (url,) in servers.values()).values()) == [2, 2, 2]
    assert [server.pinned for server in fleet.servers.values()] == [8, 8, 8]
    assert Counter(reasons) == {Reason.LOAD: 6, Reason.GROUP: 18}


@pytest.mark.anyio
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
async def test_one_group_of_twelve_alone_on_three_idle_servers_splits_eight_and_four(placing, declared):
    fleet, store = placing
    reasons: list[Reason] = []
    fleet.placement.placed = reasons.append

    servers = await burst(fleet, store, groups=1, size=12, declared=declared)

    assert len(servers["g0"]) == 2
    assert sorted(server.pinned for server in fleet.servers.values()) == [0, 4, 8]
    stored = await asyncio.gather(*(store.pin(f"g0-m{m}", lambda _: "", fleet.urls) for m in range(12)))
    assert sorted(Counter(pin.url for pin in stored).values()) == [4, 8]
    assert Counter(reasons) == {Reason.LOAD: 1, Reason.GROUP: 7, Reason.OVERFLOW: 4}


@pytest.mark.anyio
async def test_a_group_of_sixteen_declared_alone_on_four_idle_servers_splits_eight_and_eight(placing):
    fleet, store = placing
    fleet.add("http://s3", healthy=True)
    reasons: list[Reason] = []
    fleet.placement.placed = reasons.append

    await burst(fleet, store, groups=1, size=16, declared=True)

    assert sorted(server.pinned for server in fleet.servers.values()) == [0, 0, 8, 8]
    assert Counter(reasons) == {Reason.LOAD: 1, Reason.GROUP: 7, Reason.OVERFLOW: 8}


@pytest.mark.anyio
async def test_placement_by_load_alone_spreads_each_groups_members(placing):
    fleet, store = placing
    fleet.placement.by_group = False

    servers = await burst(fleet, store, groups=6, size=4, declared=True)

    assert [server.pinned for server in fleet.servers.values()] == [8, 8, 8]
    assert sum(len(urls) for urls in servers.values()) > 6  # members of a group on several servers


@pytest.mark.anyio
async def test_the_members_of_a_group_whose_server_is_ejected_move_together(placing):
    fleet, store = placing
    reasons: list[Reason] = []
    servers = await burst(fleet, store, groups=1, size=4, declared=True)
    (home,) = servers["g0"]
    fleet.servers[home].healthy = False
    fleet.placement.placed = reasons.append

    moved = await asyncio.gather(*(fleet.route(f"g0-m{m}", None) for m in range(4)))

    assert len({server.url for server, _ in moved}) == 1
    assert {left for _, left in moved} == {home}
    assert reasons == [Reason.LOAD, Reason.GROUP, Reason.GROUP, Reason.GROUP]


@pytest.mark.anyio
async def test_a_rollout_whose_server_fails_moves_where_its_last_turn_is_cached_and_its_sibling_follows_it(
    placing,
):
    fleet, store = placing
    reasons: list[Reason] = []
    servers = await burst(fleet, store, groups=1, size=2, declared=True)
    (home,) = servers["g0"]
    prompt, reply = np.arange(100, 400, dtype=np.int32), np.arange(7, 39, dtype=np.int32)
    await store.writer.insert_turns(
        [
            TurnRecord(
                rollout_id="g0-m0",
                endpoint="chat",
                model=None,
                stream=False,
                policy_version="v0",
                started_at=0.0,
                finished_at=1.0,
                backend=home,
                prompt_ids=prompt,
                completion_ids=reply,
            )
        ]
    )
    elsewhere = sorted(url for url in fleet.servers if url != home)
    fleet.prefixes.saw(elsewhere[1], np.concatenate([prompt, reply])[:160])  # ten blocks of its history
    fleet.prefixes.saw(elsewhere[0], prompt[:64])
    fleet.servers[home].healthy = False
    fleet.placement.placed = reasons.append

    moved, left = await fleet.route("g0-m0", None)
    sibling, _ = await fleet.route("g0-m1", None)  # no turn yet: it goes where its group now is

    assert (moved.url, left, reasons[0]) == (elsewhere[1], home, Reason.HISTORY)
    assert (sibling.url, reasons[1]) == (elsewhere[1], Reason.GROUP)


@pytest.mark.anyio
async def test_a_rollout_that_must_move_is_told_so_before_any_choice_and_moves_once_told_the_caches(
    placing,
):
    """Where a moving rollout goes depends on the servers' caches, looked up on the event loop: the store's
    transaction, which every other commit waits for, never hashes a history."""
    _, store = placing
    chosen: list[Loads] = []

    def pick(loads: Loads) -> str:
        chosen.append(loads)
        return "http://s1"

    first = await store.pin("r", lambda _: "http://s0", ["http://s0", "http://s1"])
    asked = await store.pin("r", pick, ["http://s1"])
    told = await store.pin("r", pick, ["http://s1"], {"http://s1": 64})

    assert first == Pin("http://s0", None, placed=True)
    assert asked == MOVES
    assert told == Pin("http://s1", "http://s0", placed=True)
    assert [loads.cached for loads in chosen] == [{"http://s1": 64}]


def test_max_loras_is_read_from_vllms_lora_series_and_none_without_lora():
    lines = [
        "# TYPE vllm:lora_requests_info gauge",
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.79e+09',
    ]
    assert (max_loras(lines), max_loras(["vllm:num_requests_running 0.0"])) == (4, None)
