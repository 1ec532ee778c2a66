"""`gateway` command line: serve, db upgrade, db current.

A mistake ends the command in one line, `PROG: error: WHAT`: exit 2 for what the command line, the
environment or the configuration file says (the usage is one --help away), 1 for what the command met
(a store it cannot reach, a port already taken)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from enum import Enum
from types import FrameType, UnionType
from typing import Any, NoReturn, get_args

from pydantic import SecretStr, ValidationError

from gateway import __version__

try:
    from gateway.logs import configure_logging
    from gateway.settings import CONFIG_VARIABLE, GROUP_HELP, ConfigFileError, Group, Settings, group_of
except ModuleNotFoundError as missing:  # an install for the store's reads alone (a trainer's, an analyst's)
    raise SystemExit(
        f"gateway: the server extra is not installed ({missing.name} is missing): "
        "pip install 'rl-gateway[server]'"
    ) from None

_REPEATABLE = ("backend", "local_render", "kv_events", "lora_policy")
"""Settings given once per item (one flag each)."""
_METAVARS = {
    "backend": "URL",
    "local_render": "'MODEL [ARGS]'",
    "backend_file": "FILE",
    "kv_events": "[URL=]ENDPOINT",
    "lora_policy": "NAME=BASE",
    "db": "URL",
    "public_url": "URL",
    "otlp_endpoint": "URL",
    "sampling": "JSON",
    "policy_version": "VERSION",
}
"""What a flag takes, where its type does not say it (floats are seconds, ints counts, secrets tokens)."""


class _Parser(argparse.ArgumentParser):
    """Usage mistakes in one line, like the command's other errors: the usage is one --help away."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class CommandError(Exception):
    """What the command met that stops it (not a mistake of its arguments): one line, exit 1."""


def _add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of settings by name (`max_turns: 8`, or `max-turns: 8`; lists as YAML lists, "
        "`sampling` as a mapping); the flags and the GATEWAY_* variables override it, and relative paths "
        f"in it are from the working directory [env {CONFIG_VARIABLE}]",
    )


def _add_settings_flags(parser: argparse.ArgumentParser, names: list[str] | None = None) -> None:
    """One flag per settings field (or the named ones), documented with its environment variable; all of
    them in their groups."""
    groups: dict[Group, Any] = {}
    if names is None:
        groups = {group: parser.add_argument_group(group.value, GROUP_HELP[group]) for group in Group}
    for name, field in Settings.model_fields.items():
        if names is not None and name not in names:
            continue
        target = groups.get(group_of(field), parser)
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description} [env GATEWAY_{name.upper()}{_default_text(field.default)}]"
        help_text = help_text.replace("%", "%%")
        if field.annotation is bool:
            target.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif isinstance(field.annotation, type) and issubclass(field.annotation, Enum):
            choices = [member.value for member in field.annotation]
            target.add_argument(flag, choices=choices, default=None, help=help_text)
        else:
            kind = _plain(field.annotation)
            action = "append" if name in _REPEATABLE else "store"
            target.add_argument(
                flag,
                action=action,
                type=kind if kind in (int, float) else str,
                default=None,
                metavar=_METAVARS.get(name) or _metavar(name, kind),
                help=help_text,
            )


def _plain(annotation: Any) -> Any:
    """The annotation less its None (`int | None`: int)."""
    if isinstance(annotation, UnionType):
        kinds = [kind for kind in get_args(annotation) if kind is not type(None)]
        return kinds[0] if len(kinds) == 1 else annotation
    return annotation


def _metavar(name: str, kind: Any) -> str:
    return {float: "SECONDS", int: "N", SecretStr: "TOKEN"}.get(kind, name.upper())


def _default_text(default: Any) -> str:
    if default is None or default == []:
        return ""
    if isinstance(default, bool):
        return f"; default {str(default).lower()}"
    if isinstance(default, Enum):
        return f"; default {default.value}"
    if isinstance(default, list):
        return f"; default {', '.join(default)}"
    return f"; default {default}"


def settings_from(args: argparse.Namespace, names: list[str] | None = None) -> Settings:
    """The settings of the flags given, over the environment, over the configuration file; a bad value ends
    the command with one line naming where it came from."""
    given = flags_given(args, names)
    config = config_file(args)
    try:
        return Settings(_config_file=config, **given)
    except ConfigFileError as exc:
        usage_error(args.prog, str(exc))
    except ValidationError as exc:
        error = exc.errors()[0]
        message = str(error["msg"]).removeprefix("Value error, ")
        usage_error(args.prog, f"{_origin(error['loc'], given, config)}: {message}")


def config_file(args: argparse.Namespace) -> str | None:
    return getattr(args, "config", None) or os.environ.get(CONFIG_VARIABLE) or None


