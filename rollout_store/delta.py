"""Delta storage, the read side: how a stored turn's full prompt and messages are rebuilt.

A turn stores only the prompt ids after `prefix_tokens` and the messages after `prefix_messages`; the rest
lives in its reference turn (`parent_turn`, else `forked_from`). `rebuild` restores full prompts and message
lists from a rollout's rows. With `schema` (the tables) and `tokens` (the packed-id format) this is the read
contract the gateway's reads, `trainer_client` and the SQL docs share; the writer's side is `lineage`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_store.tokens import unpack_ids

Messages = list[dict[str, Any]]


@dataclass
class FullTurn:
    prompt_ids: np.ndarray
    messages: Messages | None


def reference_of(row: Mapping[str, Any]) -> int | None:
    """The turn a stored row's delta is taken against."""
    parent = row["parent_turn"]
    return parent if parent is not None else row.get("forked_from")


def rebuild(rows: Iterable[Mapping[Any, Any]]) -> dict[int, FullTurn]:
    """Full prompts and messages of a rollout's turns, from rows in ascending `turn_index` order.

    Rows without a `messages` column (token-only reads) give `messages=None`.
    """
    full: dict[int, FullTurn] = {}
    sequences: dict[int, np.ndarray] = {}
    for row in rows:
        suffix = unpack_ids(row["prompt_ids"])
        messages = row.get("messages")
        reference = reference_of(row)
        if reference is not None and reference in full:
            prompt = np.concatenate([sequences[reference][: row["prefix_tokens"]], suffix])
            if messages is not None:
                messages = (full[reference].messages or [])[: row["prefix_messages"]] + list(messages)
        else:
            prompt = suffix
        index = row["turn_index"]
        full[index] = FullTurn(prompt, messages)
        sequences[index] = np.concatenate([prompt, unpack_ids(row["completion_ids"])])
    return full
