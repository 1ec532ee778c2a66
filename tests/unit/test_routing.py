"""Where rollouts go: the least-loaded healthy server that serves the model, and what vLLM's metrics say of
its prefix cache."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.backend import prefix_hit_rate
from gateway.fleet.discovery import BackendFile
from gateway.fleet.routing import choose, share_bound
from gateway.fleet.servers import Server


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
