"""A tiny teacher for on-policy distillation (`scripts/dev demo --distill`, the distillation tests).

The tiny model fine-tuned for a few seconds on the toy task's ideal reply: after each of the task's prompts,
the token of the vocabulary richest in the target characters, over and over. Its logprobs on the student's
own samples are then a dense signal toward that reply, which the student learns by distillation without a
reward. Same tokenizer and template as the student: it is the same model, other weights.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from trainer_client.reference.toy_task import TargetCharactersTask
from trainer_client.weights import save_weights

log = logging.getLogger(__name__)


def build_teacher(
    base: Path,
    out: Path,
    task: TargetCharactersTask,
    *,
    reply_tokens: int = 16,
    steps: int = 30,
    learning_rate: float = 1e-2,
    seed: int = 0,
) -> Path:
    """Copy the model `base` into `out` and fine-tune it to answer every prompt of `task` with
    `reply_tokens` of its richest token; returns `out`."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns(".*"))
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    richest = richest_token(tokenizer, task.target)
    rows = []
    for prompt in task.prompts:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        rows.append((list(prompt_ids), [richest] * reply_tokens))
    width = max(len(p) + len(r) for p, r in rows)
    pad = [[0] * (width - len(p) - len(r)) for p, r in rows]  # right padding, masked out
    input_ids = torch.tensor([p + r + tail for (p, r), tail in zip(rows, pad, strict=True)])
    attention = torch.tensor([[1] * (len(p) + len(r)) + tail for (p, r), tail in zip(rows, pad, strict=True)])
    labels = torch.tensor(
        [[-100] * len(p) + r + [-100] * len(tail) for (p, r), tail in zip(rows, pad, strict=True)]
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    model.train()
    for step in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        log.debug("teacher step %d: loss %.4f", step, float(loss.detach()))
    save_weights(model, out)
    return out


def richest_token(tokenizer: PreTrainedTokenizerBase, target: str) -> int:
    """The id whose text holds the most target characters (the shortest text on a tie, then the lowest id)."""
    best: tuple[int, int, int] | None = None
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        key = (-sum(ch in target for ch in text), len(text), token_id)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[2]
