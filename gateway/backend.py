"""The vLLM servers behind the gateway: one pooled aiohttp session, rollouts pinned to a server.

aiohttp rather than httpx on this path: it costs a fraction of httpx's per-request overhead (measured in
bench/gateway_overhead.py).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


_UNWRITTEN = "Can not write request body"
"""How aiohttp words a request whose body could not be sent: the server cannot have acted on it."""


class BackendStreamError(Exception):
    """The backend's reply broke off while it was being read."""


class BackendFailure(Exception):
    """No answer from the backends: `kind` is timeout, unreachable or failed (`gateway.errors` maps it to
    HTTP)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class BackendReply:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status

    async def body(self) -> bytes:
        try:
            return await self._response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise BackendStreamError(f"backend reply broke off: {exc!r}") from exc
        finally:
            self._response.release()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise BackendStreamError(f"backend stream broke off: {exc!r}") from exc

    def close(self) -> None:
        """Drop the connection if the reply was not read to the end (vLLM then aborts the request)."""
        self._response.close()


class BackendPool:
    def __init__(
        self,
        urls: list[str],
        *,
        timeout: float,
        connect_timeout: float,
        max_connections: int,
        api_key: str | None = None,
    ) -> None:
        if not urls:
            raise ValueError("at least one backend URL is required")
        self.urls = urls
        self.scale_out: dict[str, bool] = {}
        """Whether each backend serves vLLM's token-in/token-out endpoints (once known)."""
        self._session = aiohttp.ClientSession(
            # Idle connections are dropped before vLLM's uvicorn drops them (5 s), so that few stale ones are
            # reused.
            connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout),
            # The gateway's own credentials (vLLM's --api-key); an agent's are never forwarded.
            headers={"authorization": f"Bearer {api_key}"} if api_key else None,
        )

    def order(self, rollout_id: str) -> list[str]:
        """Backends to try for a rollout: its own first (keeps its prefix cache warm), then the others."""
        start = zlib.crc32(rollout_id.encode()) % len(self.urls)
        return self.urls[start:] + self.urls[:start]

    async def send(self, rollout_id: str, path: str, body: bytes) -> tuple[str, BackendReply]:
        """POST to the rollout's backend, failing over only when a connection could not be made.

        Raises BackendFailure: unreachable when no backend accepts a connection, timeout, or failed.
        """
        last_error: Exception | None = None
        for url in self.order(rollout_id):
            try:
                response = await self._post(
                    url + path, data=body, headers={"content-type": "application/json"}
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                last_error = exc
                continue
            except TimeoutError as exc:
                raise BackendFailure("timeout", f"backend {url} timed out") from exc
            except aiohttp.ClientError as exc:
                raise BackendFailure("failed", f"backend {url} failed: {exc!r}") from exc
            return url, BackendReply(response)
        message = f"no backend reachable ({', '.join(self.urls)}): {last_error!r}"
        raise BackendFailure("unreachable", message) from last_error

    async def _post(self, url: str, **kwargs: Any) -> aiohttp.ClientResponse:
        """POST, once more if the server closed the connection before answering or before the body was
        written. The usual cause is a pooled idle connection the server closed just as it was reused (the
        request never got through); a server that really went away fails the second attempt too."""
        try:
            return await self._session.post(url, **kwargs)
        except aiohttp.ServerDisconnectedError:
            return await self._session.post(url, **kwargs)
        except aiohttp.ClientOSError as exc:
            if not str(exc.strerror).startswith(_UNWRITTEN):
                raise
            return await self._session.post(url, **kwargs)

    async def probe_scale_out(self, url: str) -> bool | None:
        """Ask a backend for a render: 200 means exact mode works there; None if it cannot be reached."""
        body = {"messages": [{"role": "user", "content": "ping"}]}
        try:
            async with self._session.post(url + "/v1/chat/completions/render", json=body) as response:
                self.scale_out[url] = response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return None
        return self.scale_out[url]

    async def exact_capable(self, rollout_id: str) -> bool:
        url = self.order(rollout_id)[0]
        known = self.scale_out.get(url)
        if known is None:
            known = await self.probe_scale_out(url)
            if known is False:
                log.warning("backend %s lacks --enable-scale-out: exact-mode turns run in pass-through", url)
        return bool(known)

    async def call_all(self, path: str, *, params: dict[str, str] | None = None, json: object = None) -> None:
        """POST to every backend (pause, resume, weight version); 502 names the ones that failed."""
        failures = []
        for url in self.urls:
            try:
                response = await self._post(url + path, params=params, json=json)
                async with response:
                    if response.status != 200:
                        failures.append(f"{url}: HTTP {response.status} {(await response.text())[:200]}")
            except (TimeoutError, aiohttp.ClientError) as exc:
                failures.append(f"{url}: {exc!r}")
        if failures:
            raise BackendFailure("failed", f"{path} failed on " + "; ".join(failures))

    async def get(self, path: str) -> tuple[int, bytes]:
        last_error: Exception | None = None
        for url in self.urls:
            try:
                async with self._session.get(url + path) as response:
                    return response.status, await response.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                last_error = exc
        raise BackendFailure("unreachable", f"no backend reachable: {last_error!r}") from last_error

    async def close(self) -> None:
        await self._session.close()
