"""HTTP routes of the admin API, behind the admin token (else the control token) when one is set."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from gateway.admin import service
from gateway.admin.context import AdminContext, admin_context
from gateway.admin.protocol import (
    AdapterRequest,
    AdminState,
    BackendRequest,
    PauseRequest,
    PolicyVersionRequest,
)
from gateway.auth import require_admin
from gateway.errors import error_responses

router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    responses=error_responses(401, 502),
    dependencies=[Depends(require_admin)],
)


@router.post("/pause", response_model=AdminState, responses=error_responses(400, 422, 504))
async def pause(body: PauseRequest | None = None, admin: AdminContext = Depends(admin_context)) -> AdminState:
    """Pause the gateway and every backend for a weight update; new agent calls wait (no body: `wait`)."""
    body = body or PauseRequest()
    clear = admin.clear_cache if body.clear_cache is None else body.clear_cache
    return await service.pause(admin, body.mode, body.timeout, clear)


@router.post("/resume", response_model=AdminState)
async def resume(admin: AdminContext = Depends(admin_context)) -> AdminState:
    return await service.resume(admin)


@router.post("/policy_version", response_model=AdminState, responses=error_responses(400, 422))
async def policy_version(
    body: PolicyVersionRequest, admin: AdminContext = Depends(admin_context)
) -> AdminState:
    return await service.set_policy_version(admin, body.version)


@router.post("/reload_weights", response_model=AdminState)
async def reload_weights(admin: AdminContext = Depends(admin_context)) -> AdminState:
    """Have every backend reload the weights from its model directory (a weight sync through the disk)."""
    return await service.reload_weights(admin)


@router.post("/adapters", response_model=AdminState, responses=error_responses(400, 404, 409, 422, 503))
async def publish_adapter(body: AdapterRequest, admin: AdminContext = Depends(admin_context)) -> AdminState:
    """Publish a LoRA policy's new version: loaded on every server of its base, then the version its new calls
    go to; calls in flight finish on theirs. No pause. A server that cannot load it takes none of the policy's
    calls until it can (its `adapter_errors`)."""
    return await service.publish_adapter(admin, body.policy, body.version, body.path)


@router.get("/state", response_model=AdminState)
async def admin_state(admin: AdminContext = Depends(admin_context)) -> AdminState:
    return await service.admin_state(admin)


@router.post("/backends", response_model=AdminState, responses=error_responses(400, 422))
async def add_backend(body: BackendRequest, admin: AdminContext = Depends(admin_context)) -> AdminState:
    """Add a vLLM server (or take a draining one back): it takes new rollouts once its health check passes."""
    return await service.add_backend(admin, body.url)


@router.post("/backends/drain", response_model=AdminState, responses=error_responses(400, 404, 409, 422))
async def drain_backend(body: BackendRequest, admin: AdminContext = Depends(admin_context)) -> AdminState:
    """No new rollouts go to the server; the rollouts pinned to it finish there."""
    return await service.drain_backend(admin, body.url)


@router.delete("/backends", response_model=AdminState, responses=error_responses(400, 404, 409, 422))
async def remove_backend(
    url: str = Query(description="The server's base URL."), admin: AdminContext = Depends(admin_context)
) -> AdminState:
    """Remove a server: calls in flight there finish; its rollouts move to others on their next call."""
    return await service.remove_backend(admin, url)
