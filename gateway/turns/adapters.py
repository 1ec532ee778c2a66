"""A call of a LoRA policy: sent to the policy's live adapter version, answered under the policy's name,
recorded with the version that sampled it (`gateway.fleet.adapters`)."""

from __future__ import annotations

from typing import Any

import orjson

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


def listed(content: bytes, adapters: FleetAdapters) -> dict[str, Any]:
    """vLLM's model list as agents see it: each LoRA policy with a live version is a model of its own (its
    base's card, under the policy's name), and the versions' names on the servers are left out."""
    try:
        models = orjson.loads(content)
    except orjson.JSONDecodeError:
        models = None
    if not isinstance(models, dict):
        raise ApiError(502, "backend answered GET /v1/models with no model list", "backend_error")
    names = {v.name for v in adapters.versions}
    cards = [
        card for card in models.get("data") or () if isinstance(card, dict) and card.get("id") not in names
    ]
    bases = {card.get("id"): card for card in cards}
    for policy, base in adapters.bases.items():
        if adapters.live(policy) is not None and base in bases:
            cards.append(bases[base] | {"id": policy, "root": base, "parent": base})
    return models | {"data": cards}
