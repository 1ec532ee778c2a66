"""Delta storage of turns: what a turn shares with its parent is stored once, in the parent.

A turn's parent is the latest earlier turn of its rollout that has tokens. The turn stores the length of the
prefix its prompt shares with the parent's prompt + completion ids, and only the ids after it; likewise
for the request messages. `rebuild` turns those rows back into full prompts and message lists.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.store.tokens import common_prefix_len, unpack_ids


@dataclass
class ChainTip:
    """The latest turn of a rollout that has tokens: what the next turn is stored against."""

    turn_index: int
    sequence: np.ndarray
    messages: list[dict[str, Any]] | None

    @property
    def tokens(self) -> int:
        return int(self.sequence.shape[0])


@dataclass
class Delta:
    parent_turn: int | None
    prefix_tokens: int
    prompt_suffix: np.ndarray
    prefix_messages: int
    new_messages: list[dict[str, Any]] | None


def common_message_prefix(a: list[dict[str, Any]] | None, b: list[dict[str, Any]] | None) -> int:
    if not a or not b:
        return 0
    n = 0
    for left, right in zip(a, b):
        if left != right:
            break
        n += 1
    return n


def delta_against(tip: ChainTip | None, prompt_ids: np.ndarray, messages: list[dict[str, Any]] | None) -> Delta:
    if tip is None or prompt_ids.shape[0] == 0:
        return Delta(None, 0, prompt_ids, 0, messages)
    prefix = common_prefix_len(prompt_ids, tip.sequence)
    shared = common_message_prefix(messages, tip.messages)
    new_messages = messages[shared:] if messages is not None else None
    return Delta(tip.turn_index, prefix, prompt_ids[prefix:], shared, new_messages)


@dataclass
class FullTurn:
    prompt_ids: np.ndarray
    messages: list[dict[str, Any]] | None


def rebuild(rows: Iterable[Mapping[str, Any]]) -> dict[int, FullTurn]:
    """Full prompts and messages of a rollout's turns, from rows in ascending `turn_index` order.

    Rows without a `messages` column (token-only reads) give `messages=None`.
    """
    full: dict[int, FullTurn] = {}
    sequences: dict[int, np.ndarray] = {}
    for row in rows:
        suffix = unpack_ids(row["prompt_ids"])
        messages = row.get("messages")
        parent = row["parent_turn"]
        if parent is not None and parent in full:
            prompt = np.concatenate([sequences[parent][: row["prefix_tokens"]], suffix])
            if messages is not None:
                parent_messages = full[parent].messages or []
                messages = parent_messages[: row["prefix_messages"]] + list(messages)
        else:
            prompt = suffix
        index = row["turn_index"]
        full[index] = FullTurn(prompt, messages)
        sequences[index] = np.concatenate([prompt, unpack_ids(row["completion_ids"])])
    return full


def tip_of(rows: list[Mapping[str, Any]]) -> ChainTip | None:
    """The chain tip of a rollout, rebuilt from all its rows (after a restart or another replica's writes)."""
    full = rebuild(rows)
    for row in reversed(rows):
        if row["prompt_tokens"]:
            turn = full[row["turn_index"]]
            sequence = np.concatenate([turn.prompt_ids, unpack_ids(row["completion_ids"])])
            return ChainTip(row["turn_index"], sequence, turn.messages)
    return None
