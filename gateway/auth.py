"""Who may call what: the control token (orchestrators, trainers), the admin token (weight syncs) and the
per-rollout agent keys (`--rollout-keys`).

An agent holds only its own rollout's key, so it can call the model for that rollout and nothing else: not
another rollout, not the control API (it cannot post its own reward), not the admin API. Keys are random,
stored only as their sha256, and every comparison runs in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from fastapi import Request
from pydantic import SecretStr

from gateway.errors import ApiError
from gateway.store.records import RolloutState


@dataclass(frozen=True)
class Tokens:
    """The gateway's tokens (`--control-token`, `--admin-token`); None: that API is open."""

    control: SecretStr | None
    admin: SecretStr | None


def _tokens(request: Request) -> Tokens:
    tokens: Tokens = request.app.state.tokens
    return tokens


def new_rollout_key() -> str:
    return "rk-" + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    """A rollout key is 256 random bits: a plain sha256 is as hard to invert as the key is to guess."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_token(request: Request) -> str | None:
    """The caller's token: `Authorization: Bearer T` (OpenAI clients), else `x-api-key` (Anthropic
    clients)."""
    authorization = request.headers.get("authorization")
    if authorization is not None:
        scheme, _, token = authorization.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    return request.headers.get("x-api-key")


def _same(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def _require(request: Request, token: SecretStr | None, api: str) -> None:
    if token is not None and not _same(bearer_token(request), token.get_secret_value()):
        raise ApiError(
            401,
            f"the {api} needs the gateway's {api.split(maxsplit=1)[0]} token (Authorization: Bearer ...)",
            "unauthorized",
        )


async def require_control(request: Request) -> None:
    """The control API: create rollouts, post rewards, finish, read."""
    _require(request, _tokens(request).control, "control API")


VIEWER_COOKIE = "gateway_viewer"
"""Where a browser keeps the control token for the viewer (`/ui/login`)."""


async def require_viewer(request: Request) -> None:
    """The viewer: the control token, from the header or the viewer's cookie."""
    token = _tokens(request).control
    if token is not None and not _same(request.cookies.get(VIEWER_COOKIE), token.get_secret_value()):
        _require(request, token, "control API")


async def require_admin(request: Request) -> None:
    """The admin API: its own token, else the control token."""
    tokens = _tokens(request)
    _require(request, tokens.admin or tokens.control, "admin API")


def check_agent_key(request: Request, rollout_id: str, rollout: RolloutState | None) -> None:
    """With --rollout-keys, an agent call must carry its rollout's own key. The answer is the same 401 for
    a missing key, a wrong one, another rollout's and an unknown rollout, so it reveals nothing."""
    given = bearer_token(request)
    expected = rollout.api_key_hash if rollout is not None else None
    if given is None or expected is None or not _same(key_hash(given), expected):
        raise ApiError(
            401,
            f"calls for rollout {rollout_id!r} need its api_key (from POST /rollouts) as their bearer token",
            "invalid_api_key",
        )
