"""Async GRPO end to end against a running gateway: rollout workers and the reference trainer together.

Training rollouts flow without pause while the trainer claims ready groups, steps and syncs weights. After
every `eval_every` steps (and before the first and after the last) the trainer waits while one round of
evaluation rollouts, tagged `eval`, is played at the current version. The result is the per-step log, mean
reward per policy version (training and evaluation rollouts) and pass@k, saved as JSON and plotted as a PNG.

`run_rank` runs it on N ranks under torch.distributed: rank 0 runs everything above, the other ranks only
their share of each training step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_store.database import make_engine
from trainer_client.reference.runner import RolloutRunner, RunnerConfig, RunnerStats
from trainer_client.reference.task import Task
from trainer_client.reference.toy_task import TargetCharactersTask
from trainer_client.reference.trainer import GRPOTrainer, StepReport, TrainerConfig
from training_data.evaluation import evaluation_report
from training_data.groups import numeric_version


@dataclass(frozen=True)
class LoopConfig:
    trainer: TrainerConfig
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    task: Task = field(default_factory=TargetCharactersTask)
    eval_every: int = 5
    eval_groups: int = 4
    """Evaluation groups per round; each group is one prompt sampled `runner.group_size` times (pass@k)."""
    pass_k: tuple[int, ...] = (1, 4)


@dataclass
class LoopResult:
    steps: list[StepReport]
    training: dict[str, Any]
    """Mean reward and pass@k of the training rollouts, per policy version."""
    evaluation: dict[str, Any]
    """The same for the evaluation rollouts."""
    runner: RunnerStats
    eval_runner: RunnerStats

    def reward_by_version(self, which: str = "training") -> dict[str | None, float]:
        report = self.training if which == "training" else self.evaluation
        return {
            v["policy_version"]: v["reward_mean"]
            for v in report["policy_versions"]
            if v["reward_mean"] is not None
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": [asdict(step) for step in self.steps],
            "training": self.training,
            "evaluation": self.evaluation,
            "runner": asdict(self.runner),
            "eval_runner": asdict(self.eval_runner),
        }


MakeTrainer = Callable[[TrainerConfig], GRPOTrainer]
"""Builds the trainer from its config: `GRPOTrainer`, or a subclass of it."""


def run_loop(
    config: LoopConfig,
    on_step: Callable[[StepReport], None] | None = None,
    *,
    make_trainer: MakeTrainer = GRPOTrainer,
) -> LoopResult:
    return asyncio.run(_run(config, on_step, make_trainer))


def run_rank(
    config: LoopConfig,
    on_step: Callable[[StepReport], None] | None = None,
    *,
    make_trainer: MakeTrainer = GRPOTrainer,
) -> LoopResult | None:
    """The loop as one rank of a data-parallel trainer; call it on every rank of the default torch.distributed
    process group (set up by the caller: torchrun, `init_process_group`) with the same config.

    Rank 0 runs `run_loop`: the rollout workers, the evaluation rounds and its trainer rank, the only one
    that reads the store, writes the weights and calls the gateway. Every other rank runs only its trainer
    rank, which trains on its shard of each step in step with rank 0 and reports the whole step's metrics.
    Returns the loop's result on rank 0, None on the others.
    """
    import torch.distributed as dist

    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, data_parallel=True))
    if dist.get_rank() == 0:
        return run_loop(config, on_step, make_trainer=make_trainer)
    trainer = make_trainer(config.trainer)
    try:
        trainer.run(on_step)
    finally:
        trainer.close()
    return None


async def _run(
    config: LoopConfig, on_step: Callable[[StepReport], None] | None, make_trainer: MakeTrainer
) -> LoopResult:
    loop = asyncio.get_running_loop()
    gateway_url = config.trainer.gateway_url
    run = uuid.uuid4().hex[:8]  # rollout ids of their own, even on a database an earlier run used
    runner = RolloutRunner(gateway_url, config.task, config.runner, name=f"train-{run}")
    evaluator = RolloutRunner(gateway_url, config.task, config.runner, name=f"eval-{run}")
    trainer = await asyncio.to_thread(make_trainer, config.trainer)
    finished = False

    def evaluate() -> None:
        rounds = asyncio.run_coroutine_threadsafe(
            evaluator.run(groups=config.eval_groups, tags=["eval"]), loop
        )
        rounds.result()

    def after_step(report: StepReport) -> None:
        if on_step is not None:
            on_step(report)
        if (report.step + 1) % config.eval_every == 0 or report.step + 1 == config.trainer.steps:
            evaluate()

    rollouts = asyncio.create_task(runner.run(stop=lambda: finished))

    def train() -> list[StepReport]:
        evaluate()
        return trainer.run(after_step, alive=lambda: not rollouts.done())

    try:
        steps = await asyncio.to_thread(train)
    finally:
        finished = True
        await rollouts
        trainer.close()
        await runner.close()
        await evaluator.close()
    engine = make_engine(config.trainer.db)
    with engine.connect() as conn:
        threshold = config.task.pass_threshold
        training = evaluation_report(conn, config.pass_k, threshold, tagged_eval=False)
        evaluation = evaluation_report(conn, config.pass_k, threshold, tagged_eval=True)
    engine.dispose()
    return LoopResult(steps, training, evaluation, runner.stats, evaluator.stats)


def save_report(result: LoopResult, directory: Path) -> tuple[Path, Path]:
    """`training.json` and `reward.png` (mean reward per policy version) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    report = directory / "training.json"
    report.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    plot = directory / "reward.png"
    plot_rewards(result, plot)
    return report, plot


def plot_rewards(result: LoopResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    for which, style in (("training", "o-"), ("evaluation", "s--")):
        rewards = result.reward_by_version(which)
        numbers = {v: n for v in rewards if (n := numeric_version(v)) is not None}
        axes.plot(list(numbers.values()), [rewards[v] for v in numbers], style, label=f"{which} rollouts")
    axes.set_xlabel("policy version")
    axes.set_ylabel("mean reward")
    axes.set_title("Async GRPO through the gateway: mean reward per policy version")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
