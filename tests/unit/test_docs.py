"""The docs say what the code does: every fenced block of README.md and docs/ is checked by its language tag
as the docs conventions say (sh lines are parsed by the parsers of the commands they run, python blocks
include an example or compile, yaml and json parse), the generated references are what their script writes
now, and the site's nav and the pages agree. Each rule is one test per page, so a failure names the page;
its message names the line.

A block preceded by `<!-- not run: <reason> -->` (on the line just before its fence) is only parsed where its
language allows. The SQL blocks run on a populated store in tests/engine/test_sql_docs.py.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import functools
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import symtable
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from support import examples
from support.docs import (
    DOCS_PAGES,
    FENCE,
    NOT_RUN,
    PAGES,
    README,
    ROOT,
    Block,
    blocks_of,
    fenced_blocks,
    page_id,
    prose_lines,
)

REPOSITORY = "https://github.com/rl-gateway/rl-gateway/"
REFERENCE_SCRIPT = ROOT / "scripts" / "docs_reference.py"
GENERATED = ["docs/reference/cli.md", "docs/reference/configuration.md"]
LANGUAGES = ("text", "sql", "sh", "python", "yaml", "json")
SH_SHAPES = (
    "gateway ..., trainer-client ..., pip install ..., pip uninstall -y ..., scripts/dev TASK, "
    "vllm serve ..., python -m vllm.entrypoints.openai.api_server ..., python examples/FILE.py ..., "
    "curl ..., export NAME=value, python -m testbed.tiny_model DIR, python -m testbed.vllm_server DIR, "
    "mkdocs build|serve ..."
)
CODE = (
    "gateway",
    "rollout_store",
    "trainer_client",
    "training_data",
    "testbed",
    "tests",
    "bench",
    "scripts",
    "examples",
)
UNMARKED = "mark the block <!-- not run: <reason> --> if it is not meant to run as it stands"


def report(problems: list[str]) -> str:
    return "\n".join(problems)


# Blocks and their languages.


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_names_a_language_the_conventions_check(page: Path) -> None:
    problems = [
        f"{block.page}:{block.line}: "
        f"{f'a block tagged {block.language!r}' if block.language else 'a block with no language tag'}: "
        f"tag it one of {', '.join(LANGUAGES)}"
        for block in fenced_blocks(page)
        if block.language not in LANGUAGES
    ]
    assert not problems, report(problems)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_not_run_markers_give_a_reason(page: Path) -> None:
    problems = [
        f"{page_id(page)}:{number}: a not-run marker without a reason: <!-- not run: <reason> -->"
        for number, line in prose_lines(page)
        if (marker := NOT_RUN.fullmatch(line.strip())) and not (marker["colon"] and marker["reason"].strip())
    ]
    assert not problems, report(problems)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_not_run_markers_stand_just_before_a_fence(page: Path) -> None:
    lines = page.read_text().splitlines()
    problems = [
        f"{page_id(page)}:{number}: a not-run marker marks the block whose fence is on the very next line"
        for number, line in prose_lines(page)
        if NOT_RUN.fullmatch(line.strip()) and not (number < len(lines) and FENCE.fullmatch(lines[number]))
    ]
    assert not problems, report(problems)


# sh: every line one of the commands the conventions list, parsed by that command's own parser.


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_sh_lines_are_commands_their_parsers_accept(page: Path) -> None:
    problems = [problem for block in blocks_of(page, "sh") for problem in sh_problems(block)]
    assert not problems, report(problems)


def sh_problems(block: Block) -> list[str]:
    if block.not_run is not None:
        checked = subprocess.run(["bash", "-n"], input=block.body, capture_output=True, text=True)
        return [f"{block.at(0)}: not shell syntax: {checked.stderr.strip()}"] if checked.returncode else []
    problems = []
    for offset, line in sh_lines(block.body):
        try:
            argv = shell_words(line)
        except ValueError as exc:
            problems.append(f"{block.at(offset)}: cannot be split into words ({exc}): {line}")
            continue
        if argv and (problem := command_problem(argv)):
            problems.append(f"{block.at(offset)}: {problem}\n    {line}")
    return problems


def sh_lines(body: str) -> Iterator[tuple[int, str]]:
    """Each command with its first line's offset, `\\` continuations joined."""
    pending, start = "", 0
    for offset, line in enumerate(body.splitlines()):
        if not pending:
            start = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""
    if pending:
        yield start, pending


