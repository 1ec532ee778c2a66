"""The one mapping between a turn and its row (`gateway.store.turn_rows`): every column of `turns` is filled
by a `TurnRecord` field of its name, computed by the store, or never written; the rollout's view shows the
columns its documented model declares."""

from __future__ import annotations

import dataclasses

import numpy as np

from gateway.control.protocol import TurnView
from gateway.store.lineage import Placement
from gateway.store.records import TurnRecord
from gateway.store.turn_rows import COPIED, PLACED, SHOWN, UNWRITTEN, row_of
from rollout_store.schema import turns
from rollout_store.tokens import unpack_ids, unpack_logprobs

VIEW_ONLY = {"index", "latency_s", "prompt_token_ids", "completion_token_ids", "completion_logprobs"}
"""What the view makes of the row: the turn's index, its latency and the whole ids."""
ON_REQUEST = {"messages", "prompt_text", "tools", "params", "request"}
"""What the view shows with `include_messages` only."""


def test_every_column_is_copied_from_the_record_computed_by_the_store_or_never_written():
    fields = {field.name for field in dataclasses.fields(TurnRecord)}

    assert set(COPIED) <= fields
    assert sorted(COPIED + PLACED + UNWRITTEN) == sorted(c.name for c in turns.c)


def test_the_view_shows_what_its_documented_model_declares():
    assert set(SHOWN) == set(TurnView.model_fields) - VIEW_ONLY - ON_REQUEST


def test_a_records_row_holds_every_written_column_with_the_ids_packed():
    record = TurnRecord(
        rollout_id="r",
        endpoint="chat",
        model="tiny",
        stream=False,
        policy_version="3",
        started_at=1.0,
        content="hi",
        prompt_ids=np.array([5, 6, 7], dtype=np.int32),
        completion_ids=np.array([8, 9], dtype=np.int32),
        completion_logprobs=np.array([-0.5, -0.25], dtype=np.float32),
        finished_at=2.0,
    )
    placement = Placement(
        parent_turn=0,
        forked_from=None,
        prefix_tokens=2,
        drift_tokens=0,
        prompt_suffix=np.array([7], dtype=np.int32),
        prefix_messages=1,
        new_messages=[{"role": "user", "content": "again"}],
    )

    row = row_of(record, 1, placement)

    assert set(row) == {c.name for c in turns.c} - set(UNWRITTEN)
    assert (row["turn_index"], row["parent_turn"], row["prefix_tokens"], row["content"]) == (1, 0, 2, "hi")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 2)
    assert unpack_ids(row["prompt_ids"]).tolist() == [7]
    assert unpack_ids(row["completion_ids"]).tolist() == [8, 9]
    assert unpack_logprobs(row["completion_logprobs"]).tolist() == [-0.5, -0.25]
