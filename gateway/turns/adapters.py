"""A call of a LoRA policy: sent to the policy's live adapter version, answered under the policy's name,
recorded with the version that sampled it (`gateway.fleet.adapters`)."""

from __future__ import annotations

from gateway.errors import ApiError
from gateway.fleet.adapters import FleetAdapters
from gateway.store.records import TurnRecord
from gateway.store.run_state import AdapterVersion


def live_version(adapters: FleetAdapters, record: TurnRecord) -> AdapterVersion | None:
    """The version the call runs on, entered in its record (the version is the turn's policy version, for its
    whole length: a version's weights never change); None for a model's own weights."""
    if record.model is None or record.model not in adapters.bases:
        return None
    live = adapters.live(record.model)
    if live is None:
        raise ApiError(
            503,
            f"LoRA policy {record.model!r} has no version yet: publish one with POST /admin/adapters",
            "no_adapter_version",
        )
    record.adapter = live.name
    record.policy_version = record.policy_version_end = live.version
    return live