def shell_words(line: str) -> list[str]:
    """The line's words as the shell splits them, comments dropped and operators (| && ; > ...) apart."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def command_problem(argv: list[str]) -> str | None:
    operators = [word for word in argv if set(word) <= set("();<>|&")]
    if operators:
        return (
            f"the shell operator {operators[0]!r}: one command a line, each of the checked shapes; {UNMARKED}"
        )
    match argv:
        case ["gateway", *args]:
            return parse_problem(gateway_parser(), args)
        case ["trainer-client", *args]:
            return parse_problem(trainer_client_parser(), args)
        case ["pip", "install", *args]:
            return pip_problem(args)
        case ["pip", "uninstall", "-y", *packages] if packages:
            return None
        case ["scripts/dev", task, *_] if task in dev_tasks():
            return None
        case ["scripts/dev", *rest]:
            tasks = ", ".join(sorted(dev_tasks()))
            return (
                f"scripts/dev has no task {rest[0]!r} (its tasks: {tasks})"
                if rest
                else f"scripts/dev TASK: {tasks}"
            )
        case ["vllm", "serve", *args]:
            return vllm_problem(vllm_parsers()[0], ["serve", *args])
        case ["python", "-m", "vllm.entrypoints.openai.api_server", *args]:
            return vllm_problem(vllm_parsers()[1], args)
        case ["python", script, *args] if script.startswith("examples/"):
            return example_problem(script, args)
        case ["curl", *args]:
            return curl_problem(args)
        case ["export", *assignments] if assignments:
            return export_problem(assignments)
        case ["python", "-m", "testbed.tiny_model" | "testbed.vllm_server" as module, *args]:
            return parse_problem(importlib.import_module(module).build_parser(), args)
        case ["mkdocs", *args]:
            return mkdocs_problem(args)
    return f"not one of the checked shapes ({SH_SHAPES}); {UNMARKED}"


def parse_problem(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """What the parser says against the arguments (argparse prints its error and exits), if anything."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as stop:
        if stop.code:
            said = errors.getvalue().strip().splitlines()
            return said[-1] if said else f"{parser.prog} exits {stop.code}"
    return None


def mkdocs_problem(args: list[str]) -> str | None:
    """What MkDocs' own command line (click) says against the arguments, if anything."""
    import click
    from mkdocs.__main__ import cli

    if not args:
        return "mkdocs COMMAND"
    context = click.Context(cli)
    command = cli.get_command(context, args[0])
    if command is None:
        return f"mkdocs has no command {args[0]!r} (its commands: {', '.join(cli.list_commands(context))})"
    try:
        command.make_context(args[0], args[1:])
    except click.UsageError as exc:
        return f"mkdocs {args[0]}: {exc.format_message()}"
    return None


@functools.cache
def gateway_parser() -> argparse.ArgumentParser:
    from gateway.cli import build_parser

    return build_parser()


@functools.cache
def trainer_client_parser() -> argparse.ArgumentParser:
    from trainer_client.cli import build_parser

    return build_parser()


@functools.cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pip_problem(args: list[str]) -> str | None:
    """The project's extras named must exist; requirement and constraint files too."""
    extras = set(pyproject()["project"]["optional-dependencies"])
    names = iter(args)
    for arg in names:
        if arg in ("-r", "--requirement", "-c", "--constraint"):
            listed = next(names, "")
            if not (ROOT / listed).is_file():
                return f"pip install {arg} {listed}: no such file in the repository"
            continue
        requirement = re.fullmatch(r"(?P<name>[\w.\-/]+)\[(?P<extras>[^\]]*)\].*", arg)
        if requirement is None or not is_this_project(requirement["name"]):
            continue
        unknown = [extra.strip() for extra in requirement["extras"].split(",") if extra.strip() not in extras]
        if unknown:
            known = ", ".join(sorted(extras))
            return f"rl-gateway has no extra {', '.join(unknown)} (pyproject.toml's: {known})"
    return None


def is_this_project(name: str) -> bool:
    return name in (".", "./") or re.sub(r"[-_.]+", "-", name).lower() == pyproject()["project"]["name"]


