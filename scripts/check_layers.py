"""Check that the packages' imports point one way (run by `scripts/dev check`; exits 1 on any finding).

Every import counts, those under `if TYPE_CHECKING:` and inside functions included: a type-only import
couples two modules as much as any other.

- Each package imports only the packages `PACKAGES` lets it: `rollout_store`, the store's read contract, is
  the bottom and imports none of the others; `training_data` imports it alone, never the gateway;
  `trainer_client` imports both; the gateway imports both, and of the gateway only the viewer imports
  `training_data`. Nothing imports `trainer_client`.
- Each module of `gateway` belongs to one layer of `LAYERS` and imports only from its own layer or lower ones.
- No circle of modules, whatever their layers.
- The agents' dialects (`DIALECTS`) never import one another: what they share is the turn layer's.
- What ships never imports the tests' and demo's `testbed`.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

PACKAGES: dict[str, tuple[str, ...]] = {
    "rollout_store": (),
    "training_data": ("rollout_store",),
    "trainer_client": ("rollout_store", "training_data"),
    "gateway": ("rollout_store", "training_data"),
}
"""The shipped packages, bottom first, and the others each imports: the store's read contract (its tables,
database, packed ids, delta rebuild and statuses) under what trains, under the trainers' client and the
gateway, so that a trainer's reads depend on the store's format alone and never on the gateway's code."""
LAYERS: tuple[tuple[str, ...], ...] = (
    ("gateway.__main__", "gateway.cli", "gateway.workers"),
    ("gateway.app",),
    (
        "gateway.openai",
        "gateway.anthropic",
        "gateway.responses",
        "gateway.control",
        "gateway.admin",
        "gateway.ui",
    ),
    ("gateway.openapi", "gateway.access_log"),
    ("gateway.replicas",),
    ("gateway.settings", "gateway.logs"),
    ("gateway.turns",),
    ("gateway.errors", "gateway.ids", "gateway.auth", "gateway.telemetry"),
    ("gateway.fleet",),
    ("gateway.store",),
    ("gateway.encoding", "gateway.metrics", "gateway"),
)
"""The gateway's layers, top first: the APIs (the agents' dialects, the control, admin and viewer APIs) over
the replicas (the gateway's processes), over the turn path, over its errors, keys and traces, over the vLLM
servers (the fleet), over the store, over the core types. A name is a module or a package with everything
under it; `gateway` alone is the package's own `__init__`."""
DIALECTS = ("gateway.openai", "gateway.anthropic", "gateway.responses")
"""The agent API's dialects: each reads its own wire into the turn layer's calls and writes their replies
back, sharing with the others only what is under them, so that adding or changing one touches no other."""
VIEWER = ("gateway.ui",)
"""The part of the gateway that shows what trains (`training_data`); the serving path never imports it."""


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that `name` imports (a name imported from a package counts as its module when
    it is one, else as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    wanted: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            wanted |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                wanted.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    found = set()
    for module in wanted:
        while module and module not in known:
            module = module.rpartition(".")[0]
        if module and module != name:
            found.add(module)
    return found


def layer(module: str) -> int | None:
    for index, names in enumerate(LAYERS):
        for entry in names:
            if module == entry or (entry != "gateway" and module.startswith(entry + ".")):
                return index
    return None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _within(module: str, names: Iterable[str]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def _dialect(module: str) -> str | None:
    return next((name for name in DIALECTS if _within(module, [name])), None)


def findings(root: Path) -> Iterator[str]:
    known = modules(root, (*PACKAGES, "testbed"))
    graph = {name: imported(name, path, known) for name, path in known.items()}
    for name in sorted(graph):
        if not name.startswith("testbed"):
            yield from _crossings(name, sorted(graph[name]))
    for circle in circles(graph):
        yield f"a circle of {len(circle)} modules: {', '.join(circle)}"


def _crossings(name: str, imports: list[str]) -> Iterator[str]:
    """What `name` imports against the packages' order and the gateway's layers."""
    package = name.split(".")[0]
    own = layer(name) if package == "gateway" else None
    if package == "gateway" and own is None:
        yield f"{name} is in no layer: add it to LAYERS in scripts/check_layers.py"
    for other in imports:
        theirs = other.split(".")[0]
        if theirs == "testbed":
            yield f"{name} imports {other}: what ships never imports the testbed"
        elif theirs != package and theirs not in PACKAGES[package]:
            yield f"{name} imports {other}: {package} imports {_allowed(package)}"
        elif theirs == "training_data" and package == "gateway" and not _within(name, VIEWER):
            yield f"{name} imports {other}: of the gateway, only the viewer reads what trains"
        elif own is not None and (above := layer(other)) is not None and above < own:
            yield f"{name} imports {other}, which is in a layer above it"
        elif (dialect := _dialect(name)) is not None and _dialect(other) not in (None, dialect):
            yield f"{name} imports {other}: a dialect never imports another one"


def _allowed(package: str) -> str:
    allowed = PACKAGES[package]
    return f"only {' and '.join(allowed)} of the other packages" if allowed else "none of the other packages"


def main() -> int:
    found = list(findings(Path(__file__).resolve().parents[1]))
    if not found:
        print("imports point one way: no module imports from a layer above it, no circle")
        return 0
    print(*found, sep="\n")
    print(f"{len(found)} import(s) against the layers", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
