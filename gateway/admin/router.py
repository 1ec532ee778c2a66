"""HTTP routes of the admin API, behind a bearer token when `--admin-token` is set."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Depends, Request

from gateway.admin import service
from gateway.admin.protocol import AdminState, PauseRequest, PolicyVersionRequest
from gateway.errors import ApiError
from gateway.state import GatewayState, get_state


async def require_admin(request: Request, state: GatewayState = Depends(get_state)) -> GatewayState:
    token = state.settings.admin_token
    if token is not None:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise ApiError(401, "the admin API needs the gateway's admin token (Authorization: Bearer ...)", "unauthorized")
    return state


router = APIRouter(prefix="/admin")


@router.post("/pause", response_model=AdminState)
async def pause(body: PauseRequest, state: GatewayState = Depends(require_admin)) -> AdminState:
    """Pause the gateway and every backend for a weight update; new agent calls wait."""
    return await service.pause(state, body.mode, body.timeout)


@router.post("/resume", response_model=AdminState)
async def resume(state: GatewayState = Depends(require_admin)) -> AdminState:
    return await service.resume(state)


@router.post("/policy_version", response_model=AdminState)
async def policy_version(body: PolicyVersionRequest, state: GatewayState = Depends(require_admin)) -> AdminState:
    return await service.set_policy_version(state, body.version)


@router.post("/reload_weights", response_model=AdminState)
async def reload_weights(state: GatewayState = Depends(require_admin)) -> AdminState:
    """Have every backend reload the weights from its model directory (a weight sync through the disk)."""
    return await service.reload_weights(state)


@router.get("/state", response_model=AdminState)
async def admin_state(state: GatewayState = Depends(require_admin)) -> AdminState:
    return service.admin_state(state)
