"""The project's modules as the checks over them read them: which files of a package are modules (the
architecture page names each, the tests' map finds each one's tests), and the scripts that read their imports
(`scripts/check_layers.py`)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def is_package_only(path: Path) -> bool:
    """An `__init__.py` that holds only its docstring, imports and dunder names (`__version__`, `__all__`)."""
    for statement in ast.parse(path.read_text(), str(path)).body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue
        targets = statement.targets if isinstance(statement, ast.Assign) else []
        if targets and all(isinstance(t, ast.Name) and re.fullmatch(r"__\w+__", t.id) for t in targets):
            continue
        return False
    return True


def package_modules(packages: tuple[str, ...]) -> list[str]:
    """Every `.py` file under the packages, from the repository root, but an `__init__.py` that is its package
    alone (`is_package_only`)."""
    paths = sorted(path for package in packages for path in (ROOT / package).rglob("*.py"))
    return [
        str(path.relative_to(ROOT))
        for path in paths
        if not (path.name == "__init__.py" and is_package_only(path))
    ]


def script(name: str) -> ModuleType:
    """`scripts/NAME.py`, which is no package: loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
