"""The reference async GRPO loop, built on the library: not imported by `trainer_client` itself.

`runner.RolloutRunner` plays a `task.Task` through a gateway with `openai` SDK agents, `trainer.GRPOTrainer`
claims ready groups and trains a `transformers` policy (its weights, or a LoRA adapter of it), `loop.run_loop`
runs both (`loop.run_rank` on each rank of a torch.distributed trainer), and `toy_task` is an environment a
tiny model learns on a CPU. Needs the `trainer` extra (TRL's `GRPOTrainer` on the toy task is
`examples/trl_grpo.py`).
"""
