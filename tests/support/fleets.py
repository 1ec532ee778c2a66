"""The gateway's fleet and engine client built by hand, as `gateway.app.wire` builds them from settings, for
tests of placement and of the calls to servers outside an app."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.fleet.engine import EngineClient, turn_client
from gateway.fleet.fleet import Fleet
from gateway.fleet.placement import PinStore


def fleet_of(
    urls: Sequence[str], *, pins: PinStore | None = None, lora_bases: dict[str, str] | None = None
) -> Fleet:
    """Servers placed among without being called (no connections to close when one leaves)."""
    return Fleet(list(urls), left=lambda _url: None, pins=pins, lora_bases=lora_bases)


def engine_client(
    urls: Sequence[str],
    *,
    timeout: float,
    connect_timeout: float,
    max_connections: int,
    max_queued: int,
    api_key: str | None = None,
    eject_after: int = 2,
) -> EngineClient:
    """An engine client on a fleet of its own (pins in this process only)."""
    calls = turn_client(
        timeout=timeout, connect_timeout=connect_timeout, max_connections=max_connections, api_key=api_key
    )
    fleet = Fleet(list(urls), left=calls.forget)
    return EngineClient(
        fleet,
        calls,
        timeout=timeout,
        connect_timeout=connect_timeout,
        max_queued=max_queued,
        api_key=api_key,
        eject_after=eject_after,
    )
