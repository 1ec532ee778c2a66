"""HTTP routes of the viewer: its pages (static shells whose script reads the JSON routes), its assets and
its JSON. Behind the control token when one is set: a browser presents it once (`/ui/login?token=...`) and
keeps it in a cookie scoped to `/ui`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from importlib import resources
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy.engine import Connection
from starlette.responses import FileResponse, RedirectResponse, Response

from gateway.auth import VIEWER_COOKIE, require_viewer
from gateway.encoding import JsonResponse
from gateway.errors import ApiError
from gateway.ui import queries
from gateway.ui.context import ViewerContext, viewer_context

router = APIRouter(prefix="/ui", include_in_schema=False)
T = TypeVar("T")
STATIC = resources.files("gateway.ui") / "static"
VIEWER = [Depends(require_viewer)]


def _page(name: str) -> FileResponse:
    return FileResponse(str(STATIC / name), media_type="text/html")


@router.get("", dependencies=VIEWER)
async def overview() -> Response:
    return _page("overview.html")


@router.get("/login")
async def login(request: Request, token: str) -> Response:
    """Keep the control token in a cookie for the viewer's pages (checked on every request)."""
    answer = RedirectResponse(request.url_for("overview").path, status_code=303)
    answer.set_cookie(VIEWER_COOKIE, token, path="/ui", httponly=True, samesite="strict")
    return answer


@router.get("/api/rollouts", dependencies=VIEWER)
async def rollouts(
    group: str | None = None,
    tag: str | None = None,
    status: str | None = None,
    version: str | None = None,
    limit: int = Query(queries.PAGE, ge=1, le=1000),
    viewer: ViewerContext = Depends(viewer_context),
) -> Response:
    """The newest rollouts (filtered) with their counts, and reward per policy version."""
    filters = queries.Filters(group, tag, status, version)

    def overview(conn: Connection) -> dict[str, Any]:
        return {
            "rollouts": queries.rollouts(conn, filters, limit),
            "versions": queries.reward_by_version(conn),
        }

    return JsonResponse(await _read(viewer, overview))


@router.get("/rollouts/{rollout_id}", dependencies=VIEWER)
async def rollout_page(rollout_id: str) -> Response:
    return _page("rollout.html")


@router.get("/api/rollouts/{rollout_id}", dependencies=VIEWER)
async def rollout(rollout_id: str, viewer: ViewerContext = Depends(viewer_context)) -> Response:
    """The rollout with every turn's messages and ids, and the text of each id (by model)."""
    found = await viewer.store.get_rollout(rollout_id, include_tokens=True, include_messages=True)
    if found is None:
        raise ApiError(404, f"rollout {rollout_id!r} does not exist", "rollout_not_found")
    ids: dict[str | None, set[int]] = {}
    for turn in found["turns"]:
        ids.setdefault(turn["model"], set()).update(turn["prompt_token_ids"], turn["completion_token_ids"])
    texts = {model: await viewer.token_texts.texts(model, wanted) for model, wanted in ids.items()}
    return JsonResponse({"rollout": found, "texts": {str(model): t for model, t in texts.items()}})


@router.get("/api/rollouts/{rollout_id}/samples", dependencies=VIEWER)
async def trainer_samples(rollout_id: str, viewer: ViewerContext = Depends(viewer_context)) -> Response:
    """What `trainer_client` would train on for this rollout: merged samples with loss mask and advantage."""
    found = await _read(viewer, lambda conn: queries.trainer_samples(conn, rollout_id))
    if found is None:
        raise ApiError(404, f"rollout {rollout_id!r} does not exist", "rollout_not_found")
    return JsonResponse(found)


@router.get("/groups/{group_id}", dependencies=VIEWER)
async def group_page(group_id: str) -> Response:
    return _page("group.html")


@router.get("/api/groups/{group_id}", dependencies=VIEWER)
async def group(group_id: str, viewer: ViewerContext = Depends(viewer_context)) -> Response:
    """The group's rollouts side by side, with rewards and the advantages a trainer would give them."""
    found = await _read(viewer, lambda conn: queries.group(conn, group_id))
    if found is None:
        raise ApiError(404, f"group {group_id!r} has no rollouts", "group_not_found")
    return JsonResponse(found)


async def _read(viewer: ViewerContext, query: Callable[[Connection], T]) -> T:
    """`query` on a connection of the store, in a thread (the event loop keeps serving)."""

    def read() -> T:
        with viewer.store.engine.connect() as conn:
            return query(conn)

    return await asyncio.to_thread(read)


@router.get("/assets/{name}")
async def asset(name: str) -> Response:
    """The viewer's scripts and styles (no page needs anything from elsewhere)."""
    path = STATIC / name
    if name.endswith(".html") or not path.is_file():
        return Response(status_code=404)
    return FileResponse(str(path))
