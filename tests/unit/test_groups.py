"""Pure GRPO group logic of training_data.groups: skip reasons, masking, dropped groups and advantages."""

from __future__ import annotations

import pytest

from training_data.groups import (
    RolloutInfo,
    SampleOptions,
    Selection,
    TurnOutline,
    choice_calls,
    classify,
    numeric_version,
    rewarded_choices,
)


def rollout(
    rollout_id: str,
    group_id: str = "g",
    *,
    status: str = "completed",
    reward: float | None = 1.0,
    turns: int = 1,
    bad_turns: int = 0,
    versions: list[str] | None = None,
) -> RolloutInfo:
    return RolloutInfo(
        rollout_id,
        group_id,
        status,
        reward,
        None,
        turns=turns,
        bad_turns=bad_turns,
        versions=list(versions) if versions is not None else ["0"],
    )


def reasons(selection: Selection) -> dict[str, str | None]:
    return {r.rollout_id: r.skip_reason for r in selection.skipped}


def advantages(selection: Selection) -> dict[str, float]:
    return {r.rollout_id: r.advantage for r in selection.rollouts}


# --- skip reasons -------------------------------------------------------------------------------------------


def test_completed_and_truncated_rollouts_with_a_reward_are_trainable() -> None:
    infos = [rollout("a", status="completed", reward=0.0), rollout("b", status="truncated", reward=1.0)]
    selection = classify(infos, SampleOptions())
    assert [r.rollout_id for r in selection.rollouts] == ["a", "b"]
    assert selection.skipped == []
    assert [(r.skip_reason, r.masked) for r in infos] == [(None, False), (None, False)]


def test_running_rollout_is_skipped_as_late() -> None:
    infos = [rollout("a"), rollout("b", status="running", reward=None, turns=0)]
    selection = classify(infos, SampleOptions(group_timeout=10.0))
    assert reasons(selection) == {"b": "late"}
    assert [r.rollout_id for r in selection.rollouts] == ["a"]


def test_failed_and_aborted_rollouts_are_skipped_as_failed_even_with_a_reward() -> None:
    infos = [
        rollout("ok"),
        rollout("f", status="failed", reward=1.0),
        rollout("x", status="aborted", reward=1.0),
    ]
    selection = classify(infos, SampleOptions())
    assert reasons(selection) == {"f": "failed", "x": "failed"}
    assert [r.rollout_id for r in selection.rollouts] == ["ok"]


def test_rollout_without_a_reward_is_skipped_as_no_reward() -> None:
    selection = classify([rollout("a"), rollout("b", reward=None)], SampleOptions())
    assert reasons(selection) == {"b": "no_reward"}


def test_zero_reward_is_a_reward_not_a_missing_one() -> None:
    selection = classify([rollout("a", reward=0.0)], SampleOptions())
    assert selection.skipped == []
    assert advantages(selection) == {"a": 0.0}


def test_rollout_without_turns_is_skipped_as_no_turns() -> None:
    selection = classify([rollout("a"), rollout("b", turns=0, versions=[])], SampleOptions())
    assert reasons(selection) == {"b": "no_turns"}


def test_rollout_with_unretried_bad_turns_is_skipped_as_error_turns_by_default() -> None:
    infos = [rollout("a"), rollout("b", turns=3, bad_turns=1)]
    selection = classify(infos, SampleOptions())
    assert reasons(selection) == {"b": "error_turns"}
    assert infos[1].masked is False


def test_include_errors_keeps_a_rollout_with_bad_turns_masked() -> None:
    infos = [rollout("a", reward=1.0), rollout("b", reward=0.0, turns=3, bad_turns=2)]
    selection = classify(infos, SampleOptions(include_errors=True))
    assert selection.skipped == []
    assert [(r.rollout_id, r.masked) for r in selection.rollouts] == [("a", False), ("b", True)]


def test_bad_turn_count_of_zero_means_refused_or_retried_turns_do_not_spoil_a_rollout() -> None:
    # load_rollouts (SQL, covered by the real-engine suite) leaves refused and retried turns out of bad_turns.
    info = rollout("a", turns=4, bad_turns=0)
    selection = classify([info], SampleOptions())
    assert (info.skip_reason, info.masked) == (None, False)
    assert selection.rollouts == [info]


