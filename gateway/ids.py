"""Rollout and group identifiers: they travel in URL paths, so they are kept URL-safe."""

from __future__ import annotations

import re
import uuid

from gateway.errors import ApiError

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_ID_RE = re.compile(ID_PATTERN)


def new_id() -> str:
    return uuid.uuid4().hex


def check_rollout_id(rollout_id: str) -> str:
    if not _ID_RE.match(rollout_id):
        raise ApiError(
            400, "rollout id must be 1-128 characters of letters, digits and . _ : -", "invalid_rollout_id"
        )
    return rollout_id
