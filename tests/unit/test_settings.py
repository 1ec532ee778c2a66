"""Settings read from the environment the way the flags give them."""

from __future__ import annotations

import pytest

from gateway.settings import Settings


def test_local_render_variable_holds_one_models_arguments_per_semicolon(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(
        "GATEWAY_LOCAL_RENDER", "/models/a --served-model-name a; /models/b --tool-call-parser hermes;"
    )

    assert Settings().local_render == [
        "/models/a --served-model-name a",
        "/models/b --tool-call-parser hermes",
    ]