@functools.cache
def dev_tasks() -> frozenset[str]:
    """The tasks scripts/dev runs: the patterns of its `case "$task"` lists and the tasks it tests for."""
    script = (ROOT / "scripts" / "dev").read_text()
    tasks = set(re.findall(r'"\$task" = ([\w-]+)', script))
    for cases in re.findall(r'case "\$task" in\n(.*?)\n\s*esac', script, flags=re.DOTALL):
        for patterns in re.findall(r"^\s*([\w| -]+)\)", cases, flags=re.MULTILINE):
            tasks.update(pattern.strip() for pattern in patterns.split("|"))
    return frozenset(tasks)


@functools.cache
def vllm_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """`vllm` with its `serve` subcommand, and the API server module's parser: vLLM's own arguments
    (make_arg_parser, as vllm.entrypoints.cli.serve adds them, without importing the engine as that module
    does), built once (the import takes seconds) and only for a page that has such a line."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli = FlexibleArgumentParser(prog="vllm")
    make_arg_parser(cli.add_subparsers(dest="subparser").add_parser("serve"))
    api_server = make_arg_parser(FlexibleArgumentParser(prog="python -m vllm.entrypoints.openai.api_server"))
    return cli, api_server


def vllm_problem(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """vLLM's parser also raises (a model given as a flag beside --served-model-name, a missing --config)."""
    try:
        return parse_problem(parser, args)
    except Exception as exc:
        return f"vLLM's parser: {exc}"


def example_problem(script: str, args: list[str]) -> str | None:
    path = ROOT / script
    if not path.is_file():
        return f"{script} does not exist"
    try:
        example = examples.example(path.stem)  # as `python examples/NAME.py` imports what is beside it
    except Exception as exc:
        return f"importing {script} fails: {type(exc).__name__}: {exc}"
    build_parser = getattr(example, "build_parser", None)
    if not callable(build_parser):
        return None
    parser = build_parser()
    parser.prog = f"python {script}"
    return parse_problem(parser, args)


CURL_DATA = {"-d", "--data", "--data-raw", "--data-binary", "--data-urlencode", "--json", "-F", "--form"}
CURL_VALUES = CURL_DATA | {"-H", "--header", "-X", "--request", "-o", "--output", "-u", "--user", "-m"}
CURL_VALUES |= {"--max-time", "-w", "--write-out", "-A", "--user-agent", "--connect-timeout", "--retry"}
"""curl's options that take a value: the URL is the word left (or --url's)."""


def curl_problem(args: list[str]) -> str | None:
    """The URL's path (after a host or a `$VARIABLE` standing for one) must be a route of the gateway that
    answers the call's method (-X, else POST with data, HEAD with -I, else GET)."""
    urls, method, sends_data = [], "", False
    words = iter(args)
    for word in words:
        if word in CURL_VALUES:
            value = next(words, "")
            method = value if word in ("-X", "--request") else method
            sends_data = sends_data or word in CURL_DATA
        elif word.startswith("-X"):
            method = word[2:]
        elif word in ("-I", "--head"):
            method = "HEAD"
        elif not word.startswith("-"):
            urls.append(word)
    if len(urls) != 1:
        return f"curl with {len(urls)} URLs: one URL a line"
    method = method.upper() or ("POST" if sends_data else "GET")
    return route_problem(method, url_path(urls[0]))


def url_path(url: str) -> str:
    rest = re.sub(r"^\$(\{\w+\}|\w+)", "", url)
    if rest.startswith("/") or not rest:
        return urlsplit("http://host" + rest).path or "/"
    return urlsplit(rest if "://" in rest else "http://" + rest).path or "/"


def route_problem(method: str, path: str) -> str | None:
    from starlette.routing import Match

    scope = {"type": "http", "path": path, "method": method, "root_path": ""}
    matches = {route.matches(scope)[0] for route in gateway_routes()}
    if Match.FULL in matches:
        return None
    if Match.PARTIAL in matches:
        return f"{method} {path}: the gateway has this path, but not for {method}"
    return f"{path}: no route of the gateway (gateway.app.create_app) has this path"


@functools.cache
def gateway_routes() -> list[Any]:
    """The app's routes: building it opens nothing (its store and backends start with the app)."""
    from gateway.app import create_app
    from gateway.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        return list(create_app(Settings(db=f"sqlite:///{tmp}/routes.db")).routes)


