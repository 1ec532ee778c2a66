"""HTTP routes of the control API: create rollouts, post rewards, finish, inspect; health and metrics."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from gateway import __version__
from gateway.control.protocol import (
    CreateRolloutRequest,
    FinishRequest,
    RewardRecorded,
    RewardRequest,
    RolloutCreated,
    RolloutFinished,
)
from gateway.errors import ApiError
from gateway.ids import check_rollout_id, new_id
from gateway.state import GatewayState, get_state
from gateway.store.records import NewRollout, Reward

router = APIRouter()


def agent_base_url(state: GatewayState, request: Request, rollout_id: str) -> str:
    root = (state.settings.public_url or str(request.base_url)).rstrip("/")
    return f"{root}/rollouts/{rollout_id}/v1"


@router.post("/rollouts", status_code=201, response_model=RolloutCreated)
async def create_rollout(
    body: CreateRolloutRequest, request: Request, response: Response, state: GatewayState = Depends(get_state)
) -> RolloutCreated:
    """Create a rollout (idempotent on `rollout_id`) and return the base URL to hand to the agent."""
    new = NewRollout(body.rollout_id or new_id(), body.group_id, body.task_id, body.metadata, body.mode, body.tags)
    row, created = await state.store.writer.create_rollout(new)
    if not created:
        response.status_code = 200
    return RolloutCreated(
        rollout_id=row["rollout_id"],
        group_id=row["group_id"],
        task_id=row["task_id"],
        metadata=row["metadata"],
        mode=row["mode"] or state.settings.mode,
        tags=row["tags"],
        status=row["status"],
        created=created,
        base_url=agent_base_url(state, request, row["rollout_id"]),
    )


@router.post("/rollouts/{rollout_id}/reward", response_model=RewardRecorded)
async def post_reward(
    rollout_id: str, body: RewardRequest, state: GatewayState = Depends(get_state)
) -> RewardRecorded:
    """Record a reward for the rollout, or for one of its turns when `turn_index` is given."""
    check_rollout_id(rollout_id)
    await state.store.writer.add_reward(rollout_id, Reward(body.reward, body.components, body.turn_index))
    return RewardRecorded(
        rollout_id=rollout_id, reward=body.reward, components=body.components, turn_index=body.turn_index
    )


@router.post("/rollouts/{rollout_id}/finish", response_model=RolloutFinished)
async def finish_rollout(
    rollout_id: str, body: FinishRequest, state: GatewayState = Depends(get_state)
) -> RolloutFinished:
    """Close the rollout; a second finish is a 409."""
    check_rollout_id(rollout_id)
    reward = Reward(body.reward, body.components) if body.reward is not None else None
    row = await state.store.writer.finish_rollout(rollout_id, body.status, reward)
    return RolloutFinished(**{name: row[name] for name in RolloutFinished.model_fields})


@router.get("/rollouts/{rollout_id}")
async def get_rollout(
    rollout_id: str,
    include_tokens: bool = False,
    include_messages: bool = False,
    state: GatewayState = Depends(get_state),
) -> Response:
    """The rollout with its turns; token arrays and full message histories only on request."""
    check_rollout_id(rollout_id)
    rollout = await state.store.get_rollout(
        rollout_id, include_tokens=include_tokens, include_messages=include_messages
    )
    if rollout is None:
        raise ApiError(404, f"rollout {rollout_id!r} does not exist", "rollout_not_found")
    return Response(orjson.dumps(rollout), media_type="application/json")


@router.get("/healthz")
async def healthz(state: GatewayState = Depends(get_state)) -> dict[str, Any]:
    return {
        "status": "ok",
        "version": __version__,
        "policy_version": state.policy_version,
        "backends": state.backends.urls,
    }


@router.get("/metrics")
async def metrics(state: GatewayState = Depends(get_state)) -> Response:
    state.metrics.commits.set(state.store.writer.commits)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
