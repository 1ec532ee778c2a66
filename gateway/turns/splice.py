"""The splice rule of exact mode: the prompt of a turn that extends an earlier one.

Given the parent's exact ids S (its prompt + completion, as the engine saw and sampled them), the plain render
A of the parent's history + reply (no generation prompt), and the plain render B of the new request:

1. The parent's reply must have ended with an end-of-turn token e = S[-1] (`finish_reason` stop or
   tool_calls); a reply cut by `max_tokens` has no closing the model produced, so it is not spliced.
2. The template's closing C is what A renders after its last e (for ChatML, the newline after `<|im_end|>`):
   tokens the template adds and the model never generated. They are the environment's (loss mask 0).
3. If A holds e k times, the reply ends at B's k-th e. B must show the same closing C there; what follows is
   the rendering of the new messages (tool results, user turns, the generation prompt), N.
4. The prompt is S + C + N: the parent's exact ids, untouched, whatever the template does to earlier turns
   (stripping `<think>` blocks, re-tokenizing tool calls).

The rule needs no per-model table: it only assumes that the template closes every message with the same
end-of-turn token the model emits, and renders one closing per message. Where that does not hold, the turn
falls back to the plain render B and says why.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

END_OF_TURN_REASONS = ("stop", "tool_calls")


@dataclass(frozen=True)
class Spliced:
    prompt_ids: np.ndarray
    how: str
    """"exact", or "fallback: <why>" (the plain render was used)."""


def splice(
    parent_ids: np.ndarray, finish_reason: str | None, parent_render: np.ndarray, plain: np.ndarray
) -> Spliced:
    if finish_reason not in END_OF_TURN_REASONS or parent_ids.shape[0] == 0:
        return Spliced(plain, f"fallback: parent reply ended with finish_reason={finish_reason}")
    end = parent_ids[-1]
    in_parent = np.flatnonzero(parent_render == end)
    if in_parent.shape[0] == 0:
        return Spliced(plain, f"fallback: the template does not render the end-of-turn token {int(end)}")
    closing = parent_render[in_parent[-1] + 1 :]
    in_plain = np.flatnonzero(plain == end)
    if in_plain.shape[0] < in_parent.shape[0]:
        return Spliced(plain, "fallback: the new render closes fewer messages than the parent's history has")
    start = in_plain[in_parent.shape[0] - 1] + 1
    if not np.array_equal(plain[start : start + closing.shape[0]], closing):
        return Spliced(plain, "fallback: the new render closes the parent's reply differently")
    new = plain[start + closing.shape[0] :]
    return Spliced(np.concatenate([parent_ids, closing, new]).astype(parent_ids.dtype), "exact")
