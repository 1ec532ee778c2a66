"""One mapping between a turn and its row of `turns`, derived from the table: the writer fills a row from a
`TurnRecord` and its place in the rollout (`row_of`), and `GET /rollouts/{id}` shows the columns in
`SHOWN`. A new column of the table that a `TurnRecord` field of the same name fills is written and shown
with nothing else to change; `tests/unit/test_turn_rows.py` checks that every column is accounted for."""

from __future__ import annotations

from typing import Any

from gateway.store.lineage import Placement
from gateway.store.records import TurnRecord
from rollout_store.schema import turns
from rollout_store.tokens import pack_ids, pack_logprobs

PLACED = (
    "turn_index",
    "prefix_messages",
    "messages",
    "parent_turn",
    "forked_from",
    "prefix_tokens",
    "drift_tokens",
    "prompt_ids",
    "completion_ids",
    "completion_logprobs",
    "prompt_tokens",
    "completion_tokens",
)
"""What the store computes: the turn's index and place in its lineage (its messages and prompt ids stored as
what its parent's lack), the packed ids and their counts."""
UNWRITTEN = ("turn_id",)
"""The database's key."""
COPIED = tuple(c.name for c in turns.c if c.name not in PLACED + UNWRITTEN)
"""The columns a `TurnRecord` field of the same name fills as it is."""
HIDDEN = (
    "turn_id",
    "rollout_id",
    "turn_index",
    "prefix_messages",
    "messages",
    "prompt_text",
    "tools",
    "params",
    "request",
    "request_hash",
    "prompt_ids",
    "completion_ids",
    "completion_logprobs",
)
"""What the rollout's view leaves out or shows its own way: keys, the request (only with
`include_messages`), and the ids (whole, only with `include_tokens`)."""
SHOWN = tuple(c.name for c in turns.c if c.name not in HIDDEN)
"""A turn's columns as `GET /rollouts/{id}` shows them."""


def row_of(record: TurnRecord, index: int, placement: Placement) -> dict[str, Any]:
    """The row of `turns` that stores `record` as the rollout's turn `index`, placed in its lineage."""
    return {
        **{name: getattr(record, name) for name in COPIED},
        "turn_index": index,
        "prefix_messages": placement.prefix_messages,
        "messages": placement.new_messages,
        "parent_turn": placement.parent_turn,
        "forked_from": placement.forked_from,
        "prefix_tokens": placement.prefix_tokens,
        "drift_tokens": placement.drift_tokens,
        "prompt_ids": pack_ids(placement.prompt_suffix),
        "completion_ids": pack_ids(record.completion_ids),
        "completion_logprobs": pack_logprobs(record.completion_logprobs),
        "prompt_tokens": int(record.prompt_ids.shape[0]),
        "completion_tokens": int(record.completion_ids.shape[0]),
    }
