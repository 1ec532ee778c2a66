"""The splice rule on hand-made token sequences.

ChatML-like ids: 1 = <|im_start|>, 2 = <|im_end|> (the end-of-turn token), 9 = newline, 60 = "assistant\n".
"""

from __future__ import annotations

import numpy as np

from gateway.turns.splice import RE_RENDERED, splice

ids = lambda *values: np.array(values, dtype=np.int32)  # noqa: E731

# Parent prompt: <s>user 5<e>\n<s>assistant ; the model sampled 7 8 (a tokenization the template never
# produces) + <e>.
PARENT = ids(1, 50, 5, 2, 9, 1, 60, 7, 8, 2)
REPLY = ((7, 10),)
# Plain render of the new request: the reply re-tokenized as 78, then a tool turn and the generation prompt.
PLAIN = ids(1, 50, 5, 2, 9, 1, 60, 78, 2, 9, 1, 70, 4, 2, 9, 1, 60)
NEW = [9, 1, 70, 4, 2, 9, 1, 60]


def test_prompt_is_the_parents_exact_ids_then_what_the_new_render_adds_after_the_reply():
    result = splice(PARENT, REPLY, "stop", PLAIN)
    assert (result.how, result.prompt_ids.tolist()) == ("exact", [*PARENT.tolist(), *NEW])
    assert result.completions == ((7, 10),)


def test_history_rewritten_by_the_template_inside_the_models_reply_does_not_matter():
    # A think-stripping template renders the old reply shorter in the new request (78 -> 8).
    plain = ids(1, 50, 5, 2, 9, 1, 60, 8, 2, 9, 1, 70, 4, 2, 9, 1, 60)
    result = splice(PARENT, REPLY, "tool_calls", plain)
    assert (result.how, result.prompt_ids.tolist()) == ("exact", [*PARENT.tolist(), *NEW])


def test_what_follows_the_end_token_is_taken_from_the_new_render_wherever_the_reply_stands():
    # DeepSeek-style: a conversation ending with the reply renders a newline after it, but the tool
    # outputs follow the reply directly in the middle of one (no 9 after the 2).
    plain = ids(1, 50, 5, 2, 9, 1, 60, 78, 2, 80, 70, 4, 81, 1, 60)
    result = splice(PARENT, REPLY, "stop", plain)
    assert (result.how, result.prompt_ids.tolist()) == ("exact", [*PARENT.tolist(), 80, 70, 4, 81, 1, 60])


def test_every_earlier_reply_keeps_its_ids_across_several_turns():
    # Two replies by the model (7 8 and 6), the first re-rendered 78 and the second 66 by the new render.
    parent = ids(1, 50, 5, 2, 9, 1, 60, 7, 8, 2, 9, 1, 70, 4, 2, 9, 1, 60, 6, 2)
    plain = ids(1, 50, 5, 2, 9, 1, 60, 78, 2, 9, 1, 70, 4, 2, 9, 1, 60, 66, 2, 9, 1, 50, 3, 2, 9, 1, 60)
    result = splice(parent, ((7, 10), (18, 20)), "stop", plain)
    assert (result.how, result.prompt_ids.tolist()) == ("exact", [*parent.tolist(), 9, 1, 50, 3, 2, 9, 1, 60])
    assert result.completions == ((7, 10), (18, 20))


def test_context_the_template_moves_is_re_rendered_and_the_models_replies_keep_their_ids():
    # Mistral-style: the tool list (40 41) is rendered before the latest user message only. The parent's
    # prompt had it before the first one; the new render moves it before the new user message.
    parent = ids(1, 40, 41, 50, 5, 60, 7, 8, 2)
    plain = ids(1, 50, 5, 60, 78, 2, 40, 41, 50, 3, 60)
    result = splice(parent, ((6, 9),), "stop", plain)
    assert result.prompt_ids.tolist() == [1, 50, 5, 60, 7, 8, 2, 40, 41, 50, 3, 60]
    assert result.completions == ((4, 7),)
    assert result.how == RE_RENDERED


def test_an_environment_turn_rendered_differently_is_taken_from_the_new_render():
    # The user turn (no completion in it) reads 5 in the parent's ids and 6 now.
    parent = ids(1, 50, 5, 2, 9, 1, 60, 7, 8, 2)
    plain = ids(1, 50, 6, 2, 9, 1, 60, 78, 2, 9, 1, 60)
    result = splice(parent, ((7, 10),), "stop", plain)
    assert result.prompt_ids.tolist() == [1, 50, 6, 2, 9, 1, 60, 7, 8, 2, 9, 1, 60]
    assert (result.how, result.completions) == (RE_RENDERED, ((7, 10),))


