"""Lineage of a rollout's turns: parent, fork origin, drift, delta storage and its rebuild, packed ids."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from gateway.store.lineage import (
    Lineage,
    Node,
    Placement,
    canonical_message,
    find_parent,
    history_hashes,
    ids_digest,
    lineage_of,
    place,
    reply_message,
    with_reply,
)
from rollout_store.delta import rebuild, reference_of
from rollout_store.tokens import (
    ID_DTYPE,
    LOGPROB_DTYPE,
    common_prefix_len,
    pack_ids,
    pack_logprobs,
    unpack_ids,
    unpack_logprobs,
)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=ID_DTYPE)


def no_load(index: int) -> Node:
    raise AssertionError(f"load({index}) was not expected: the turn is in memory")


def fields(placement: Placement) -> tuple[Any, ...]:
    """A placement as plain values (numpy arrays do not compare as a whole)."""
    return (
        placement.parent_turn,
        placement.forked_from,
        placement.prefix_tokens,
        placement.drift_tokens,
        placement.prompt_suffix.tolist(),
        placement.prefix_messages,
        placement.new_messages,
    )


SYSTEM = {"role": "system", "content": "You list files."}
USER = {"role": "user", "content": "List /tmp."}
USER_EDITED = {"role": "user", "content": "List /var."}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "ls", "arguments": '{"path": "/tmp", "all": true}'},
}
REPLY_0 = reply_message(None, [CALL])
# The harness echoes the reply with its own call id, its arguments re-serialized and reasoning added.
REPLY_0_ECHOED: dict[str, Any] = {
    "role": "assistant",
    "content": "",
    "reasoning": "I should list it.",
    "tool_calls": [
        {
            "id": "toolu_9",
            "type": "function",
            "function": {"name": "ls", "arguments": {"all": True, "path": "/tmp"}},
        }
    ],
}
TOOL = {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}
TOOL_OTHER = {"role": "tool", "tool_call_id": "call_1", "content": "b.txt"}
ANSWER_1 = {"role": "assistant", "content": "a.txt is there."}
USER_2 = {"role": "user", "content": "And /var?"}

# ChatML-like ids: 1 = <|im_start|>, 2 = <|im_end|>, 9 = newline, 30 = "assistant".
PROMPT_0 = ids(1, 10, 11, 2, 1, 20, 21, 2, 1, 30)  # system, user, generation prompt
COMPLETION_0 = ids(40, 41, 42, 2)  # the tool call and <|im_end|>
SEQUENCE_0 = np.concatenate([PROMPT_0, COMPLETION_0])  # 14 ids
TOOL_TURN = ids(9, 1, 50, 51, 2, 1, 30)


def lineage_after_turn_0() -> Lineage:
    lineage = Lineage()
    lineage.add(0, [SYSTEM, USER], SEQUENCE_0, REPLY_0, "tool_calls")
    return lineage


# --- packed ids and logprobs ----------------------------------------------------------------------------


def test_ids_pack_as_little_endian_int32_without_header():
    assert pack_ids([1, -2, 151645]) == struct.pack("<3i", 1, -2, 151645)
    assert pack_ids(ids()) == b""


def test_packed_ids_unpack_to_the_same_int32_array():
    unpacked = unpack_ids(pack_ids(np.array([7, 0, 2**31 - 1], dtype=np.int64)))
    assert unpacked.dtype == ID_DTYPE
    assert unpacked.tolist() == [7, 0, 2**31 - 1]


def test_missing_or_empty_blobs_unpack_to_empty_arrays():
    for blob in (None, b""):
        assert (unpack_ids(blob).dtype, unpack_ids(blob).shape) == (ID_DTYPE, (0,))
        assert (unpack_logprobs(blob).dtype, unpack_logprobs(blob).shape) == (LOGPROB_DTYPE, (0,))


def test_logprobs_pack_as_little_endian_float32_and_round_trip():
    assert pack_logprobs([-0.5, 0.0]) == struct.pack("<2f", -0.5, 0.0)
    unpacked = unpack_logprobs(pack_logprobs([-0.5, -0.25, -1.125]))
    assert unpacked.dtype == LOGPROB_DTYPE
    assert unpacked.tolist() == [-0.5, -0.25, -1.125]


def test_common_prefix_len_stops_at_the_first_difference():
    assert common_prefix_len(ids(1, 2, 3, 4), ids(1, 2, 9, 4)) == 2
    assert common_prefix_len(ids(5, 2), ids(1, 2)) == 0


def test_common_prefix_len_of_a_prefix_is_the_shorter_length():
    assert common_prefix_len(ids(1, 2), ids(1, 2, 3)) == 2
    assert common_prefix_len(ids(1, 2, 3), ids(1, 2, 3)) == 3
    assert common_prefix_len(ids(), ids(1, 2)) == 0


# --- canonical messages ---------------------------------------------------------------------------------


def test_canonical_form_keeps_role_content_tool_names_and_sorted_arguments():
    expected = b'["assistant",null,["ls\\u0000{\\"all\\":true,\\"path\\":\\"/tmp\\"}"],null]'
    assert canonical_message(REPLY_0) == expected
    assert canonical_message(TOOL) == b'["tool","a.txt",[],null]'


def test_canonical_form_ignores_tool_call_ids_reasoning_and_argument_key_order():
    assert canonical_message(REPLY_0_ECHOED) == canonical_message(REPLY_0)
    reasoning_content = {**ANSWER_1, "reasoning_content": "thinking"}
    assert canonical_message(reasoning_content) == canonical_message(ANSWER_1)


def test_canonical_form_treats_empty_and_missing_content_alike():
    assert canonical_message({"role": "assistant", "content": ""}) == canonical_message({"role": "assistant"})


def test_canonical_form_tells_apart_arguments_names_and_roles():
    other_call = {**CALL, "function": {"name": "ls", "arguments": '{"path": "/"}'}}
    other_path = {**REPLY_0, "tool_calls": [other_call]}
    assert canonical_message(other_path) != canonical_message(REPLY_0)
    assert canonical_message({**USER, "name": "alice"}) != canonical_message(USER)
    assert canonical_message({**USER, "role": "system"}) != canonical_message(USER)


def test_arguments_that_are_not_json_are_compared_as_written():
    def call(arguments: str) -> dict[str, Any]:
        return {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]}

    assert canonical_message(call('{"a": 1')) == b'["assistant",null,["f\\u0000{\\"a\\": 1"],null]'
    assert canonical_message(call('{"a": 1')) != canonical_message(call('{"a":1'))


def test_history_hash_k_identifies_the_first_k_plus_one_messages():
    messages = [SYSTEM, USER, REPLY_0, TOOL]
    hashes = history_hashes(messages)
    assert len(hashes) == 4
    assert [len(h) for h in hashes] == [16, 16, 16, 16]
    assert hashes[:2] == history_hashes(messages[:2])
    assert len(set(hashes)) == 4
    assert history_hashes([SYSTEM, USER, REPLY_0_ECHOED, TOOL]) == hashes


def test_reply_message_is_the_assistant_message_a_harness_sends_back():
    assert reply_message("hi", None) == {"role": "assistant", "content": "hi", "tool_calls": None}


# --- parent, fork origin and drift ----------------------------------------------------------------------


def test_first_turn_is_a_root_stored_whole():
    placement = place(Lineage(), PROMPT_0, [SYSTEM, USER], no_load)
    assert fields(placement) == (None, None, 0, None, PROMPT_0.tolist(), 0, [SYSTEM, USER])


def test_turn_extending_the_parents_exact_ids_has_drift_zero():
    prompt = np.concatenate([SEQUENCE_0, TOOL_TURN])
    placement = place(lineage_after_turn_0(), prompt, [SYSTEM, USER, REPLY_0, TOOL], no_load)
    assert fields(placement) == (0, None, 14, 0, TOOL_TURN.tolist(), 2, [REPLY_0, TOOL])


def test_drift_counts_the_parents_ids_the_prompt_does_not_reproduce():
    # The template re-tokenizes the sampled call 41 42 as 4142: 3 of the parent's 14 ids are not reproduced.
    prompt = ids(*PROMPT_0, 40, 4142, 2, *TOOL_TURN)
    placement = place(lineage_after_turn_0(), prompt, [SYSTEM, USER, REPLY_0, TOOL], no_load)
    assert fields(placement) == (0, None, 11, 3, [4142, 2, *TOOL_TURN], 2, [REPLY_0, TOOL])


def test_exact_mode_drift_is_measured_on_the_plain_render():
    spliced = np.concatenate([SEQUENCE_0, TOOL_TURN])
    plain = ids(*PROMPT_0, 40, 4142, 2, *TOOL_TURN)
    placement = place(
        lineage_after_turn_0(), spliced, [SYSTEM, USER, REPLY_0, TOOL], no_load, plain_prompt_ids=plain
    )
    assert fields(placement) == (0, None, 14, 3, TOOL_TURN.tolist(), 2, [REPLY_0, TOOL])


def test_echoed_reply_with_new_ids_no_reasoning_and_reordered_arguments_still_finds_its_parent():
    messages = [SYSTEM, USER, REPLY_0_ECHOED, TOOL]
    placement = place(lineage_after_turn_0(), np.concatenate([SEQUENCE_0, TOOL_TURN]), messages, no_load)
    # The parent is found canonically; the stored messages are the ones sent, from the first raw difference.
    assert fields(placement) == (0, None, 14, 0, TOOL_TURN.tolist(), 2, [REPLY_0_ECHOED, TOOL])


def test_parent_is_the_latest_turn_whose_messages_and_reply_are_a_prefix():
    lineage = lineage_after_turn_0()
    lineage.add(1, [SYSTEM, USER], ids(*PROMPT_0, 40, 41, 43, 2), REPLY_0, "tool_calls")  # same reply again
    assert find_parent(lineage, ids(1), [SYSTEM, USER, REPLY_0, TOOL], no_load) == (1, None)


def test_turn_without_a_reply_that_reached_the_agent_is_not_a_parent():
    lineage = Lineage()
    lineage.add(0, [SYSTEM, USER], SEQUENCE_0, None, "tool_calls")
    assert find_parent(lineage, ids(1), [SYSTEM, USER, REPLY_0, TOOL], no_load) == (None, 0)


def test_turn_sharing_only_a_beginning_is_forked_from_the_turn_sharing_the_most():
    lineage = lineage_after_turn_0()
    # Turn 1 edits the user message: it shares only the system message with turn 0.
    lineage.add(1, [SYSTEM, USER_EDITED], ids(1, 10, 11, 2, 1, 20, 22, 2, 1, 30, 45, 2), None, "stop")
    # This turn shares [system, user] with turn 0 (two messages) but only [system] with turn 1.
    prompt = ids(1, 10, 11, 2, 1, 20, 21, 2, 1, 33)
    placement = place(lineage, prompt, [SYSTEM, USER, USER_2], no_load)
    assert fields(placement) == (None, 0, 9, None, [33], 2, [USER_2])


def test_fork_origin_among_equal_sharers_is_the_latest():
    lineage = lineage_after_turn_0()
    lineage.add(1, [SYSTEM, USER_EDITED], ids(1, 10, 11, 2, 1, 20, 22, 2, 1, 30, 45, 2), None, "stop")
    placement = place(lineage, ids(1, 10, 11, 2, 1, 60), [SYSTEM, USER_2], no_load)
    assert fields(placement) == (None, 1, 5, None, [60], 1, [USER_2])


def test_turn_with_unrelated_history_is_a_root():
    other = [{"role": "system", "content": "Something else."}, USER]
    placement = place(lineage_after_turn_0(), ids(1, 12, 2), other, no_load)
    assert fields(placement) == (None, None, 0, None, [1, 12, 2], 0, other)


def test_completions_turn_finds_its_parent_by_id_prefix():
    lineage = Lineage()
    lineage.add(0, None, ids(1, 2, 3, 4), None, "stop")
    lineage.add(1, None, ids(1, 2, 3, 4, 5, 6), None, "stop")
    assert fields(place(lineage, ids(1, 2, 3, 4, 5, 6, 7), None, no_load)) == (1, None, 6, 0, [7], 0, None)
    # Turn 1 is not a prefix of this prompt; turn 0 is.
    assert fields(place(lineage, ids(1, 2, 3, 4, 8), None, no_load)) == (0, None, 4, 0, [8], 0, None)


def test_completions_turn_without_a_prefix_parent_is_forked_from_the_longest_sharer():
    lineage = Lineage()
    lineage.add(0, None, ids(1, 2, 3, 4), None, "stop")
    lineage.add(1, None, ids(1, 2, 5, 6), None, "stop")
    assert fields(place(lineage, ids(1, 2, 3, 9), None, no_load)) == (None, 0, 3, None, [9], 0, None)
    assert fields(place(lineage, ids(7, 8), None, no_load)) == (None, None, 0, None, [7, 8], 0, None)


def test_completions_turn_extending_a_turn_that_left_memory_finds_it_as_parent():
    # Turns 1 and 2 keep their ids in memory; turn 0's are gone, but it is still this prompt's parent.
    lineage = Lineage()
    lineage.add(0, None, ids(1, 2, 3, 4), None, "stop")
    lineage.add(1, None, ids(5, 6, 7), None, "stop")
    lineage.add(2, None, ids(8, 9), None, "stop")
    assert sorted(lineage.nodes) == [1, 2]
    assert find_parent(lineage, ids(1, 2, 3, 4, 10), None, no_load) == (0, None)

    def load(index: int) -> Node:
        return Node(index, None, ids(1, 2, 3, 4), "stop")

    assert fields(place(lineage, ids(1, 2, 3, 4, 10), None, load)) == (0, None, 4, 0, [10], 0, None)


def test_completions_parent_is_the_latest_extended_turn_in_memory_or_not():
    lineage = Lineage()
    lineage.add(0, None, ids(1, 2), None, "stop")
    lineage.add(1, None, ids(1, 2, 3), None, "stop")
    lineage.add(2, None, ids(1, 2, 3), None, "stop")  # the same ids as turn 1, later
    lineage.add(3, None, ids(7), None, "stop")
    lineage.add(4, None, ids(8), None, "stop")
    assert sorted(lineage.nodes) == [3, 4]
    assert find_parent(lineage, ids(1, 2, 3, 4), None, no_load) == (2, None)  # turns 0, 1 and 2 match
    assert find_parent(lineage, ids(1, 2, 5), None, no_load) == (0, None)
    assert find_parent(lineage, ids(1, 2), None, no_load) == (0, None)  # the whole prompt is turn 0's ids
    assert find_parent(lineage, ids(1), None, no_load) == (None, None)


def test_completions_parent_is_compared_on_ids_whatever_their_integer_width():
    lineage = Lineage()
    lineage.add(0, None, np.array([1, 2, 3], dtype=np.int64), None, "stop")
    lineage.add(1, None, ids(5), None, "stop")
    lineage.add(2, None, ids(6), None, "stop")
    assert find_parent(lineage, ids(1, 2, 3, 4), None, no_load) == (0, None)


def test_lineage_rebuilt_from_rows_finds_a_completions_parent_that_left_memory():
    rollout = Rollout()
    rollout.commit(ids(1, 2, 3), ids(4, 5), None)
    rollout.commit(ids(9, 9), ids(6), None)
    rollout.commit(ids(8, 8), ids(7), None)
    rebuilt, _ = lineage_of(rollout.rows)
    assert sorted(rebuilt.nodes) == [1, 2]
    prompt = ids(1, 2, 3, 4, 5, 10, 11)
    assert fields(place(rebuilt, prompt, None, rollout.load)) == (0, None, 5, 0, [10, 11], 0, None)
    assert fields(place(rollout.lineage, prompt, None, rollout.load)) == (0, None, 5, 0, [10, 11], 0, None)


def test_only_the_two_latest_turns_stay_whole_in_memory_the_others_as_their_length_and_digest():
    lineage = Lineage()
    for index in range(4):
        lineage.add(index, [USER], ids(1, index, 2), None, "stop")
    assert sorted(lineage.nodes) == [2, 3]
    assert lineage.ids == {i: (3, ids_digest(ids(1, i, 2))) for i in range(4)}
    assert lineage.tokens == 6
    assert lineage.last_index == 3


def test_turn_without_ids_is_counted_but_not_kept():
    lineage = Lineage()
    lineage.add(0, [USER], ids(), None, None)
    assert (lineage.last_index, lineage.nodes, lineage.prefixes) == (0, {}, {})


def test_reference_out_of_memory_is_loaded_by_index():
    lineage = lineage_after_turn_0()
    lineage.add(1, [USER_EDITED], ids(1, 22, 2, 1, 30, 45, 2), None, "stop")
    lineage.add(2, [USER_2], ids(1, 23, 2, 1, 30, 46, 2), None, "stop")
    assert 0 not in lineage.nodes
    loaded: list[int] = []

    def load(index: int) -> Node:
        loaded.append(index)
        return Node(0, [SYSTEM, USER], SEQUENCE_0, "tool_calls")

    prompt = np.concatenate([SEQUENCE_0, TOOL_TURN])
    placement = place(lineage, prompt, [SYSTEM, USER, REPLY_0, TOOL], load)
    assert loaded == [0]
    assert fields(placement) == (0, None, 14, 0, TOOL_TURN.tolist(), 2, [REPLY_0, TOOL])


def test_reference_in_memory_is_not_loaded():
    lineage = lineage_after_turn_0()
    messages = [SYSTEM, USER, REPLY_0, TOOL]
    assert place(lineage, np.concatenate([SEQUENCE_0, TOOL_TURN]), messages, no_load).parent_turn == 0


# --- delta storage and its rebuild ----------------------------------------------------------------------


class Rollout:
    """Commits turns as the store does: place, store the row with its delta, register in the lineage."""

    def __init__(self) -> None:
        self.lineage = Lineage()
        self.rows: list[Mapping[str, Any]] = []
        self.loaded: list[int] = []
        self.completions: list[tuple[tuple[int, int], ...]] = []
        """Where the model's replies lie in each committed turn's ids, as the lineage was given them."""

    def load(self, index: int) -> Node:
        self.loaded.append(index)
        return lineage_of(self.rows)[1][index]

    def commit(
        self,
        prompt: np.ndarray,
        completion: np.ndarray,
        messages: list[dict[str, Any]] | None,
        *,
        content: str | None = None,
        tool_calls: list[Any] | None = None,
        finish_reason: str | None = "stop",
        status: str = "ok",
    ) -> Placement:
        index = self.lineage.last_index + 1
        placement = place(self.lineage, prompt, messages, self.load)
        self.rows.append(
            {
                "turn_index": index,
                "parent_turn": placement.parent_turn,
                "forked_from": placement.forked_from,
                "prefix_tokens": placement.prefix_tokens,
                "prefix_messages": placement.prefix_messages,
                "prompt_ids": pack_ids(placement.prompt_suffix),
                "completion_ids": pack_ids(completion),
                "messages": placement.new_messages,
                "status": status,
                "content": content,
                "tool_calls": tool_calls,
                "finish_reason": finish_reason,
            }
        )
        reply = reply_message(content, tool_calls) if status == "ok" else None
        sequence = np.concatenate([prompt, completion])
        completions = with_reply(placement.prompt_completions, prompt.shape[0], sequence.shape[0])
        self.lineage.add(index, messages, sequence, reply, finish_reason, completions)
        self.completions.append(completions)
        return placement


PROMPT_1 = np.concatenate([SEQUENCE_0, TOOL_TURN])  # 21 ids
COMPLETION_1 = ids(60, 61, 2)
MESSAGES_1 = [SYSTEM, USER, REPLY_0, TOOL]
# The parent's sampled 61 is re-tokenized as 99: 2 of its 24 ids drift.
PROMPT_2 = ids(*PROMPT_1, 60, 99, 2, 9, 1, 20, 70, 2, 1, 30)
MESSAGES_2 = [SYSTEM, USER, REPLY_0_ECHOED, TOOL, ANSWER_1, USER_2]
PROMPT_3 = ids(1, 10, 11, 2, 1, 20, 22, 2, 1, 30)
MESSAGES_3 = [SYSTEM, USER_EDITED]
PROMPT_4 = ids(*SEQUENCE_0, 9, 1, 50, 52, 2, 1, 30)
MESSAGES_4 = [SYSTEM, USER, REPLY_0, TOOL_OTHER]


def five_turns() -> tuple[Rollout, list[Placement]]:
    rollout = Rollout()
    placements = [
        rollout.commit(PROMPT_0, COMPLETION_0, [SYSTEM, USER], tool_calls=[CALL], finish_reason="tool_calls"),
        rollout.commit(PROMPT_1, COMPLETION_1, MESSAGES_1, content="a.txt is there."),
        rollout.commit(PROMPT_2, ids(71, 2), MESSAGES_2, content="Nothing."),
        rollout.commit(PROMPT_3, ids(80, 2), MESSAGES_3, content="Empty."),
        rollout.commit(PROMPT_4, ids(81, 2), MESSAGES_4, content="b.txt is there."),
    ]
    return rollout, placements


def test_each_turn_of_a_rollout_is_placed_against_its_reference():
    rollout, placements = five_turns()
    assert [fields(p)[:4] for p in placements] == [
        (None, None, 0, None),
        (0, None, 14, 0),
        (1, None, 22, 2),
        (None, 2, 6, None),  # edits the user message: shares the system message and 6 ids with turn 2
        (0, None, 14, 0),  # extends turn 0, which has left memory: read back by index
    ]
    assert [(p.prefix_messages, p.new_messages) for p in placements] == [
        (0, [SYSTEM, USER]),
        (2, [REPLY_0, TOOL]),
        (2, [REPLY_0_ECHOED, TOOL, ANSWER_1, USER_2]),
        (1, [USER_EDITED]),
        (2, [REPLY_0, TOOL_OTHER]),
    ]
    assert [p.prompt_suffix.tolist() for p in placements][2:] == [
        [99, 2, 9, 1, 20, 70, 2, 1, 30],
        [22, 2, 1, 30],
        [9, 1, 50, 52, 2, 1, 30],
    ]
    assert rollout.loaded == [0]


def test_stored_deltas_rebuild_to_the_full_prompts_and_messages():
    rollout, _ = five_turns()
    full = rebuild(rollout.rows)
    assert sorted(full) == [0, 1, 2, 3, 4]
    assert [full[i].prompt_ids.tolist() for i in range(5)] == [
        p.tolist() for p in (PROMPT_0, PROMPT_1, PROMPT_2, PROMPT_3, PROMPT_4)
    ]
    assert [full[i].messages for i in range(5)] == [
        [SYSTEM, USER],
        MESSAGES_1,
        MESSAGES_2,
        MESSAGES_3,
        MESSAGES_4,
    ]


def test_rows_without_messages_rebuild_prompts_only():
    rollout, _ = five_turns()
    token_rows = [{k: v for k, v in row.items() if k != "messages"} for row in rollout.rows]
    full = rebuild(token_rows)
    assert [full[i].messages for i in range(5)] == [None] * 5
    assert full[2].prompt_ids.tolist() == PROMPT_2.tolist()


def test_reference_of_a_row_is_its_parent_else_its_fork_origin():
    assert reference_of({"parent_turn": 3, "forked_from": None}) == 3
    assert reference_of({"parent_turn": None, "forked_from": 2}) == 2
    assert reference_of({"parent_turn": None}) is None


def test_lineage_rebuilt_from_rows_holds_every_turns_full_sequence():
    rollout, _ = five_turns()
    lineage, nodes = lineage_of(rollout.rows)
    assert sorted(nodes) == [0, 1, 2, 3, 4]
    assert nodes[2].sequence.tolist() == [*PROMPT_2, 71, 2]
    assert (nodes[2].messages, nodes[0].finish_reason) == (MESSAGES_2, "tool_calls")
    assert lineage.last_index == 4
    assert sorted(lineage.nodes) == [3, 4]


# Where the model's replies lie in each turn's ids: its own, and those of its reference the prompt shares.
FIVE_TURNS_COMPLETIONS = [
    ((10, 14),),
    ((10, 14), (21, 24)),
    ((10, 14), (31, 33)),  # its prompt re-tokenizes turn 1's reply: only turn 0's is shared
    ((10, 12),),  # forked after 6 ids: no earlier reply shared
    ((10, 14), (21, 23)),
]


def test_each_turn_knows_where_the_models_replies_lie_in_its_ids():
    rollout, _ = five_turns()
    assert rollout.completions == FIVE_TURNS_COMPLETIONS
    assert [rollout.lineage.nodes[i].completions for i in (3, 4)] == FIVE_TURNS_COMPLETIONS[3:]


def test_replies_rebuilt_from_rows_lie_where_the_live_lineage_put_them():
    rollout, _ = five_turns()
    _, nodes = lineage_of(rollout.rows)
    assert [nodes[i].completions for i in range(5)] == FIVE_TURNS_COMPLETIONS


def test_replies_placed_by_the_splice_override_what_the_prompt_shares():
    prompt = np.concatenate([SEQUENCE_0, TOOL_TURN])
    placement = place(
        lineage_after_turn_0(), prompt, [SYSTEM, USER, REPLY_0, TOOL], no_load, prompt_completions=((3, 5),)
    )
    assert placement.prompt_completions == ((3, 5),)
    assert with_reply(placement.prompt_completions, 21, 24) == ((3, 5), (21, 24))
    assert with_reply(placement.prompt_completions, 21, 21) == ((3, 5),)


def test_lineage_rebuilt_from_rows_places_the_next_turn_as_the_live_one_does():
    rollout, _ = five_turns()
    rebuilt, _ = lineage_of(rollout.rows)
    answer_4 = {"role": "assistant", "content": "b.txt is there."}
    candidates: list[tuple[np.ndarray, list[dict[str, Any]] | None]] = [
        (ids(*PROMPT_4, 81, 2, 9, 1, 20, 90, 2, 1, 30), [*MESSAGES_4, answer_4, USER_2]),  # extends turn 4
        # extends turn 1, which has left memory
        (ids(*PROMPT_1, 60, 61, 2, 9, 1, 20, 91, 2, 1, 30), [*MESSAGES_1, ANSWER_1, USER_2]),
        (ids(1, 10, 11, 2, 1, 20, 22, 2, 1, 30, 7), [SYSTEM, USER_EDITED, USER]),  # forks from turn 3
        (ids(1, 10, 11, 2, 1, 20, 21, 2, 1, 30), [SYSTEM, USER]),  # repeats turn 0: forks from turn 4
    ]
    expected = [
        ((4, None, 23, 0), []),
        ((1, None, 24, 0), [1]),
        ((None, 3, 10, None), []),
        ((None, 4, 10, None), []),
    ]

    def placed(lineage: Lineage, prompt: np.ndarray, messages: Any) -> tuple[tuple[Any, ...], list[int]]:
        loads: list[int] = []

        def load(index: int) -> Node:
            loads.append(index)
            return lineage_of(rollout.rows)[1][index]

        return fields(place(lineage, prompt, messages, load)), loads

    for (prompt, messages), (where, loads) in zip(candidates, expected, strict=True):
        live = placed(rollout.lineage, prompt, messages)
        assert placed(rebuilt, prompt, messages) == live
        assert (live[0][:4], live[1]) == (where, loads)


def test_error_turn_rebuilt_from_rows_is_not_a_parent():
    rollout = Rollout()
    rollout.commit(PROMPT_0, ids(), [SYSTEM, USER], status="error", finish_reason=None)
    rebuilt, _ = lineage_of(rollout.rows)
    prompt = np.concatenate([PROMPT_0, TOOL_TURN])
    # Its request is history the next call shares (a fork), but no reply of it reached the agent.
    assert find_parent(rebuilt, prompt, [SYSTEM, USER, REPLY_0, TOOL], rollout.load) == (None, 0)
