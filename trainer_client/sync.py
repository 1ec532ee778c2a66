"""Weight sync from the trainer's side: pause the gateway (and through it every vLLM backend), let the
caller push new weights, tag them with a new policy version, resume; or, for a LoRA policy, publish the new
adapter version, without a pause."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import httpx


class GatewayAdmin:
    def __init__(self, gateway_url: str, admin_token: str | None = None, timeout: float = 900.0) -> None:
        headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.Client(base_url=gateway_url.rstrip("/"), headers=headers, timeout=timeout)

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self._http.post("/admin" + path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"gateway {path} failed: HTTP {response.status_code} {response.text[:300]}")
        return cast(dict[str, Any], response.json())

    def state(self) -> dict[str, Any]:
        return cast(dict[str, Any], self._http.get("/admin/state").raise_for_status().json())

    def pause(
        self, mode: str = "wait", timeout: float = 600.0, clear_cache: bool | None = None
    ) -> dict[str, Any]:
        """`clear_cache`: whether the servers drop their caches (None: the gateway's --pause-clear-cache)."""
        body: dict[str, Any] = {"mode": mode, "timeout": timeout}
        if clear_cache is not None:
            body["clear_cache"] = clear_cache
        return self._post("/pause", body)

    def resume(self) -> dict[str, Any]:
        return self._post("/resume")

    def set_policy_version(self, version: str) -> dict[str, Any]:
        return self._post("/policy_version", {"version": version})

    def reload_weights(self) -> dict[str, Any]:
        """Every backend reloads its weights from its model directory (after the trainer wrote them there)."""
        return self._post("/reload_weights")

    def publish_adapter(self, policy: str, version: str, path: str) -> dict[str, Any]:
        """Publish a LoRA policy's new version: every server of its base loads the adapter at `path` (a
        directory in PEFT's format that every server reads, one of its own for each version) and the policy's
        new calls go to it; no pause. The gateway's state after it (`adapters`, and each backend's
        `adapter_errors`)."""
        return self._post("/adapters", {"policy": policy, "version": version, "path": path})

    @contextmanager
    def weight_sync(
        self, version: str, mode: str = "wait", timeout: float = 600.0, clear_cache: bool | None = None
    ) -> Iterator[dict[str, Any]]:
        """Pause and drain; the body pushes the weights; then the new version is set and generation resumes.

        Generation resumes even if the body fails (the version then stays the old one).
        """
        paused = self.pause(mode, timeout, clear_cache)
        try:
            yield paused
            self.set_policy_version(version)
        finally:
            self.resume()

    def close(self) -> None:
        self._http.close()