def _origin(loc: tuple[int | str, ...], given: dict[str, Any], config: str | None) -> str:
    """Where the value refused at `loc` came from: its flag, its variable or the file's key (the defaults
    are valid)."""
    name = str(loc[0]) if loc else ""
    variable = "GATEWAY_" + name.upper()
    if name in given:
        where = "--" + name.replace("_", "-")
    elif config is None or any(key.upper() == variable for key in os.environ):
        where = variable
    else:
        where = f"{config}: {name}"
    inner = ".".join(str(part) for part in loc[1:])
    return f"{where}: {inner}" if inner else where


def usage_error(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def flags_given(args: argparse.Namespace, names: list[str] | None = None) -> dict[str, Any]:
    return {
        name: getattr(args, name)
        for name in Settings.model_fields
        if (names is None or name in names) and getattr(args, name, None) is not None
    }


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gateway",
        description="OpenAI-compatible gateway in front of vLLM that records every model call's exact "
        "tokens.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the gateway",
        description="Run the gateway: agents' model calls go through it to the vLLM backends, and every "
        "call's exact tokens are recorded in the store. Each setting is a flag, a GATEWAY_* environment "
        "variable or a key of the --config file, in that order of precedence.",
    )
    _add_config_flag(serve)
    _add_settings_flags(serve)
    serve.set_defaults(prog=serve.prog)

    db = commands.add_parser("db", help="manage the store's schema")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = db_commands.add_parser("upgrade", help="apply the migrations up to a revision (default: head)")
    _add_settings_flags(upgrade, ["db"])
    _add_config_flag(upgrade)
    upgrade.set_defaults(prog=upgrade.prog)
    upgrade.add_argument(
        "--revision", default="head", help="the migration to stop at (default: %(default)s, the latest)"
    )
    current = db_commands.add_parser("current", help="print the database's schema revision")
    _add_settings_flags(current, ["db"])
    _add_config_flag(current)
    current.set_defaults(prog=current.prog)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rollout_store.database import SchemaMismatch, StoreUnreachable

    args = build_parser().parse_args(argv)
    try:
        return _serve(args) if args.command == "serve" else _db(args)
    except (CommandError, StoreUnreachable, SchemaMismatch) as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 1


def _serve(args: argparse.Namespace) -> int:
    from rollout_store.database import ensure_schema

    settings = settings_from(args)
    server: dict[str, Any] = {
        "access_log": False,
        # Longer than clients keep idle connections (httpx and Node 5 s, aiohttp 15 s): with uvicorn's 5 s, a
        # client reusing a connection just as the gateway closed it lost the request (a ReadError).
        "timeout_keep_alive": 75,
        # On SIGTERM uvicorn waits this long for the calls in flight, then cancels them (None: for ever).
        "timeout_graceful_shutdown": settings.shutdown_timeout,
    }
    configure_logging(settings)
    _check_port(settings.host, settings.port)
    ensure_schema(settings.db)  # here, not in the server's start-up: a store it cannot reach is one line
    if settings.workers > 1:
        from gateway.workers.supervisor import serve

        return serve(settings, {**flags_given(args), "_config_file": config_file(args)}, **server)
    import uvicorn

    from gateway.app import create_app

    signal.signal(signal.SIGTERM, _stopped)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level, **server
    )
    return 0


def _stopped(signum: int, frame: FrameType | None) -> NoReturn:
    """SIGTERM is how an orchestrator asks the gateway to stop (Kubernetes, systemd, `docker stop`). uvicorn
    handles it while it serves (it stops taking connections, lets the calls in flight finish, shuts the app
    down), then raises it again under the handler it found: this one, so that a shutdown it asked for ends
    with 0 rather than with the signal (-15, 143), which orchestrators count as a failure."""
    raise SystemExit(0)


def _check_port(host: str, port: int) -> None:
    """Bind the gateway's address once before anything starts: a port already taken is one line, not an
    error after the whole start-up (uvicorn binds once its app has started)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            probe.bind((host, port))
        except OSError as exc:
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            reason = exc.strerror or str(exc)
            raise CommandError(f"cannot listen on {where}: {reason[:1].lower()}{reason[1:]}") from None


def _db(args: argparse.Namespace) -> int:
    from rollout_store import database

    settings = settings_from(args, ["db"])
    if args.db_command == "upgrade":
        from alembic.util import CommandError as RevisionError

        try:
            database.upgrade(settings.db, args.revision)
        except RevisionError as exc:
            usage_error(args.prog, f"--revision: {exc}")
        print(f"{database.display_url(settings.db)} is at revision {args.revision}")
        return 0
    database.reach(settings.db)
    engine = database.make_engine(settings.db)
    try:
        print(database.current_revision(engine) or "empty")
    finally:
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
