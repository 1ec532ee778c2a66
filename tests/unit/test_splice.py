"""The splice rule on hand-made token sequences.

ChatML-like ids: 1 = <|im_start|>, 2 = <|im_end|>, 9 = newline.
"""

from __future__ import annotations

import numpy as np

from gateway.turns.splice import splice

ids = lambda *values: np.array(values, dtype=np.int32)  # noqa: E731

# Parent prompt: <s>user 5<e>\n<s>assistant ; the model sampled 7 8 (a tokenization the template never
# produces) + <e>.
PARENT = ids(1, 50, 5, 2, 9, 1, 60, 7, 8, 2)
# Plain render of the parent's history + reply: the reply re-tokenized as 78, closed by <e> and a newline.
PARENT_RENDER = ids(1, 50, 5, 2, 9, 1, 60, 78, 2, 9)
# Plain render of the new request: history as above, then a tool turn and the generation prompt.
PLAIN = ids(1, 50, 5, 2, 9, 1, 60, 78, 2, 9, 1, 70, 4, 2, 9, 1, 60)


def test_prompt_is_the_parents_exact_ids_then_the_closing_then_the_new_messages():
    result = splice(PARENT, "stop", PARENT_RENDER, PLAIN)
    assert result.how == "exact"
    assert result.prompt_ids.tolist() == [*PARENT.tolist(), 9, 1, 70, 4, 2, 9, 1, 60]


def test_history_rewritten_by_the_template_does_not_matter():
    # A think-stripping template renders the old reply shorter in the new request (78 -> 8).
    plain = ids(1, 50, 5, 2, 9, 1, 60, 8, 2, 9, 1, 70, 4, 2, 9, 1, 60)
    result = splice(PARENT, "tool_calls", PARENT_RENDER, plain)
    assert result.prompt_ids.tolist() == [*PARENT.tolist(), 9, 1, 70, 4, 2, 9, 1, 60]


def test_reply_cut_by_max_tokens_falls_back_to_the_plain_render():
    result = splice(PARENT[:-1], "length", PARENT_RENDER, PLAIN)
    assert (result.how, result.prompt_ids.tolist()) == (
        "fallback: parent reply ended with finish_reason=length",
        PLAIN.tolist(),
    )


def test_template_without_the_end_token_falls_back():
    result = splice(PARENT, "stop", ids(1, 50, 5, 3, 1, 60, 78, 3), ids(1, 50, 5, 3, 1, 60, 78, 3, 1, 60))
    assert result.how == "fallback: the template does not render the end-of-turn token 2"


def test_new_render_that_closes_the_reply_differently_falls_back():
    plain = ids(1, 50, 5, 2, 9, 1, 60, 78, 2, 1, 70, 4, 2, 9, 1, 60)  # no newline after the reply
    assert (
        splice(PARENT, "stop", PARENT_RENDER, plain).how
        == "fallback: the new render closes the parent's reply differently"
    )


def test_new_render_with_fewer_closings_falls_back():
    plain = ids(1, 50, 5, 2, 9, 1, 60)
    assert splice(PARENT, "stop", PARENT_RENDER, plain).how.startswith(
        "fallback: the new render closes fewer"
    )
