"""Which weights sampled each completion token, and how many updates ago: the run's versions in the order it
published them (`policy_versions`), a turn's spans (`turns.weight_versions`, from servers with the vLLM
plugin), and the staleness of each token against the trainer's current version, counted in updates of the
turn's policy.

A turn without spans (from a server without the plugin) has every token at its `policy_version`, the version
at dispatch: the oldest that can have sampled any of them. A LoRA adapter's turn has every token at its
adapter version: an adapter version is a name of its own on the servers, never changed under a call (the
spans label the base weights)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.engine import Connection

from rollout_store import schema

UNKNOWN = -1
"""A token's version index when its version is not in the run's order (a label the run never published)."""


@dataclass(frozen=True)
class VersionOrder:
    """Each policy's versions, numbered from 0 in the order the run published them (None: the full
    weights')."""

    index: Mapping[tuple[str | None, str], int]

    def of(self, policy: str | None, version: str | None) -> int:
        return self.index.get((policy, version), UNKNOWN) if version is not None else UNKNOWN


def version_order(conn: Connection) -> VersionOrder:
    v = schema.policy_versions
    index: dict[tuple[str | None, str], int] = {}
    counts: dict[str | None, int] = {}
    for policy, version in conn.execute(select(v.c.policy, v.c.version).order_by(v.c.seq)):
        if (policy, version) not in index:  # published twice (a restart): its first place counts
            index[(policy, version)] = counts.get(policy, 0)
            counts[policy] = counts.get(policy, 0) + 1
    return VersionOrder(index)


def token_versions(order: VersionOrder, row: Mapping[str, Any], tokens: int) -> np.ndarray:
    """The index of the version that sampled each of a turn's `tokens` completion tokens."""
    policy = row["model"] if row["adapter"] is not None else None
    spans: Sequence[Mapping[str, Any]] | None = row["weight_versions"] if policy is None else None
    if not spans or spans[-1]["end"] != tokens:
        return np.full(tokens, order.of(policy, row["policy_version"]), dtype=np.int32)
    versions = np.empty(tokens, dtype=np.int32)
    for span in spans:
        versions[span["start"] : span["end"]] = order.of(None, span["version"])
    return versions


def staleness(order: VersionOrder, row: Mapping[str, Any], versions: np.ndarray, current: int) -> np.ndarray:
    """Each token's updates of its turn's policy behind the trainer's `current` version (which the run has
    published); UNKNOWN where its version or `current` is not in the run's order."""
    policy = row["model"] if row["adapter"] is not None else None
    now = order.of(policy, str(current))
    if now == UNKNOWN:
        return np.full(versions.shape[0], UNKNOWN, dtype=np.int32)
    return np.where(versions == UNKNOWN, UNKNOWN, now - versions).astype(np.int32)
