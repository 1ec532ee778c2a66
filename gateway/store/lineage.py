"""Lineage of a rollout's turns (the writer's side): where a new turn sits and what of it is stored.

**Parent.** A chat turn's parent is the latest earlier turn whose request messages followed by its reply are
a prefix of this turn's messages: the harness sent back that turn's history and answer, plus what is new.
Messages are compared in a canonical form (role, content, tool names and arguments, tool-result content;
ids and reasoning ignored, since harnesses often rewrite ids and drop reasoning when they echo a reply).
A completions turn's parent is the latest earlier turn whose prompt + completion ids are a prefix of its
prompt: the lineage keeps every turn's id count and digest, and the new prompt's prefixes are hashed in one
pass at every candidate length, so that every earlier turn is a candidate without holding its ids. A turn
with no parent whose history shares a beginning with an earlier turn was *forked* from the one sharing the
most (the harness edited, summarised or truncated its history); for a completions turn this is best effort,
among the turns whose ids are still in memory (the latest ones).

**Drift.** `prefix_tokens` is how many leading ids the turn's prompt shares with its parent's (or fork
origin's) prompt + completion; for a turn with a parent, `drift_tokens` is how many of the parent's exact ids
the prompt does not reproduce (0: the turn extends its parent exactly, token for token).

**Completions.** Each node knows where the model's own completions lie in its ids (`Span`s): its reply, and
those of its prompt: given by exact mode's splice, else inherited from its reference turn as far as the
prompt shares that turn's ids. Exact mode keeps them as sampled when it splices the next turn. A lineage read
back from the database (after a restart, or once evicted from memory) knows only the inherited ones: the
replies a re-rendered prompt put back are then compared as context.

**Delta storage.** `place` gives the new turn's reference turn (parent, else fork origin) and its delta
against it; `delta.rebuild` restores full prompts and messages. Storage grows linearly with a rollout's
length, not with its square. This module is the writer's: readers need only `delta`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import orjson

from rollout_store.delta import Messages, rebuild, reference_of
from rollout_store.tokens import ID_DTYPE, common_prefix_len, unpack_ids

Span = tuple[int, int]
"""[start, end) of a model completion within a turn's ids."""

_RECENT_SEQUENCES = 2  # turns kept whole in memory; older ones are read back on demand


def canonical_message(message: Mapping[str, Any]) -> bytes:
    content = message.get("content")
    calls = [
        (call.get("function") or {}).get("name", "")
        + "\0"
        + _canonical_arguments((call.get("function") or {}).get("arguments"))
        for call in message.get("tool_calls") or ()
    ]
    return orjson.dumps(
        [message.get("role"), content if content not in ("", None) else None, calls, message.get("name")]
    )


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return cast(str, arguments)
    return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()


def history_hashes(messages: Messages) -> list[bytes]:
    """h[k] identifies messages[:k + 1], in canonical form."""
    hashes, current = [], b""
    for message in messages:
        current = _extended(current, message)
        hashes.append(current)
    return hashes


def _extended(digest: bytes, message: Mapping[str, Any]) -> bytes:
    """The hash of a history (`digest`, b"" for none) followed by `message`."""
    return hashlib.blake2b(digest + canonical_message(message), digest_size=16).digest()


def reply_message(content: str | None, tool_calls: list[Any] | None) -> dict[str, Any]:
    """The assistant message a harness sends back for a reply."""
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


@dataclass(slots=True)
class Node:
    index: int
    messages: Messages | None
    sequence: np.ndarray  # prompt + completion ids
    finish_reason: str | None = None
    completions: tuple[Span, ...] = ()


def ids_digest(ids: np.ndarray) -> bytes:
    """A digest of token ids, the same whatever their integer type."""
    return _hashed(hashlib.blake2b(digest_size=16), ids).digest()


def _hashed(running: hashlib.blake2b, ids: np.ndarray) -> hashlib.blake2b:
    """`running` updated with `ids` as little-endian int32."""
    running.update(np.ascontiguousarray(ids, dtype=ID_DTYPE).data)
    return running


