"""`gateway` command line: serve, db upgrade, db current."""

from __future__ import annotations

import argparse
import sys
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from gateway import __version__

try:
    from gateway.logs import configure_logging
    from gateway.settings import Settings
except ModuleNotFoundError as missing:  # an install for the store's reads alone (a trainer's, an analyst's)
    raise SystemExit(
        f"gateway: the server extra is not installed ({missing.name} is missing): "
        "pip install 'rl-gateway[server]'"
    ) from None

_REPEATABLE = {"backend": "URL", "local_render": "'MODEL [ARGS]'"}
"""Settings given once per item (one flag each), with what each flag takes."""


def _add_settings_flags(parser: argparse.ArgumentParser, names: list[str] | None = None) -> None:
    """One flag per settings field (or the named ones), documented with its environment variable."""
    for name, field in Settings.model_fields.items():
        if names is not None and name not in names:
            continue
        flag = "--" + name.replace("_", "-")
        env = "GATEWAY_" + name.upper()
        default = field.default
        help_text = f"{field.description or name.replace('_', ' ')} [env {env}; default {default}]"
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif name in _REPEATABLE:
            parser.add_argument(
                flag, action="append", default=None, metavar=_REPEATABLE[name], help=help_text
            )
        elif isinstance(field.annotation, type) and issubclass(field.annotation, StrEnum):
            choices = [member.value for member in field.annotation]
            parser.add_argument(flag, choices=choices, default=None, help=help_text)
        else:
            kind: Any = int if field.annotation is int else float if field.annotation is float else str
            parser.add_argument(flag, type=kind, default=None, metavar=name.upper(), help=help_text)


def settings_from(args: argparse.Namespace, names: list[str] | None = None) -> Settings:
    """The settings of the flags given (over the environment); a bad value ends the command with one line."""
    given = flags_given(args, names)
    try:
        return Settings(**given)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else ""
        flag = "--" + name.replace("_", "-") if name in given else "GATEWAY_" + name.upper()
        message = str(error["msg"]).removeprefix("Value error, ")
        print(f"{args.prog}: error: {flag}: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def flags_given(args: argparse.Namespace, names: list[str] | None = None) -> dict[str, Any]:
    return {
        name: getattr(args, name)
        for name in Settings.model_fields
        if (names is None or name in names) and getattr(args, name, None) is not None
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway",
        description="OpenAI-compatible gateway in front of vLLM that records every model call's exact "
        "tokens.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the gateway", description="Run the gateway HTTP server.")
    _add_settings_flags(serve)
    serve.set_defaults(prog=serve.prog)

    db = commands.add_parser("db", help="manage the store's schema")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = db_commands.add_parser("upgrade", help="apply the migrations up to a revision (default: head)")
    _add_settings_flags(upgrade, ["db"])
    upgrade.set_defaults(prog=upgrade.prog)
    upgrade.add_argument("--revision", default="head")
    current = db_commands.add_parser("current", help="print the database's schema revision")
    _add_settings_flags(current, ["db"])
    current.set_defaults(prog=current.prog)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _serve(args) if args.command == "serve" else _db(args)


def _serve(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    server: dict[str, Any] = {
        "access_log": False,
        # Longer than clients keep idle connections (httpx and Node 5 s, aiohttp 15 s): with uvicorn's 5 s, a
        # client reusing a connection just as the gateway closed it lost the request (a ReadError).
        "timeout_keep_alive": 75,
    }
    if settings.workers > 1:
        from gateway.workers.supervisor import serve

        configure_logging(settings)
        return serve(settings, flags_given(args), **server)
    import uvicorn

    from gateway.app import create_app

    configure_logging(settings)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level, **server
    )
    return 0


def _db(args: argparse.Namespace) -> int:
    from gateway.store import database

    settings = settings_from(args, ["db"])
    if args.db_command == "upgrade":
        database.upgrade(settings.db, args.revision)
        print(f"{database.display_url(settings.db)} is at revision {args.revision}")
        return 0
    engine = database.make_engine(settings.db)
    try:
        print(database.current_revision(engine) or "empty")
    finally:
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
