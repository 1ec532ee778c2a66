"""Samples as a Hugging Face `datasets` dataset (`trainer-client export --format hf`, `samples_dataset`): one
row per sample, step-wise or merged, with the ids the engine saw and sampled, never a re-tokenization.

Columns: `rollout_id`, `group_id`, `turn_index` (the sample's first turn), `turn_indices`, `policy_version`,
`prompt_ids` (the ids before the first sampled token), `completion_ids` (the rest: sampled tokens, and for a
merged sample the environment's tokens between them), `input_ids` (prompt then completion), `loss_mask` and
`logprobs` (aligned with `input_ids`: 1 and the sampling logprob on sampled tokens, 0 elsewhere), `reward`,
`advantage`, `reward_components` (JSON text), `finish_reason`, `is_last_step`, `masked`, `token_versions`
(the index of the version that sampled each token, aligned like `logprobs`, -1 elsewhere:
`training_data.versions`); read with a current version (`SampleOptions(current_version=...)`,
`export --current-version`), `token_staleness` too; read with a teacher (`SampleOptions(teacher=...)`,
`export --teacher`), `teacher_logprobs` too (aligned like `logprobs`).

Needs the `hf` extra (`pip install 'rl-gateway[hf]'`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from training_data.groups import SampleOptions
from training_data.samples import MergedSample, StepSample

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa


def features(teacher: bool = False, staleness: bool = False) -> datasets.Features:
    from datasets import Features, Sequence, Value

    ids, floats = Sequence(Value("int32")), Sequence(Value("float32"))
    columns = Features(
        {
            "rollout_id": Value("string"),
            "group_id": Value("string"),
            "turn_index": Value("int32"),
            "turn_indices": Sequence(Value("int32")),
            "policy_version": Value("string"),
            "prompt_ids": ids,
            "completion_ids": ids,
            "input_ids": ids,
            "loss_mask": Sequence(Value("int8")),
            "logprobs": floats,
            "reward": Value("float64"),
            "advantage": Value("float64"),
            "reward_components": Value("string"),
            "finish_reason": Value("string"),
            "is_last_step": Value("bool"),
            "masked": Value("bool"),
            "token_versions": ids,
        }
    )
    if staleness:
        columns["token_staleness"] = ids
    if teacher:
        columns["teacher_logprobs"] = floats
    return columns


def table(
    samples: list[StepSample | MergedSample], teacher: bool = False, staleness: bool = False
) -> pa.Table:
    """Samples as rows of an Arrow table of `features(teacher, staleness)`'s schema: the id and logprob
    columns are built from the samples' arrays as they are (a Python list per row would cost ten times as
    much)."""
    import pyarrow as pa

    cuts = [sample.prompt_length for sample in samples]

    def lists(arrays: list[np.ndarray], kind: pa.DataType) -> pa.Array:
        offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
        np.cumsum([a.shape[0] for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays) if arrays else np.zeros(0)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=kind))

    columns = {
        "rollout_id": pa.array([s.rollout_id for s in samples], pa.string()),
        "group_id": pa.array([s.group_id for s in samples], pa.string()),
        "turn_index": pa.array([_turns(s)[0] for s in samples], pa.int32()),
        "turn_indices": pa.array([_turns(s) for s in samples], pa.list_(pa.int32())),
        "policy_version": pa.array([s.policy_version for s in samples], pa.string()),
        "prompt_ids": lists([s.input_ids[:cut] for s, cut in zip(samples, cuts, strict=True)], pa.int32()),
        "completion_ids": lists(
            [s.input_ids[cut:] for s, cut in zip(samples, cuts, strict=True)], pa.int32()
        ),
        "input_ids": lists([s.input_ids for s in samples], pa.int32()),
        "loss_mask": lists([s.loss_mask for s in samples], pa.int8()),
        "logprobs": lists([s.token_logprobs for s in samples], pa.float32()),
        "reward": pa.array([s.reward for s in samples], pa.float64()),
        "advantage": pa.array([s.advantage for s in samples], pa.float64()),
        "reward_components": pa.array([json.dumps(s.reward_components) for s in samples], pa.string()),
        "finish_reason": pa.array([s.finish_reason for s in samples], pa.string()),
        "is_last_step": pa.array([s.is_last_step for s in samples], pa.bool_()),
        "masked": pa.array([s.masked for s in samples], pa.bool_()),
        "token_versions": lists([_aligned(s, s.token_versions) for s in samples], pa.int32()),
    }
    if staleness:
        columns["token_staleness"] = lists([_aligned(s, s.token_staleness) for s in samples], pa.int32())
    if teacher:
        columns["teacher_logprobs"] = lists([_teacher(s) for s in samples], pa.float32())
    return pa.table(columns, schema=features(teacher, staleness).arrow_schema)


def _aligned(sample: StepSample | MergedSample, values: np.ndarray | None) -> np.ndarray:
    """A per-token column, -1 throughout for a sample read without it."""
    return values if values is not None else np.full(sample.input_ids.shape[0], -1, dtype=np.int32)


def _teacher(sample: StepSample | MergedSample) -> np.ndarray:
    logprobs = sample.token_teacher_logprobs
    if logprobs is None:
        raise ValueError(f"a sample of rollout {sample.rollout_id} has no teacher scores")
    return logprobs


def _turns(sample: StepSample | MergedSample) -> list[int]:
    return [sample.turn_index] if isinstance(sample, StepSample) else sample.turn_indices


def _write(db: str, options: SampleOptions, path: Path) -> int:
    """Every ready group's samples, claiming nothing, as an Arrow stream file; how many."""
    import pyarrow as pa

    from trainer_client.client import TrainerClient

    written = 0
    teacher, staleness = options.teacher is not None, options.current_version is not None
    schema = features(teacher, staleness).arrow_schema
    with (
        TrainerClient(db) as client,
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_stream(sink, schema) as out,
    ):
        for batch in client.iter_batches(options):
            if batch.samples:
                out.write_table(table(batch.samples, teacher, staleness))
                written += len(batch.samples)
    return written


def samples_dataset(db: str, options: SampleOptions | None = None) -> datasets.Dataset:
    """The samples of every ready group as a `datasets.Dataset` in memory, claiming nothing (as `export`
    does)."""
    from datasets import Dataset

    with tempfile.TemporaryDirectory(prefix="trainer-client-hf-") as work:
        path = Path(work) / "samples.arrow"
        _write(db, options or SampleOptions(), path)
        return Dataset.from_file(str(path), in_memory=True)


def save(db: str, options: SampleOptions, directory: Path) -> int:
    """Write the samples to `directory` (`datasets.load_from_disk` reads it); how many. The samples stream
    to disk a batch of groups at a time."""
    from datasets import Dataset

    with tempfile.TemporaryDirectory(prefix="trainer-client-hf-", dir=directory.parent) as work:
        path = Path(work) / "samples.arrow"
        written = _write(db, options, path)
        if directory.exists():
            shutil.rmtree(directory)
        Dataset.from_file(str(path)).save_to_disk(str(directory))
    return written