def prefix_digests(ids: np.ndarray, lengths: Iterable[int]) -> dict[int, bytes]:
    """`ids_digest(ids[:n])` for each length n, hashing `ids` once up to the longest."""
    digests: dict[int, bytes] = {}
    running, done = hashlib.blake2b(digest_size=16), 0
    for n in sorted(set(lengths)):
        _hashed(running, ids[done:n])
        digests[n], done = running.copy().digest(), n
    return digests


@dataclass
class Lineage:
    """What the writer keeps of one rollout to place its next turn.

    Its size grows with the rollout by a few bytes a turn: whole nodes (ids and messages) are kept for the
    latest turns only, older ones are read back from the database on demand. Every long-lived object here is
    one the garbage collector need not scan (tuples, bytes and ints) but for those few nodes, so that a
    gateway holding many rollouts does not pause for its collections.
    """

    last_index: int = -1
    nodes: dict[int, Node] = field(default_factory=dict)
    """The latest `_RECENT_SEQUENCES` turns that have ids, whole."""
    ids: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    """Every turn that has ids: their count and `ids_digest` (how a completions turn finds its parent)."""
    extends: dict[bytes, int] = field(default_factory=dict)  # hash(messages + reply) of an ok turn -> turn
    prefixes: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # hash(messages[:k]) -> (turn, k)

    @property
    def tokens(self) -> int:
        return sum(n.sequence.shape[0] for n in self.nodes.values())

    def add(
        self,
        index: int,
        messages: Messages | None,
        sequence: np.ndarray | None,
        reply: dict[str, Any] | None,
        finish_reason: str | None = None,
        completions: tuple[Span, ...] = (),
        hashes: list[bytes] | None = None,
    ) -> None:
        """Register a committed turn; `reply` only for turns whose answer reached the agent whole. `hashes`:
        the messages' `history_hashes` if already computed (placing the turn did), not computed again."""
        self.last_index = max(self.last_index, index)
        if sequence is None or sequence.shape[0] == 0:
            return
        self.nodes[index] = Node(index, messages, sequence, finish_reason, completions)
        self.ids[index] = (int(sequence.shape[0]), ids_digest(sequence))
        while len(self.nodes) > _RECENT_SEQUENCES:
            del self.nodes[min(self.nodes)]
        if messages:
            if hashes is None:
                hashes = history_hashes(messages)
            for k, digest in enumerate(hashes, start=1):
                self.prefixes[digest] = (index, k)
            if reply is not None:
                self.extends[_extended(hashes[-1], reply)] = index


@dataclass
class Placement:
    """Where a new turn sits in its rollout, and what of it is stored."""

    parent_turn: int | None
    forked_from: int | None
    prefix_tokens: int
    drift_tokens: int | None
    prompt_suffix: np.ndarray
    prefix_messages: int
    new_messages: Messages | None
    prompt_completions: tuple[Span, ...] = ()
    """Where the model's earlier completions lie in the prompt."""
    hashes: list[bytes] | None = None
    """The request messages' `history_hashes`, computed to find the parent: `Lineage.add` reuses them."""


def with_reply(prompt_completions: tuple[Span, ...], prompt_tokens: int, tokens: int) -> tuple[Span, ...]:
    """The model's completions in a turn's whole ids: those of its prompt, then its own reply."""
    return prompt_completions if tokens == prompt_tokens else (*prompt_completions, (prompt_tokens, tokens))


def shared_completions(reference: Node | None, prefix_tokens: int) -> tuple[Span, ...]:
    """The reference turn's completions that lie within the ids a new prompt shares with it."""
    return tuple(s for s in (reference.completions if reference else ()) if s[1] <= prefix_tokens)


