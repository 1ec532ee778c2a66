"""HTTP routes of the control API: create rollouts, post rewards, finish, inspect (behind the control token
when one is set); liveness, readiness and metrics (open)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from gateway import __version__
from gateway.auth import key_hash, new_rollout_key, require_control
from gateway.control.context import ControlContext, control_context
from gateway.control.protocol import (
    CreateRolloutRequest,
    FinishRequest,
    Health,
    Readiness,
    RewardRecorded,
    RewardRequest,
    RolloutCreated,
    RolloutFinished,
    RolloutLimits,
    RolloutView,
)
from gateway.control.readiness import backends_health, store_reasons
from gateway.encoding import JsonResponse
from gateway.errors import ApiError, error_responses
from gateway.ids import check_rollout_id, new_id
from gateway.store.records import Limits, NewRollout, Reward

router = APIRouter(
    tags=["control"], responses=error_responses(400, 401, 422), dependencies=[Depends(require_control)]
)


def agent_base_url(public_url: str | None, request: Request, rollout_id: str) -> str:
    root = (public_url or str(request.base_url)).rstrip("/")
    return f"{root}/rollouts/{rollout_id}/v1"


@router.post(
    "/rollouts",
    status_code=201,
    response_model=RolloutCreated,
    responses={
        200: {"model": RolloutCreated, "description": "The rollout existed already"},
        **error_responses(409),
    },
)
async def create_rollout(
    body: CreateRolloutRequest,
    request: Request,
    response: Response,
    control: ControlContext = Depends(control_context),
) -> RolloutCreated:
    """Create a rollout (idempotent on `rollout_id`) and return the base URL (and key) to hand to the
    agent."""
    key = new_rollout_key() if control.rollout_keys else None
    limits = Limits(**body.limits.model_dump()) if body.limits is not None else Limits()
    new = NewRollout(
        body.rollout_id or new_id(),
        body.group_id,
        body.group_size,
        body.task_id,
        body.metadata,
        body.mode,
        body.tags,
        api_key_hash=key_hash(key) if key is not None else None,
        limits=limits,
        sampling=body.sampling.model_dump(exclude_none=True) if body.sampling is not None else None,
        policy=body.policy,
    )
    row, created = await control.store.create_rollout(new)
    base_url = agent_base_url(control.public_url, request, row["rollout_id"])
    if not created:
        response.status_code = 200
    return RolloutCreated(
        rollout_id=row["rollout_id"],
        group_id=row["group_id"],
        group_size=row["group_size"],
        task_id=row["task_id"],
        metadata=row["metadata"],
        mode=row["mode"] or control.mode,
        tags=row["tags"],
        limits=RolloutLimits(**row["limits"]) if row["limits"] else None,
        sampling=row["sampling"],
        policy=row["policy"],
        status=row["status"],
        created=created,
        base_url=base_url,
        anthropic_base_url=base_url.removesuffix("/v1"),
        api_key=key if created else None,
    )


@router.post("/rollouts/{rollout_id}/reward", response_model=RewardRecorded, responses=error_responses(404))
async def post_reward(
    rollout_id: str, body: RewardRequest, control: ControlContext = Depends(control_context)
) -> RewardRecorded:
    """Record a reward for the rollout, or for one of its turns when `turn_index` is given."""
    check_rollout_id(rollout_id)
    await control.store.add_reward(rollout_id, Reward(body.reward, body.components, body.turn_index))
    return RewardRecorded(
        rollout_id=rollout_id, reward=body.reward, components=body.components, turn_index=body.turn_index
    )


@router.post(
    "/rollouts/{rollout_id}/finish", response_model=RolloutFinished, responses=error_responses(404, 409)
)
async def finish_rollout(
    rollout_id: str, body: FinishRequest | None = None, control: ControlContext = Depends(control_context)
) -> RolloutFinished:
    """Close the rollout (status `completed` without a body); a second finish is a 409."""
    check_rollout_id(rollout_id)
    body = body or FinishRequest()
    reward = Reward(body.reward, body.components) if body.reward is not None else None
    row = await control.store.finish_rollout(rollout_id, body.status, reward)
    control.fleet.forget(rollout_id)
    return RolloutFinished(**{name: row[name] for name in RolloutFinished.model_fields})


@router.get("/rollouts/{rollout_id}", response_model=RolloutView, responses=error_responses(404))
async def get_rollout(
    rollout_id: str,
    include_tokens: bool = False,
    include_messages: bool = False,
    control: ControlContext = Depends(control_context),
) -> Response:
    """The rollout with its turns; token arrays and full message histories only on request."""
    check_rollout_id(rollout_id)
    rollout = await control.store.get_rollout(
        rollout_id, include_tokens=include_tokens, include_messages=include_messages
    )
    if rollout is None:
        raise ApiError(404, f"rollout {rollout_id!r} does not exist", "rollout_not_found")
    rollout["mode"] = rollout["mode"] or control.mode
    return JsonResponse(rollout)


health_router = APIRouter(tags=["health"])


@health_router.get("/healthz", response_model=Health)
async def healthz(control: ControlContext = Depends(control_context)) -> Health:
    """Liveness: the process serves. It does not look at the store or the backends (see /readyz)."""
    return Health(
        status="ok",
        version=__version__,
        policy_version=control.recorder.policy_version,
        backends=control.fleet.urls,
    )


@health_router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready: `reasons` says why"}},
)
async def readyz(response: Response, control: ControlContext = Depends(control_context)) -> Readiness:
    """Readiness: whether this process can serve agent, control and admin calls. The backends' health is
    shown but does not count: every process sees the same fleet, and taking them all out of a load balancer
    would cut off finishing rollouts, rewards and the admin API too."""
    reasons = await store_reasons(control)
    if control.lifecycle.stopping:
        reasons.append("shutting down")
    if reasons:
        response.status_code = 503
    return Readiness(
        ready=not reasons,
        reasons=reasons,
        backends=backends_health(list(control.fleet.servers.values())),
        policy_version=control.recorder.policy_version,
        version=__version__,
    )


@health_router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
async def metrics(control: ControlContext = Depends(control_context)) -> Response:
    """Prometheus metrics (no secrets: counts, latencies and token totals only)."""
    return Response(await control.replica.exposition(), media_type=CONTENT_TYPE_LATEST)