def export_problem(assignments: list[str]) -> str | None:
    for assignment in assignments:
        name = assignment.partition("=")[0]
        if not re.fullmatch(r"[A-Za-z_]\w*=.*", assignment, flags=re.DOTALL):
            return f"export {assignment}: not NAME=value"
        if name.startswith("GATEWAY_") and name not in gateway_variables():
            return f"{name}: neither a gateway setting nor a variable the repository's code reads"
    return None


@functools.cache
def gateway_variables() -> frozenset[str]:
    """The settings' variables, and the GATEWAY_* variables named in the code (scripts/dev's, the tests')."""
    from gateway.settings import Settings

    prefix = str(Settings.model_config.get("env_prefix", ""))
    named: set[str] = {prefix + name.upper() for name in Settings.model_fields}
    code = [ROOT / "scripts" / "dev", *(path for folder in CODE for path in (ROOT / folder).rglob("*.py"))]
    for path in code:
        named.update(re.findall(r"\bGATEWAY_[A-Z0-9_]+", path.read_text(errors="replace")))
    return frozenset(named)


# python: an include of an examples/ file, or a marked block that compiles and defines every name it uses.

SNIPPET = re.compile(r'--8<--\s+"(?P<path>[^"]+)"')
PYTHON_UNMARKED = (
    'neither an include of an examples/ file (--8<-- "examples/NAME.py", alone in its block) nor marked '
    "<!-- not run: <reason> -->"
)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_blocks_include_an_example_or_are_marked_and_compile(page: Path) -> None:
    problems = [problem for block in blocks_of(page, "python") for problem in python_problems(block)]
    assert not problems, report(problems)


def python_problems(block: Block) -> list[str]:
    lines = [line.strip() for line in block.body.splitlines() if line.strip()]
    includes = [SNIPPET.fullmatch(line) for line in lines]
    if lines and all(includes):
        return [
            f"{block.at(0)}: {include['path']}: no such file (an include names a file of examples/)"
            for include in includes
            if include and not is_example(include["path"])
        ]
    if any(includes):
        return [
            f"{block.at(0)}: a snippet include shares its block with code: an include is alone in its block"
        ]
    problems = [] if block.not_run is not None else [f"{block.at(-1)}: {PYTHON_UNMARKED}"]
    try:
        undefined = undefined_names(block.body, block.at(0))
    except SyntaxError as exc:
        return [*problems, f"{block.at((exc.lineno or 1) - 1)}: does not compile: {exc.msg}"]
    if undefined:
        problems.append(f"{block.at(0)}: uses names it never defines or imports: {', '.join(undefined)}")
    return problems


def is_example(include: str) -> bool:
    path = include.split(":")[0]
    return path.startswith("examples/") and (ROOT / path).is_file()


def undefined_names(source: str, filename: str) -> list[str]:
    """Names the code reads from the module's scope that nothing there binds, nor builtins."""
    compile(source, filename, "exec", dont_inherit=True)
    module = symtable.symtable(source, filename, "exec")
    bound = {
        symbol.get_name() for symbol in module.get_symbols() if symbol.is_assigned() or symbol.is_imported()
    }
    bound |= set(dir(builtins)) | {"__file__"}
    return sorted(name for name in module_reads(module) if name not in bound)


def module_reads(table: symtable.SymbolTable) -> set[str]:
    """Names read at module level, or read as globals in the functions and classes the module holds."""
    names = {
        symbol.get_name()
        for symbol in table.get_symbols()
        if symbol.is_referenced() and (table.get_type() == "module" or symbol.is_global())
    }
    for child in table.get_children():
        names |= module_reads(child)
    return names