def test_skip_reasons_take_precedence_late_failed_no_reward_no_turns_error_turns_stale() -> None:
    options = SampleOptions(current_version=10, max_staleness=1)
    infos = [
        rollout("late", status="running", reward=None, turns=0, bad_turns=1, versions=["0"]),
        rollout("failed", status="failed", reward=None, turns=0, bad_turns=1, versions=["0"]),
        rollout("no_reward", reward=None, turns=0, bad_turns=1, versions=["0"]),
        rollout("no_turns", turns=0, bad_turns=1, versions=["0"]),
        rollout("error_turns", bad_turns=1, versions=["0"]),
        rollout("stale", versions=["0"]),
    ]
    selection = classify(infos, options)
    assert reasons(selection) == {
        "late": "late",
        "failed": "failed",
        "no_reward": "no_reward",
        "no_turns": "no_turns",
        "error_turns": "error_turns",
        "stale": "stale",
    }


def test_include_errors_lets_staleness_decide_a_stale_rollout_with_bad_turns() -> None:
    info = rollout("a", bad_turns=1, versions=["0"])
    classify([info], SampleOptions(include_errors=True, current_version=5, max_staleness=2))
    assert (info.skip_reason, info.masked) == ("stale", False)


# --- staleness ----------------------------------------------------------------------------------------------


def test_rollout_more_than_max_staleness_versions_behind_is_stale() -> None:
    infos = [rollout("v2", versions=["2"]), rollout("v3", versions=["3"]), rollout("v5", versions=["5"])]
    selection = classify(infos, SampleOptions(current_version=5, max_staleness=2))
    assert reasons(selection) == {"v2": "stale"}
    assert [r.rollout_id for r in selection.rollouts] == ["v3", "v5"]


def test_staleness_is_measured_from_the_oldest_turn_version() -> None:
    info = rollout("a", turns=3, versions=["5", "2", "4"])
    assert info.oldest_version == 2
    classify([info], SampleOptions(current_version=5, max_staleness=2))
    assert info.skip_reason == "stale"


def test_staleness_needs_both_current_version_and_max_staleness() -> None:
    only_current = rollout("a", versions=["0"])
    only_max = rollout("b", versions=["0"])
    classify([only_current], SampleOptions(current_version=100))
    classify([only_max], SampleOptions(max_staleness=0))
    assert (only_current.skip_reason, only_max.skip_reason) == (None, None)


def test_max_staleness_zero_serves_only_the_current_version() -> None:
    infos = [rollout("old", versions=["6"]), rollout("now", versions=["7"])]
    selection = classify(infos, SampleOptions(current_version=7, max_staleness=0))
    assert reasons(selection) == {"old": "stale"}


def test_rollout_from_a_newer_version_than_current_is_not_stale() -> None:
    info = rollout("a", versions=["9"])
    classify([info], SampleOptions(current_version=3, max_staleness=0))
    assert info.skip_reason is None


def test_oldest_version_ignores_non_numeric_and_missing_versions_and_reads_negatives() -> None:
    assert rollout("a", versions=["v1", "7", None, "3"]).oldest_version == 3  # type: ignore[list-item]
    assert rollout("b", versions=["-2", "1"]).oldest_version == -2
    assert rollout("c", versions=["step-1", "latest"]).oldest_version is None
    assert rollout("d", versions=[]).oldest_version is None


@pytest.mark.parametrize(
    ("version", "number"),
    [("7", 7), ("-3", -3), ("0", 0), ("--3", None), ("²", None), ("v7", None), ("", None), ("-", None)],
)
def test_a_numeric_policy_version_is_ascii_digits_with_at_most_one_leading_minus(
    version: str, number: int | None
) -> None:
    assert numeric_version(version) == number


def test_oldest_version_skips_versions_that_only_look_numeric() -> None:
    assert rollout("a", versions=["--3", "²", "7", "v7"]).oldest_version == 7
    assert rollout("b", versions=["--3", "²", "-3", "7", "v7"]).oldest_version == -3


def test_staleness_of_a_rollout_with_look_alike_versions_is_measured_on_its_numeric_ones() -> None:
    infos = [rollout("a", versions=["--3", "5"]), rollout("b", versions=["²", "2"])]
    selection = classify(infos, SampleOptions(current_version=5, max_staleness=2))
    assert reasons(selection) == {"b": "stale"}


