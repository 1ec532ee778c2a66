"""`gateway serve --config gateway.yaml` (or GATEWAY_CONFIG): a YAML mapping of the settings by name, under
the environment and the command line; whatever in it the gateway cannot use ends the command in one line
naming the file and the key, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import build_parser, main, settings_from
from gateway.settings import Settings
from rollout_store.database import head_revision
from rollout_store.status import Mode


def config(tmp_path: Path, text: str, name: str = "gateway.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def serve_settings(*argv: str) -> Settings:
    """The settings `gateway serve ARGV` would run with."""
    return settings_from(build_parser().parse_args(["serve", *argv]))


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str]:
    """The exit code and standard error of a command that stops before it starts."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    return stopped.value.code, capsys.readouterr().err


def test_a_file_sets_lists_mappings_secrets_and_numbers_by_their_names(tmp_path: Path):
    path = config(
        tmp_path,
        """
backend: [http://a:8000, http://b:8000/]
local_render:
  - /models/a --served-model-name a
  - /models/b
max-turns: 8
max_context_tokens: 4096
mode: exact
sampling: {temperature: 0.7, top_p: 0.9}
control_token: s3cret
rollout_keys: yes
health_interval: 2.5
""",
    )

    settings = serve_settings("--config", path)

    assert settings.backend == ["http://a:8000", "http://b:8000"]
    assert settings.local_render == ["/models/a --served-model-name a", "/models/b"]
    assert (settings.max_turns, settings.max_context_tokens, settings.mode) == (8, 4096, Mode.EXACT)
    assert (settings.rollout_keys, settings.health_interval) == (True, 2.5)
    assert settings.sampling is not None
    assert settings.sampling.model_dump(exclude_none=True) == {"temperature": 0.7, "top_p": 0.9}
    assert settings.control_token is not None and settings.control_token.get_secret_value() == "s3cret"


def test_the_command_line_beats_the_environment_which_beats_the_file_which_beats_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path = config(tmp_path, "max_turns: 1\nmax_context_tokens: 1\nport: 9001\n")
    monkeypatch.setenv("GATEWAY_MAX_TURNS", "2")
    monkeypatch.setenv("GATEWAY_MAX_CONTEXT_TOKENS", "2")

    settings = serve_settings("--config", path, "--max-turns", "3")

    assert (settings.max_turns, settings.max_context_tokens, settings.port, settings.pause_timeout) == (
        3,
        2,
        9001,
        600.0,
    )


def test_gateway_config_names_the_file_when_the_command_line_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("GATEWAY_CONFIG", config(tmp_path, "max_turns: 5\n"))

    assert serve_settings().max_turns == 5
    assert serve_settings("--config", config(tmp_path, "max_turns: 6\n", "other.yaml")).max_turns == 6
    assert Settings().max_turns == 5  # what a worker process builds from its inherited environment


def test_an_empty_file_sets_nothing(tmp_path: Path):
    assert serve_settings("--config", config(tmp_path, "# nothing yet\n")) == serve_settings()


def test_db_upgrade_and_current_take_the_store_from_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    store = tmp_path / "store.db"
    path = config(tmp_path, f"db: sqlite:///{store}\nmax_turns: 4\n")

    assert main(["db", "upgrade", "--config", path]) == 0
    assert main(["db", "current", "--config", path]) == 0

    assert capsys.readouterr().out.splitlines() == [f"sqlite:///{store} is at revision head", head_revision()]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("max_turn: 3\n", "max_turn: unknown setting (did you mean max_turns?)"),
        ("max-turn: 3\n", "max-turn: unknown setting (did you mean max_turns?)"),
        ("colour: blue\n", "colour: unknown setting"),
        ("max-turns: 3\nmax_turns: 4\n", "max_turns: given twice"),
        ("- max_turns: 3\n", "not a mapping of settings (`name: value` lines) but a list"),
        ("max_turns\n", "not a mapping of settings (`name: value` lines) but a string"),
        ("max_turns: [3\n", "line 2: not YAML: expected ',' or ']', but got '<stream end>'"),
        ("max_turns: 0\n", "max_turns: Input should be greater than or equal to 1"),
        (
            "max_turns: many\n",
            "max_turns: Input should be a valid integer, unable to parse string as an integer",
        ),
        (
            "sampling: {temperature: -1}\n",
            "sampling: temperature: Input should be greater than or equal to 0",
        ),
        (
            "log_level: verbose\n",
            "log_level: Input should be 'critical', 'error', 'warning', 'info', 'debug' or 'trace'",
        ),
        (
            "workers: 2\n",
            "workers: several workers need a PostgreSQL store (--db postgresql://...): SQLite takes one "
            "writer",
        ),
    ],
)
def test_what_the_gateway_cannot_use_in_the_file_is_one_line_naming_the_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, error: str
):
    path = config(tmp_path, text)

    assert refused(["serve", "--config", path], capsys) == (2, f"gateway serve: error: {path}: {error}\n")


def test_a_missing_file_is_one_line_whether_the_flag_or_the_variable_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    missing = str(tmp_path / "missing.yaml")

    assert refused(["serve", "--config", missing], capsys) == (
        2,
        f"gateway serve: error: {missing}: no such file\n",
    )
    monkeypatch.setenv("GATEWAY_CONFIG", missing)
    assert refused(["db", "upgrade"], capsys) == (2, f"gateway db upgrade: error: {missing}: no such file\n")


def test_a_bad_value_is_blamed_on_where_it_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    path = config(tmp_path, "max_turns: 0\n")
    monkeypatch.setenv("GATEWAY_PAUSE_TIMEOUT", "soon")

    assert refused(["serve", "--config", path, "--max-turns", "-1"], capsys) == (
        2,
        "gateway serve: error: --max-turns: Input should be greater than or equal to 1\n",
    )
    assert refused(["serve", "--config", path, "--max-turns", "2"], capsys) == (
        2,
        "gateway serve: error: GATEWAY_PAUSE_TIMEOUT: Input should be a valid number, unable to parse string "
        "as a number\n",
    )