# yaml and json.


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_yaml_blocks_are_gateway_configurations_or_marked_and_parse(
    page: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [name for name in os.environ if name.upper().startswith("GATEWAY_")]:
        monkeypatch.delenv(name)  # a block is judged alone, not over this shell's settings
    problems = [problem for block in blocks_of(page, "yaml") for problem in yaml_problems(block)]
    assert not problems, report(problems)


def yaml_problems(block: Block) -> list[str]:
    try:
        list(yaml.safe_load_all(block.body))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        return [f"{block.at(mark.line if mark else 0)}: not YAML: {getattr(exc, 'problem', None) or exc}"]
    if block.not_run is not None:
        return []
    problem = configuration_problem(block.body)
    return (
        [f"{block.at(-1)}: {problem} (other YAML than a gateway configuration is marked)"] if problem else []
    )


def configuration_problem(text: str) -> str | None:
    """What `gateway serve --config FILE` says of the file as it builds its settings."""
    from gateway.cli import settings_from

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gateway.yaml"
        path.write_text(text)
        args = gateway_parser().parse_args(["serve", "--config", str(path)])
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                settings_from(args)
        except SystemExit:
            return errors.getvalue().strip().replace(str(path), "the block")
    return None


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_json_blocks_parse(page: Path) -> None:
    problems = []
    for block in blocks_of(page, "json"):
        try:
            json.loads(block.body)
        except json.JSONDecodeError as exc:
            problems.append(f"{block.at(exc.lineno - 1)}: not JSON: {exc.msg} (column {exc.colno})")
    assert not problems, report(problems)


# The generated references.


@pytest.mark.parametrize("path", GENERATED)
def test_generated_reference_is_what_its_script_writes_now(path: str) -> None:
    committed = (ROOT / path).read_text() if (ROOT / path).exists() else None
    assert committed == generated_references()[Path(path)], (
        f"{path} differs from what scripts/docs_reference.py writes now: "
        "run `python scripts/docs_reference.py`"
    )


@functools.cache
def generated_references() -> dict[Path, str]:
    spec = importlib.util.spec_from_file_location("docs_reference", REFERENCE_SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    pages: dict[Path, str] = script.render()
    return pages


# The site's nav.


class _ConfigLoader(yaml.SafeLoader):
    """mkdocs.yml may name Python objects (`!!python/name:...`, for Material's extensions): kept unbuilt."""


_ConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


@functools.cache
def nav_pages() -> tuple[str, ...]:
    """The pages mkdocs.yml's nav lists, as paths from the repository root (links elsewhere left out)."""
    if not (ROOT / "mkdocs.yml").is_file():
        pytest.fail("mkdocs.yml does not exist: its nav lists the docs pages", pytrace=False)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_ConfigLoader)
    docs_dir = config.get("docs_dir", "docs")

    def entries(node: Any) -> Iterator[str]:
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from entries(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from entries(value)

    return tuple(f"{docs_dir}/{entry}" for entry in entries(config.get("nav", [])) if "://" not in entry)


def test_every_nav_entry_is_a_page() -> None:
    missing = [entry for entry in nav_pages() if not (ROOT / entry).is_file()]
    assert not missing, f"mkdocs.yml's nav lists pages that do not exist: {', '.join(missing)}"


@pytest.mark.parametrize("page", DOCS_PAGES, ids=page_id)
def test_every_docs_page_is_in_the_nav(page: Path) -> None:
    assert page_id(page) in nav_pages(), f"{page_id(page)} is not in mkdocs.yml's nav"


# README.md: the package's long description on the index.

LINK = re.compile(
    r"\]\((?P<md>[^)\s]+)[^)]*\)|^\s*\[[^\]]+\]:\s*(?P<ref>\S+)|(?:href|src)=\"(?P<html>[^\"]+)\""
)


def test_readme_has_at_most_200_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines: at most 200 (the rest belongs in docs/)"


def readme_links() -> list[tuple[int, str]]:
    """README.md's link targets outside code, with their lines."""
    found = []
    for number, line in prose_lines(README):
        prose = re.sub(r"`[^`]*`", "", line)
        found += [
            (number, next(target for target in link.groups() if target)) for link in LINK.finditer(prose)
        ]
    return found


def test_readme_links_are_absolute() -> None:
    relative = [
        f"README.md:{number}: {target}"
        for number, target in readme_links()
        if not re.match(r"(https?://|mailto:)", target)
    ]
    assert not relative, f"README.md links are absolute ({REPOSITORY}blob/main/<path>):\n" + report(relative)


def test_readme_links_into_the_repository_name_its_files() -> None:
    broken = []
    for number, target in readme_links():
        inside = re.match(rf"{re.escape(REPOSITORY)}(?:blob|tree)/main/(?P<path>[^#?]*)", target)
        if inside and not (ROOT / inside["path"]).exists():
            broken.append(f"README.md:{number}: {target}: no {inside['path']} in the repository")
    assert not broken, report(broken)
