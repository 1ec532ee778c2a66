"""What trains, read from the store: ready GRPO groups and their advantages (`groups`), step-wise and merged
samples (`samples`, loaded by `loading`), teachers' scores for distillation (`teacher_scores`) and the
evaluation report (`evaluation`). `trainer_client`, the viewer and the exports read it alike. It reads the
store through its read contract (`rollout_store`: the tables, packed ids and delta rebuild), never the
gateway, and the gateway's serving path never imports it."""
