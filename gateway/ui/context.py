"""What the viewer works with, handed to it by the app."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from gateway.store.store import Store
from gateway.ui.token_texts import TokenTexts


@dataclass(frozen=True)
class ViewerContext:
    store: Store
    token_texts: TokenTexts
    """The texts of token ids, per model."""


async def viewer_context(request: Request) -> ViewerContext:
    context: ViewerContext = request.app.state.viewer
    return context