def test_rollout_with_only_non_numeric_versions_is_never_stale() -> None:
    info = rollout("a", versions=["ckpt-a"])
    classify([info], SampleOptions(current_version=100, max_staleness=0))
    assert info.skip_reason is None


# --- groups and counts --------------------------------------------------------------------------------------


def test_group_with_no_trainable_rollout_is_dropped_not_served_empty() -> None:
    infos = [rollout("a", "dead", reward=None), rollout("b", "dead", status="failed"), rollout("c", "live")]
    selection = classify(infos, SampleOptions())
    assert list(selection.served) == ["live"]
    assert selection.dropped_groups == ["dead"]
    assert reasons(selection) == {"a": "no_reward", "b": "failed"}


def test_groups_are_served_in_order_of_first_appearance() -> None:
    infos = [rollout("b1", "b"), rollout("a1", "a"), rollout("b2", "b")]
    selection = classify(infos, SampleOptions())
    assert {g: [r.rollout_id for r in members] for g, members in selection.served.items()} == {
        "b": ["b1", "b2"],
        "a": ["a1"],
    }
    assert [r.rollout_id for r in selection.rollouts] == ["b1", "b2", "a1"]


def test_counts_report_groups_rollouts_masked_dropped_and_skips_by_sorted_reason() -> None:
    infos = [
        rollout("a", "g1", versions=["4"]),
        rollout("b", "g1", bad_turns=1, versions=["3", "4"]),
        rollout("c", "g1", status="aborted"),
        rollout("d", "g2", reward=None),
        rollout("e", "g2", versions=["0"]),
        rollout("f", "g3", reward=None),
    ]
    selection = classify(infos, SampleOptions(include_errors=True, current_version=4, max_staleness=1))
    counts = selection.counts()
    assert counts == {
        "groups": 1,
        "served_rollouts": 2,
        "masked_rollouts": 1,
        "dropped_groups": 2,
        "skipped_failed": 1,
        "skipped_no_reward": 2,
        "skipped_stale": 1,
    }
    assert list(counts)[4:] == ["skipped_failed", "skipped_no_reward", "skipped_stale"]


def test_empty_selection_counts_are_zero() -> None:
    selection = classify([], SampleOptions())
    assert selection.counts() == {
        "groups": 0,
        "served_rollouts": 0,
        "masked_rollouts": 0,
        "dropped_groups": 0,
    }
    assert selection.rollouts == []


def test_classify_recomputes_skip_reason_and_mask_each_call() -> None:
    info = rollout("a", bad_turns=1)
    classify([info], SampleOptions())
    assert (info.skip_reason, info.masked) == ("error_turns", False)
    classify([info], SampleOptions(include_errors=True))
    assert (info.skip_reason, info.masked) == (None, True)


# --- advantages ---------------------------------------------------------------------------------------------


def test_advantages_are_reward_minus_mean_over_population_std_plus_epsilon() -> None:
    infos = [rollout("a", reward=1.0), rollout("b", reward=0.0)]
    classify(infos, SampleOptions())
    assert [r.advantage for r in infos] == [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)]


def test_advantages_with_zero_epsilon_are_exact_z_scores() -> None:
    infos = [
        rollout(name, reward=reward) for name, reward in [("a", 0.0), ("b", 0.0), ("c", 4.0), ("d", 4.0)]
    ]
    classify(infos, SampleOptions(epsilon=0.0))
    assert [r.advantage for r in infos] == [-1.0, -1.0, 1.0, 1.0]


def test_custom_epsilon_is_added_to_the_std() -> None:
    infos = [rollout("a", reward=3.0), rollout("b", reward=1.0)]
    classify(infos, SampleOptions(epsilon=1.0))
    assert [r.advantage for r in infos] == [0.5, -0.5]


def test_normalize_std_false_gives_mean_centred_advantages() -> None:
    infos = [rollout("a", reward=1.0), rollout("b", reward=2.0), rollout("c", reward=6.0)]
    classify(infos, SampleOptions(normalize_std=False))
    assert [r.advantage for r in infos] == [-2.0, -1.0, 3.0]


