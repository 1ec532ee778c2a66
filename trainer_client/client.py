"""`TrainerClient`: step-wise GRPO samples straight from the gateway's store, claimed safely."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from rollout_store.database import make_engine, require_current_schema
from trainer_client.batch import Batch, Sample
from trainer_client.claims import claim_groups, commit_claims, release_claims, renew_claims
from training_data.groups import SampleOptions, Selection, read_groups, ready_groups
from training_data.loading import load_samples


class TrainerClient:
    """Reads the database the gateway writes (the same SQLite file or PostgreSQL URL)."""

    def __init__(self, db: str) -> None:
        self.engine = make_engine(db)
        self._write_engine = make_engine(db, pool_size=1, writer=True)
        require_current_schema(self.engine)

    def claim(
        self, trainer_id: str, step: int, options: SampleOptions | None = None, *, lease: float | None = None
    ) -> Batch:
        """Atomically take ready groups for `trainer_id` at training `step`, as one batch.

        No two trainers get the same rollout. Stale, failed and unrewarded rollouts met on the way are
        marked with their reason (counted in `Batch.counts`) so nobody takes them again. With `lease`
        (seconds), the claim lapses unless `commit(trainer_id, step)` (or `renew`) comes first: if this
        trainer dies mid-step, another one takes the rollouts after the lease. A lease must outlast the step.
        """
        options = options or SampleOptions()
        with self._write_engine.begin() as conn:
            selection = claim_groups(conn, trainer_id, step, options, lease)
        return self._load(selection, options)

    def renew(self, trainer_id: str, step: int, lease: float) -> int:
        """Extend the leases of the step's claims to `lease` seconds from now; returns how many are held."""
        with self._write_engine.begin() as conn:
            return renew_claims(conn, trainer_id, step, lease)

    def commit(self, trainer_id: str, step: int) -> int:
        """The step is trained: keep its leased claims for good; returns how many were still held."""
        with self._write_engine.begin() as conn:
            return commit_claims(conn, trainer_id, step)

    def release(self, trainer_id: str, step: int | None = None) -> int:
        """Return claimed rollouts (a failed step) so that they can be claimed again; returns how many."""
        with self._write_engine.begin() as conn:
            return release_claims(conn, trainer_id, step)

    def read(self, options: SampleOptions | None = None) -> Batch:
        """Every ready group, claimed or not, without claiming: for evaluation, export and analysis."""
        return next(self.iter_batches(options, groups_per_batch=None), Batch([]))

    def read_groups(self, group_ids: list[str], options: SampleOptions | None = None) -> Batch:
        """These groups' samples, claimed or not, without claiming: for a trainer that played them itself."""
        options = options or SampleOptions()
        with self.engine.connect() as conn:
            selection = read_groups(conn, group_ids, options)
        return self._load(selection, options)

    def iter_batches(
        self, options: SampleOptions | None = None, groups_per_batch: int | None = 100
    ) -> Iterator[Batch]:
        """Ready groups in chunks, oldest first, claiming nothing (for exports that do not fit in memory)."""
        options = options or SampleOptions()
        with self.engine.connect() as conn:
            groups = ready_groups(conn, options, unclaimed_only=False)
        size = groups_per_batch or max(len(groups), 1)
        for start in range(0, len(groups), size):
            with self.engine.connect() as conn:
                selection = read_groups(conn, groups[start : start + size], options)
            yield self._load(selection, options)

    def _load(self, selection: Selection, options: SampleOptions) -> Batch:
        with self.engine.connect() as conn:
            samples = load_samples(
                conn,
                selection.rollouts,
                merged=options.merged,
                teacher=options.teacher,
                current_version=options.current_version,
                max_token_staleness=options.max_token_staleness,
            )
        return Batch(cast(list[Sample], samples), selection.counts())

    def close(self) -> None:
        self._write_engine.dispose()
        self.engine.dispose()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
