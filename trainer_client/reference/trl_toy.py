"""TRL's `GRPOTrainer` on the toy task, fed by a gateway through `trainer_client.trl`: one `openai` SDK agent
call a rollout. The TRL test and `bench/trl_steps.py` train the same way. Needs the `trl` extra.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import openai

from trainer_client.reference.toy_task import TargetCharactersTask
from trainer_client.trl import GatewayRollouts, GatewayWeightSync, Rollout

TASK = TargetCharactersTask()


async def toy_agent(prompt: str, rollout: Rollout) -> float:
    """One call through the rollout's base URL, scored by the toy task."""
    async with openai.AsyncOpenAI(base_url=rollout.base_url, api_key=rollout.api_key) as client:
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=1.0
        )
    return TASK.score([[reply.choices[0].message.content or ""]])[0]


def toy_grpo_trainer(
    policy: Path,
    rollouts: GatewayRollouts,
    sync: GatewayWeightSync,
    output_dir: Path,
    *,
    steps: int,
    groups: int,
    group_size: int,
    trainer_class: Any = None,
    **config: Any,
) -> Any:
    """A `GRPOTrainer` (or `trainer_class`) on CPU, `groups` prompts of `group_size` rollouts a step, with
    the learning rate the tiny random model learns at."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func is experimental in TRL
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # trl's lazy exports

    args = GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=groups * group_size,
        num_generations=group_size,
        max_steps=steps,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        **config,
    )
    return (trainer_class or GRPOTrainer)(
        model=str(policy),
        reward_funcs=rollouts.reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": list(TASK.prompts)}),
        processing_class=AutoTokenizer.from_pretrained(policy),
        rollout_func=rollouts,
        callbacks=[sync],
    )