def test_group_whose_rewards_are_all_equal_has_zero_advantages() -> None:
    infos = [rollout(name, reward=0.5) for name in "abc"]
    selection = classify(infos, SampleOptions())
    assert advantages(selection) == {"a": 0.0, "b": 0.0, "c": 0.0}
    assert list(selection.served) == ["g"]


@pytest.mark.parametrize("reward", [0.1, 0.7, 1e300])
@pytest.mark.parametrize(
    "options",
    [SampleOptions(), SampleOptions(epsilon=0.0), SampleOptions(normalize_std=False)],
    ids=["default", "epsilon 0", "mean-centred"],
)
def test_equal_rewards_that_do_not_average_exactly_give_advantages_of_exactly_zero(
    reward: float, options: SampleOptions
) -> None:
    # mean([0.7] * 3) != 0.7 in float64: centred, the rewards would be about 1e-16 and so would their std.
    infos = [rollout(name, reward=reward) for name in "abc"]
    classify(infos, options)
    assert [r.advantage for r in infos] == [0.0, 0.0, 0.0]


def test_single_rollout_group_has_zero_advantage() -> None:
    info = rollout("a", reward=5.0)
    classify([info], SampleOptions())
    assert info.advantage == 0.0


def test_advantages_are_computed_per_group() -> None:
    infos = [
        rollout("a1", "a", reward=0.0),
        rollout("a2", "a", reward=2.0),
        rollout("b1", "b", reward=10.0),
        rollout("b2", "b", reward=30.0),
    ]
    selection = classify(infos, SampleOptions(normalize_std=False))
    assert advantages(selection) == {"a1": -1.0, "a2": 1.0, "b1": -10.0, "b2": 10.0}


def test_skipped_rollouts_do_not_count_in_group_statistics_and_keep_zero_advantage() -> None:
    infos = [
        rollout("a", reward=1.0),
        rollout("b", reward=3.0),
        rollout("failed", status="failed", reward=100.0),
        rollout("stale", reward=-50.0, versions=["0"]),
    ]
    for info in infos[:3]:
        info.versions = ["9"]
    selection = classify(infos, SampleOptions(normalize_std=False, current_version=9, max_staleness=1))
    assert advantages(selection) == {"a": -1.0, "b": 1.0}
    assert [(r.rollout_id, r.advantage) for r in selection.skipped] == [("failed", 0.0), ("stale", 0.0)]


def test_masked_rollouts_count_in_their_group_statistics() -> None:
    infos = [rollout("a", reward=0.0), rollout("b", reward=4.0, bad_turns=1), rollout("c", reward=2.0)]
    selection = classify(infos, SampleOptions(include_errors=True, normalize_std=False))
    assert advantages(selection) == {"a": -2.0, "b": 2.0, "c": 0.0}
    assert [r.masked for r in selection.rollouts] == [False, True, False]


def test_advantages_are_python_floats() -> None:
    infos = [rollout("a", reward=1.0), rollout("b", reward=0.0)]
    classify(infos, SampleOptions())
    assert [type(r.advantage) for r in infos] == [float, float]


# --- choices of one call rewarded one by one ----------------------------------------------------------------


def outline(turn_index: int, choice_index: int, started_at: float, sampled: bool = True) -> TurnOutline:
    return TurnOutline(turn_index, choice_index, started_at, sampled)


def test_a_calls_choices_are_consecutive_turns_of_one_start_with_rising_choice_index() -> None:
    turns = [
        outline(0, 0, 1.0),  # a call with one choice
        outline(1, 0, 2.0),  # a call with three
        outline(2, 1, 2.0),
        outline(3, 2, 2.0),
        outline(4, 0, 3.0),  # two calls of two choices that started at the same time
        outline(5, 1, 3.0),
        outline(6, 0, 3.0),
        outline(7, 1, 3.0),
        outline(8, 1, 4.0),  # an error call that recorded its second choice only
    ]
    assert choice_calls(turns) == [[1, 2, 3], [4, 5], [6, 7]]


def test_only_calls_whose_every_choice_has_a_turn_reward_are_rewarded_one_by_one() -> None:
    turns = [outline(0, 0, 1.0), outline(1, 1, 1.0), outline(2, 0, 2.0), outline(3, 1, 2.0)]
    calls, cover = rewarded_choices(turns, {0: 1.0, 1: 0.0, 2: 0.5})
    assert (calls, cover) == ([{0: 1.0, 1: 0.0}], False)


