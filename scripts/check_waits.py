"""List the places in tests/ that can race the clock (run by `scripts/dev check`; exits 1 if there are any).

- A sleep (`time.sleep`, `asyncio.sleep`, `anyio.sleep`) anywhere but in the poll of the suite's waits
  (`wait_for` and `until` in tests/support/__init__.py): a test waits for a condition, not for a time.
- A client made or called without an explicit timeout (httpx's functions and clients, the `openai` and
  `anthropic` SDKs' clients): their defaults give a connection 5 s, which a loaded machine has exceeded.
  A client on an in-process transport (`transport=`, `http_client=`) opens no connection and needs none.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SLEEPS = {("time", "sleep"), ("asyncio", "sleep"), ("anyio", "sleep")}
CLIENTS = {
    *(("httpx", name) for name in ("get", "post", "put", "patch", "delete", "request", "stream")),
    ("httpx", "Client"),
    ("httpx", "AsyncClient"),
    ("openai", "OpenAI"),
    ("openai", "AsyncOpenAI"),
    ("anthropic", "Anthropic"),
    ("anthropic", "AsyncAnthropic"),
}
WAITS = {("support/__init__.py", "wait_for"), ("support/__init__.py", "until")}
"""The functions whose poll may sleep."""


def dotted(call: ast.Call) -> tuple[str, str] | None:
    function = call.func
    if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name):
        return function.value.id, function.attr
    return None


def findings(path: Path, place: str) -> Iterator[tuple[int, str]]:
    """`place`: the file's path under tests/."""
    tree = ast.parse(path.read_text(), str(path))
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (place, node.name) in WAITS:
            allowed |= {id(inner) for inner in ast.walk(node)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (name := dotted(node)) is None:
            continue
        keywords = {keyword.arg for keyword in node.keywords}
        if name in SLEEPS and id(node) not in allowed:
            yield node.lineno, f"{'.'.join(name)}: wait for a condition (support.wait_for, support.until)"
        elif name in CLIENTS and not keywords & {"timeout", "transport", "http_client"}:
            yield node.lineno, f"{'.'.join(name)} without a timeout: give it support.TIMEOUT"


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    found = [
        f"{path.relative_to(root)}:{line}: {message}"
        for path in sorted((root / "tests").rglob("*.py"))
        for line, message in findings(path, path.relative_to(root / "tests").as_posix())
    ]
    if not found:
        print("no sleep outside a wait, no client without a timeout")
        return 0
    print(*found, sep="\n")
    print(f"{len(found)} place(s) in tests/ can race the clock", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
