"""The splice rule of exact mode: the prompt of a turn that extends an earlier one.

**The rule.** The prompt of an extending turn holds the model's earlier completions as the exact ids it
sampled, and is otherwise what the template renders now.

Given the parent's exact ids S (its prompt + completion, as the engine saw and sampled them), where the
model's completions lie in S, and the plain render B of the new request:

1. The parent's reply ends with an end-of-turn token e = S[-1] (`finish_reason` stop or tool_calls). A
   reply cut by `max_tokens` has no closing the model produced: the one the template gives it is used
   instead (the token the new render puts right after the reply, found by rendering the history up to the
   reply left open), and the rule holds with S closed by it; that closing is the template's, not a
   completion. (A reply cut right after the model sampled that token ended after all.)
2. S and B are cut into turns after each e. S holds e k times; B must hold it at least k times, its k-th e
   closing the parent's reply. What B renders after it (the closing the template adds, tool results, user
   turns, the generation prompt) is new: N.
3. Each of S's k turns is compared with B's: outside the model's completions they must be equal; a
   completion may be rendered differently (templates strip `<think>` blocks, re-serialize tool calls) and
   keeps its exact ids. When all agree the prompt is S + N: the parent's ids, untouched ("exact").
4. Where a template renders content outside the completions differently now (it moves the tool list and
   system prompt to the latest user message, or rewrites an earlier message), the two halves of the rule
   conflict. The policy: the template wins outside the completions, the completions keep their ids. The
   prompt is B with each earlier completion put back as sampled (found after the template's own text
   before it), no longer an extension of the parent; the turn records `RE_RENDERED`.

The rule needs no per-model table: it only assumes that the model ends a reply with the end-of-turn token
the template closes messages with. Where that does not hold, the turn falls back to the plain render B and
says why.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.store.lineage import Span

END_OF_TURN_REASONS = ("stop", "tool_calls")
RE_RENDERED = (
    "re-rendered: the template changed the context of earlier turns; the model's replies kept as sampled"
)


@dataclass(frozen=True)
class Spliced:
    prompt_ids: np.ndarray
    how: str
    """"exact", `RE_RENDERED`, or "fallback: <why>" (the plain render was used)."""
    completions: tuple[Span, ...] | None
    """Where the model's earlier completions lie in the prompt, as [start, end) spans (None for the plain
    render: as far as it shares the parent's ids)."""


def splice(
    parent_ids: np.ndarray,
    completions: tuple[Span, ...],
    finish_reason: str | None,
    plain: np.ndarray,
    closing: int | None = None,
) -> Spliced:
    """The prompt of a turn extending a parent whose exact ids are `parent_ids`, with the model's completions
    at `completions` (the parent's own reply last); `closing`: for a reply that did not end a turn, the token
    the template closes it with, if known."""
    if parent_ids.shape[0] == 0:
        return Spliced(plain, "fallback: the parent turn has no ids", None)
    ended = finish_reason in END_OF_TURN_REASONS or closing == parent_ids[-1]  # it sampled its closing
    if not ended:
        if closing is None:
            return Spliced(plain, f"fallback: parent reply ended with finish_reason={finish_reason}", None)
        parent_ids = np.append(parent_ids, np.asarray(closing, dtype=parent_ids.dtype))
    end = parent_ids[-1]
    closes = np.flatnonzero(parent_ids == end) + 1
    k = closes.shape[0]
    new_closes = np.flatnonzero(plain == end) + 1
    if new_closes.shape[0] < k:
        return Spliced(plain, "fallback: the new render closes fewer turns than the parent's ids hold", None)
    # Each completion by where its turn closes: at its own last token, or at the template's closing of a cut
    # reply right after it.
    by_close = {
        (stop if parent_ids[stop - 1] == end else stop + 1): (start, stop) for start, stop in completions
    }
    opens = np.concatenate([[0], closes[:-1]])
    new_opens = np.concatenate([[0], new_closes[: k - 1]])
    pieces: list[np.ndarray] = []
    spans: list[Span] = []
    changed = False
    length = 0
    for lo, hi, new_lo, new_hi in zip(opens, closes, new_opens, new_closes[:k], strict=True):
        ours, theirs = parent_ids[lo:hi], plain[new_lo:new_hi]
        start, stop = by_close.get(int(hi), (-1, -1))
        if start < lo:  # no completion ends this turn: it must render as it did
            piece = ours if np.array_equal(ours, theirs) else theirs
        else:  # the template's text before the completion must render as it did; the completion is kept
            context = parent_ids[lo:start]
            at = context.shape[0] if np.array_equal(theirs[: context.shape[0]], context) else None
            if at is None:
                at = _after_context(theirs, context)
                if at is None:
                    return Spliced(
                        plain, "fallback: the new render has no place for the model's earlier reply", None
                    )
            piece = np.concatenate([theirs[:at], parent_ids[start:hi]])
            spans.append((length + at, length + at + stop - start))
        changed = changed or not np.array_equal(piece, ours)
        pieces.append(piece)
        length += piece.shape[0]
    pieces.append(plain[new_closes[k - 1] :])
    prompt = np.concatenate(pieces).astype(parent_ids.dtype)
    return Spliced(prompt, RE_RENDERED if changed else "exact", tuple(spans))


def _after_context(turn: np.ndarray, context: np.ndarray) -> int | None:
    """Where a completion starts in a newly rendered turn: right after the longest tail of what the template
    put before it in the parent's ids (its assistant header, say), at its first occurrence."""
    ends = np.flatnonzero(turn == context[-1]) + 1
    size = 1
    while ends.shape[0] and size < context.shape[0]:
        longer = ends[ends > size]
        longer = longer[turn[longer - size - 1] == context[-size - 1]]
        if not longer.shape[0]:
            break
        ends, size = longer, size + 1
    return int(ends[0]) if ends.shape[0] else None
