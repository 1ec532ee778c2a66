"""The vLLM servers behind the gateway: one pooled HTTP client, rollouts pinned to a server."""

from __future__ import annotations

import zlib

import httpx

from gateway.errors import ApiError


class BackendPool:
    def __init__(self, urls: list[str], *, timeout: float, connect_timeout: float, max_connections: int) -> None:
        if not urls:
            raise ValueError("at least one backend URL is required")
        self.urls = urls
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def order(self, rollout_id: str) -> list[str]:
        """Backends to try for a rollout: its own first (keeps its prefix cache warm), then the others."""
        start = zlib.crc32(rollout_id.encode()) % len(self.urls)
        return self.urls[start:] + self.urls[:start]

    async def send(self, rollout_id: str, path: str, body: bytes, *, stream: bool) -> tuple[str, httpx.Response]:
        """POST to the rollout's backend, failing over only when a connection could not be made.

        Raises ApiError 503 when no backend accepts a connection and 504 on a timeout.
        """
        last_error: Exception | None = None
        for url in self.order(rollout_id):
            request = self.client.build_request(
                "POST", url + path, content=body, headers={"content-type": "application/json"}
            )
            try:
                return url, await self.client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last_error = exc
            except httpx.TimeoutException as exc:
                raise ApiError(504, f"backend {url} timed out: {type(exc).__name__}", "backend_timeout") from exc
            except httpx.HTTPError as exc:
                raise ApiError(502, f"backend {url} failed: {exc!r}", "backend_error") from exc
        raise ApiError(
            503, f"no backend reachable ({', '.join(self.urls)}): {last_error!r}", "backend_unavailable"
        ) from last_error

    async def get(self, path: str) -> httpx.Response:
        last_error: Exception | None = None
        for url in self.urls:
            try:
                return await self.client.get(url + path)
            except httpx.HTTPError as exc:
                last_error = exc
        raise ApiError(503, f"no backend reachable: {last_error!r}", "backend_unavailable") from last_error

    async def close(self) -> None:
        await self.client.aclose()