def place(
    lineage: Lineage,
    prompt_ids: np.ndarray,
    messages: Messages | None,
    load: Callable[[int], Node],
    *,
    plain_prompt_ids: np.ndarray | None = None,
    prompt_completions: tuple[Span, ...] | None = None,
) -> Placement:
    """Find the new turn's parent (or fork origin) and its delta against it.

    `load(index)` returns a node with its full sequence and messages, from the database if need be. In exact
    mode the prompt extends the parent by construction; `plain_prompt_ids` (the plain render of the same
    messages) then measures the drift that splicing avoided, and `prompt_completions` (from the splice) says
    where the model's earlier completions lie in the prompt.
    """
    hashes = history_hashes(messages) if messages else None
    parent, forked = find_parent(lineage, prompt_ids, messages, load, hashes)
    reference = parent if parent is not None else forked
    if reference is None or prompt_ids.shape[0] == 0:
        return Placement(None, None, 0, None, prompt_ids, 0, messages, prompt_completions or (), hashes)
    node = _full(lineage, reference, load)
    prefix = common_prefix_len(prompt_ids, node.sequence)
    shared = _equal_prefix(messages, node.messages)
    drift = None
    if parent is not None:
        measured = prefix if plain_prompt_ids is None else common_prefix_len(plain_prompt_ids, node.sequence)
        drift = int(node.sequence.shape[0]) - measured
    new_messages = messages[shared:] if messages is not None else None
    if prompt_completions is None:
        prompt_completions = shared_completions(node, prefix)
    return Placement(
        parent, forked, prefix, drift, prompt_ids[prefix:], shared, new_messages, prompt_completions, hashes
    )


def find_parent(
    lineage: Lineage,
    prompt_ids: np.ndarray,
    messages: Messages | None,
    load: Callable[[int], Node],
    hashes: list[bytes] | None = None,
) -> tuple[int | None, int | None]:
    """(parent, None) when the turn extends an earlier one, else (None, fork origin or None); `hashes`: the
    messages' `history_hashes`, if already computed."""
    if messages:
        if hashes is None:
            hashes = history_hashes(messages)
        for digest in reversed(hashes):
            if digest in lineage.extends:
                return lineage.extends[digest], None
        for digest in reversed(hashes):
            if digest in lineage.prefixes:
                return None, lineage.prefixes[digest][0]
        return None, None
    parent = _extended_ids(lineage, prompt_ids)
    if parent is not None:
        return parent, None
    best, best_len = None, 0
    for node in sorted(lineage.nodes.values(), key=lambda n: n.index, reverse=True):
        shared = common_prefix_len(prompt_ids, node.sequence)
        if shared > best_len:
            best, best_len = node.index, shared
    return None, best


def _extended_ids(lineage: Lineage, prompt_ids: np.ndarray) -> int | None:
    """The latest turn whose ids are a prefix of `prompt_ids`, found by digests (its ids may have left
    memory)."""
    size = prompt_ids.shape[0]
    candidates = {index: known for index, known in lineage.ids.items() if known[0] <= size}
    digests = prefix_digests(prompt_ids, (length for length, _ in candidates.values()))
    return max((i for i, (length, digest) in candidates.items() if digests[length] == digest), default=None)


def _full(lineage: Lineage, index: int, load: Callable[[int], Node]) -> Node:
    return lineage.nodes.get(index) or load(index)


def _equal_prefix(a: Messages | None, b: Messages | None) -> int:
    n = 0
    for left, right in zip(a or (), b or (), strict=False):
        if left != right:
            break
        n += 1
    return n


def lineage_of(rows: Sequence[Mapping[Any, Any]]) -> tuple[Lineage, dict[int, Node]]:
    """A rollout's lineage rebuilt from all its rows, and every node with its full sequence."""
    full = rebuild(rows)
    lineage = Lineage()
    nodes: dict[int, Node] = {}
    for row in rows:
        index = row["turn_index"]
        prompt = full[index].prompt_ids
        sequence = np.concatenate([prompt, unpack_ids(row["completion_ids"])])
        reference = reference_of(row)
        shared = shared_completions(
            nodes.get(reference) if reference is not None else None, row["prefix_tokens"]
        )
        completions = with_reply(shared, prompt.shape[0], sequence.shape[0])
        ok = row["status"] == "ok"
        reply = reply_message(row["content"], row["tool_calls"]) if ok else None
        lineage.add(index, full[index].messages, sequence, reply, row["finish_reason"], completions)
        nodes[index] = Node(index, full[index].messages, sequence, row["finish_reason"], completions)
    return lineage, nodes
