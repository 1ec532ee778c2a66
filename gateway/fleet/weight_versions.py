"""The fleet's weights: how many reloads it has done and the version it was given. Every server serving holds
them; one behind (it missed a reload or a version while it was away) takes no calls until it has them."""

from __future__ import annotations

from dataclasses import dataclass

RELOAD, RELOAD_BODY = "/collective_rpc", {"method": "reload_weights"}
"""vLLM's call that reloads a server's weights from its model directory."""
WEIGHT_VERSION = "/update_weight_version"
"""vLLM's call that tags the tokens a server samples with a weight version."""


@dataclass
class FleetWeights:
    reloads: int = 0
    """Weight reloads the fleet has done (`/admin/reload_weights`)."""
    version: str | None = None
    """The weight version last given to the fleet (`/admin/policy_version`); None: never set."""
