"""HTTP routes of the admin API, behind the admin token (else the control token) when one is set."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from gateway.admin import service
from gateway.admin.protocol import AdminState, BackendRequest, PauseRequest, PolicyVersionRequest
from gateway.auth import require_admin
from gateway.errors import error_responses
from gateway.state import GatewayState

router = APIRouter(prefix="/admin", tags=["admin"], responses=error_responses(401, 502))


@router.post("/pause", response_model=AdminState, responses=error_responses(400, 422, 504))
async def pause(body: PauseRequest | None = None, state: GatewayState = Depends(require_admin)) -> AdminState:
    """Pause the gateway and every backend for a weight update; new agent calls wait (no body: `wait`)."""
    body = body or PauseRequest()
    return await service.pause(state, body.mode, body.timeout)


@router.post("/resume", response_model=AdminState)
async def resume(state: GatewayState = Depends(require_admin)) -> AdminState:
    return await service.resume(state)


@router.post("/policy_version", response_model=AdminState, responses=error_responses(400, 422))
async def policy_version(
    body: PolicyVersionRequest, state: GatewayState = Depends(require_admin)
) -> AdminState:
    return await service.set_policy_version(state, body.version)


@router.post("/reload_weights", response_model=AdminState)
async def reload_weights(state: GatewayState = Depends(require_admin)) -> AdminState:
    """Have every backend reload the weights from its model directory (a weight sync through the disk)."""
    return await service.reload_weights(state)


@router.get("/state", response_model=AdminState)
async def admin_state(state: GatewayState = Depends(require_admin)) -> AdminState:
    return await service.admin_state(state)


@router.post("/backends", response_model=AdminState, responses=error_responses(400, 422))
async def add_backend(body: BackendRequest, state: GatewayState = Depends(require_admin)) -> AdminState:
    """Add a vLLM server (or take a draining one back): it takes new rollouts once its health check passes."""
    return await service.add_backend(state, body.url)


@router.post("/backends/drain", response_model=AdminState, responses=error_responses(400, 404, 409, 422))
async def drain_backend(body: BackendRequest, state: GatewayState = Depends(require_admin)) -> AdminState:
    """No new rollouts go to the server; the rollouts pinned to it finish there."""
    return await service.drain_backend(state, body.url)


@router.delete("/backends", response_model=AdminState, responses=error_responses(400, 404, 409, 422))
async def remove_backend(
    url: str = Query(description="The server's base URL."), state: GatewayState = Depends(require_admin)
) -> AdminState:
    """Remove a server: calls in flight there finish; its rollouts move to others on their next call."""
    return await service.remove_backend(state, url)