def test_choices_cover_a_rollout_when_every_sample_is_a_rewarded_choice() -> None:
    turns = [outline(0, 0, 1.0), outline(1, 1, 1.0), outline(2, 0, 2.0, sampled=False)]
    assert rewarded_choices(turns, {0: 1.0, 1: 0.0}) == ([{0: 1.0, 1: 0.0}], True)
    assert rewarded_choices(turns, {}) == ([], False)
    assert rewarded_choices([outline(0, 0, 1.0)], {0: 1.0}) == ([], False)  # one choice: no call to compare


def rewarded_call(
    rollout_id: str, rewards: list[float], *, reward: float | None = None, cover: bool = True
) -> RolloutInfo:
    """A rollout whose one n > 1 call (turns 0..n-1) has a reward per choice."""
    info = rollout(rollout_id, reward=reward, turns=len(rewards))
    info.choice_rewards = [dict(enumerate(rewards))]
    info.choices_cover = cover
    return info


def test_choices_rewarded_one_by_one_get_advantages_across_their_call() -> None:
    info = rewarded_call("a", [1.0, 0.0])
    selection = classify([info], SampleOptions())
    assert selection.skipped == []
    assert info.choice_outcomes == {0: (1.0, 0.5 / (0.5 + 1e-6)), 1: (0.0, -0.5 / (0.5 + 1e-6))}


def test_choice_advantages_follow_the_groups_normalize_std_and_epsilon() -> None:
    centred = rewarded_call("a", [1.0, 0.0, 0.5])
    classify([centred], SampleOptions(normalize_std=False))
    assert centred.choice_outcomes == {0: (1.0, 0.5), 1: (0.0, -0.5), 2: (0.5, 0.0)}
    scaled = rewarded_call("b", [3.0, 1.0])
    classify([scaled], SampleOptions(epsilon=1.0))
    assert scaled.choice_outcomes == {0: (3.0, 0.5), 1: (1.0, -0.5)}


@pytest.mark.parametrize("epsilon", [1e-6, 0.0])
def test_equal_choice_rewards_give_advantages_of_exactly_zero(epsilon: float) -> None:
    info = rewarded_call("a", [0.1, 0.1, 0.1])
    classify([info], SampleOptions(epsilon=epsilon))
    assert info.choice_outcomes == {0: (0.1, 0.0), 1: (0.1, 0.0), 2: (0.1, 0.0)}


def test_each_call_of_a_rollout_is_its_own_comparison() -> None:
    info = rollout("a", reward=None, turns=4)
    info.choice_rewards = [{0: 1.0, 1: 0.0}, {2: 5.0, 3: 7.0}]
    info.choices_cover = True
    classify([info], SampleOptions(normalize_std=False))
    assert info.choice_outcomes == {0: (1.0, 0.5), 1: (0.0, -0.5), 2: (5.0, -1.0), 3: (7.0, 1.0)}


def test_a_rollout_with_samples_outside_its_rewarded_choices_still_needs_a_rollout_reward() -> None:
    uncovered = rewarded_call("a", [1.0, 0.0], cover=False)
    selection = classify([uncovered, rollout("b")], SampleOptions())
    assert reasons(selection) == {"a": "no_reward"}
    assert uncovered.choice_outcomes == {}


def test_rollouts_trained_on_their_choices_alone_stay_out_of_the_groups_statistics() -> None:
    infos = [rollout("a", reward=1.0), rollout("b", reward=0.0), rewarded_call("c", [9.0, 3.0])]
    selection = classify(infos, SampleOptions(normalize_std=False))
    assert advantages(selection) == {"a": 0.5, "b": -0.5, "c": 0.0}
    assert infos[2].choice_outcomes == {0: (9.0, 3.0), 1: (3.0, -3.0)}


def test_a_rollout_with_both_keeps_its_rollout_advantage_for_the_other_samples() -> None:
    infos = [rewarded_call("a", [1.0, 0.0], reward=2.0, cover=False), rollout("b", reward=0.0)]
    classify(infos, SampleOptions(normalize_std=False))
    assert (infos[0].advantage, infos[0].choice_outcomes) == (1.0, {0: (1.0, 0.5), 1: (0.0, -0.5)})
