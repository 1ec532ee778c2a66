"""`gateway serve --help` groups every setting under one heading (the group is a property of the setting), the
two command lines tell the same version, and the flags that take a fixed set of values list them."""

from __future__ import annotations

import argparse

import pytest

from gateway import __version__
from gateway.cli import build_parser
from gateway.cli import main as gateway
from gateway.settings import Group, Settings, group_of
from trainer_client.cli import main as trainer_client


def serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = commands.choices["serve"]
    return parser


def test_every_setting_has_a_group_and_a_description():
    for field in Settings.model_fields.values():
        assert group_of(field) in Group
        assert field.description


def test_serve_help_lists_every_setting_once_under_its_groups_heading():
    headed = {
        group.title: [action.dest for action in group._group_actions]
        for group in serve_parser()._action_groups
    }

    assert list(headed) == ["positional arguments", "options", *(group.value for group in Group)]
    assert headed["options"] == ["help", "config"]
    assert sorted(dest for group in Group for dest in headed[group.value]) == sorted(Settings.model_fields)
    for name, field in Settings.model_fields.items():
        assert name in headed[group_of(field).value]
    assert headed["server"] == ["host", "port", "public_url", "mode", "local_render", "shutdown_timeout"]
    assert headed["store"] == ["db", "policy_version"]
    assert headed["processes"] == ["workers", "heartbeat_interval", "process_timeout"]


def test_serve_help_prints_the_groups_with_their_descriptions_and_the_log_levels(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("COLUMNS", "200")  # one line per flag's help

    with pytest.raises(SystemExit) as stopped:
        gateway(["serve", "--help"])

    shown = capsys.readouterr().out
    assert stopped.value.code == 0
    assert "\nbackends:\n  The vLLM servers the gateway sends model calls to.\n" in shown
    assert "--log-level {critical,error,warning,info,debug,trace}" in shown
    assert "  --max-turns N " in shown
    assert "[env GATEWAY_PORT; default 8100]" in shown


def test_the_public_url_says_what_agents_are_handed():
    description = Settings.model_fields["public_url"].description or ""

    assert (
        "POST /rollouts answers each rollout's base_url under it (PUBLIC_URL/rollouts/ID/v1)" in description
    )
    assert "Unset: the URL the POST /rollouts request itself came to" in description


def test_both_command_lines_tell_the_same_version(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        gateway(["--version"])
    with pytest.raises(SystemExit):
        trainer_client(["--version"])

    assert capsys.readouterr().out.splitlines() == [f"gateway {__version__}", f"trainer-client {__version__}"]


def test_a_public_url_that_is_no_http_url_is_refused(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as stopped:
        gateway(["serve", "--public-url", "gateway:8100"])

    assert (stopped.value.code, capsys.readouterr().err) == (
        2,
        "gateway serve: error: --public-url: not an http(s) URL (e.g. http://10.0.0.5:8100)\n",
    )