def test_reply_cut_by_max_tokens_is_closed_by_the_templates_end_token_which_is_not_a_completion():
    result = splice(PARENT[:-1], ((7, 9),), "length", PLAIN, closing=2)
    assert (result.how, result.prompt_ids.tolist()) == ("exact", [*PARENT.tolist(), *NEW])
    assert result.completions == ((7, 9),)


def test_cut_reply_within_a_longer_history_keeps_every_earlier_completion_and_closes_the_last():
    # A first reply (7 8 <e>) that ended the model's turn, a tool result, then a reply cut after 3 4.
    parent = ids(1, 60, 7, 8, 2, 9, 1, 70, 4, 2, 9, 1, 60, 3, 4)
    plain = ids(1, 60, 78, 2, 9, 1, 70, 4, 2, 9, 1, 60, 34, 2, 9, 1, 50, 6, 2, 9, 1, 60)
    result = splice(parent, ((2, 5), (13, 15)), "length", plain, closing=2)
    assert result.prompt_ids.tolist() == [*parent.tolist(), 2, 9, 1, 50, 6, 2, 9, 1, 60]
    assert (result.how, result.completions) == ("exact", ((2, 5), (13, 15)))


def test_a_cut_reply_earlier_in_the_history_keeps_its_ids_before_the_templates_closing():
    # The first reply (7 8) was cut and closed by the template's <e>; the parent's own reply 3 4 <e> ended.
    parent = ids(1, 60, 7, 8, 2, 9, 1, 50, 6, 2, 9, 1, 60, 3, 4, 2)
    plain = ids(1, 60, 78, 2, 9, 1, 50, 6, 2, 9, 1, 60, 34, 2, 9, 1, 50, 5, 2, 9, 1, 60)
    result = splice(parent, ((2, 4), (13, 16)), "stop", plain)
    assert result.prompt_ids.tolist() == [*parent.tolist(), 9, 1, 50, 5, 2, 9, 1, 60]
    assert (result.how, result.completions) == ("exact", ((2, 4), (13, 16)))


def test_a_reply_cut_right_after_the_model_sampled_its_end_token_is_spliced_as_ended():
    result = splice(PARENT, REPLY, "length", PLAIN, closing=2)
    assert (result.how, result.prompt_ids.tolist(), result.completions) == (
        "exact",
        [*PARENT.tolist(), *NEW],
        ((7, 10),),
    )


def test_cut_reply_whose_closing_the_new_render_lacks_falls_back():
    result = splice(PARENT[:-1], ((7, 9),), "length", ids(1, 50, 5, 2, 9, 1, 60, 78), closing=2)
    assert result.how == "fallback: the new render closes fewer turns than the parent's ids hold"


def test_reply_cut_by_max_tokens_without_a_known_closing_falls_back_to_the_plain_render():
    result = splice(PARENT[:-1], ((7, 9),), "length", PLAIN)
    assert (result.how, result.prompt_ids.tolist(), result.completions) == (
        "fallback: parent reply ended with finish_reason=length",
        PLAIN.tolist(),
        None,
    )


def test_template_without_the_end_token_falls_back():
    result = splice(PARENT, REPLY, "stop", ids(1, 50, 5, 3, 1, 60, 78, 3, 1, 60))
    assert result.how == "fallback: the new render closes fewer turns than the parent's ids hold"


def test_new_render_with_fewer_closings_falls_back():
    assert splice(PARENT, REPLY, "stop", ids(1, 50, 5, 2, 9, 1, 60)).how == (
        "fallback: the new render closes fewer turns than the parent's ids hold"
    )


def test_a_reply_whose_context_cannot_be_found_in_the_new_render_falls_back():
    # The template now renders the assistant header as 61 and nothing before the reply matches.
    plain = ids(1, 50, 5, 2, 9, 3, 61, 78, 2, 9, 1, 60)
    parent = ids(1, 50, 5, 2, 9, 1, 60, 7, 8, 2)
    result = splice(parent, ((7, 10),), "stop", plain)
    assert (result.how, result.prompt_ids.tolist()) == (
        "fallback: the new render has no place for the model's earlier reply",
        plain.tolist(),
    )
