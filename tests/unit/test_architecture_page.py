"""docs/design/architecture.md names every module of `gateway/` and `rollout_store/` with what it is for, and
no path that is gone.

A module is every `.py` file under those packages, except an `__init__.py` that holds nothing but its
docstring, imports, and dunder names (`__all__`, `__version__`): such a file is its package, which the page
names by its heading. An `__init__.py` that holds code is a module like any other.

The page names a module as a row of one of its tables: the module's path from the repository root in
backticks in the first cell, its purpose in the second (`| `gateway/fleet/prefixes.py` | ... |`), under the
heading whose first backticked path is the module's package (`### `gateway/fleet/`: ...`). Any other
backticked path of the page (a path with a `/`, ending in `/` or `.py`, outside code blocks) must name a file
or directory of the repository, and a module is never named by its file name alone (`prefixes.py`), which
the check could not tell from another package's.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from support.docs import ROOT, page_id, prose_lines
from support.modules import is_package_only, package_modules

PAGE = ROOT / "docs" / "design" / "architecture.md"
ROW = re.compile(r"\|\s*`(?P<path>[^`]+)`\s*\|(?P<purpose>[^|]*)\|")
CODE_SPAN = re.compile(r"`(?P<text>[^`]+)`")
PATH = re.compile(r"(?:[\w.-]+/)+(?:[\w.-]+\.py)?")
BARE_MODULE = re.compile(r"[\w-]+\.py")

PACKAGES = ("gateway", "rollout_store")
"""The packages whose every module the page names: the gateway and the store's read contract under it."""
MODULES = package_modules(PACKAGES)


def test_an_init_holding_only_its_docstring_imports_and_dunders_is_its_package(tmp_path: Path) -> None:
    docstring_only = tmp_path / "a.py"
    docstring_only.write_text('"""The package."""\n')
    reexports = tmp_path / "b.py"
    reexports.write_text('"""The package."""\n\nfrom x import y\n\n__all__ = ["y"]\n__version__ = "0.1.0"\n')
    code = tmp_path / "c.py"
    code.write_text('"""The package."""\n\nLIMIT = 3\n')
    assert [is_package_only(path) for path in (docstring_only, reexports, code)] == [True, True, False]


@functools.cache
def rows() -> tuple[tuple[int, str, str, str], ...]:
    """The page's module rows: (line, path, purpose, the first code span of the heading they are under)."""
    found, heading = [], ""
    for number, line in prose_lines(PAGE):
        if line.startswith("#"):
            heading = span["text"] if (span := CODE_SPAN.search(line)) else ""
        elif row := ROW.fullmatch(line.strip()):
            found.append((number, row["path"], row["purpose"].strip(), heading))
    return tuple(found)


@pytest.mark.parametrize("module", MODULES)
def test_the_page_names_the_module_with_its_purpose(module: str) -> None:
    purposes = [purpose for _, path, purpose, _ in rows() if path == module]
    assert purposes, (
        f"{module} is a module of {Path(module).parts[0]}/ that {page_id(PAGE)} does not name: add the row "
        f"| `{module}` | <what it is for> | to its package's table"
    )
    assert all(purposes), f"{page_id(PAGE)}: the row of {module} says nothing of what it is for"


def test_the_page_names_each_module_once() -> None:
    paths = [path for _, path, _, _ in rows()]
    repeated = sorted({path for path in paths if paths.count(path) > 1})
    assert not repeated, f"{page_id(PAGE)} has more than one row for {', '.join(repeated)}"


def test_each_row_names_a_module_of_the_packages() -> None:
    problems = [
        f"{page_id(PAGE)}:{number}: `{path}` is not a module of {' or '.join(f'{p}/' for p in PACKAGES)}"
        + (
            " (an __init__.py of nothing but its docstring is named by its package's heading)"
            if path.endswith("/__init__.py")
            else ""
        )
        for number, path, _, _ in rows()
        if path not in MODULES
    ]
    assert not problems, "\n".join(problems)


def test_each_module_is_under_its_packages_heading() -> None:
    problems = [
        f"{page_id(PAGE)}:{number}: `{path}` is under the heading of `{heading}`, not of its package "
        f"`{Path(path).parent}/`"
        for number, path, _, heading in rows()
        if heading != f"{Path(path).parent}/"
    ]
    assert not problems, "\n".join(problems)


def test_every_path_the_page_names_exists() -> None:
    problems = []
    for number, line in prose_lines(PAGE):
        for span in CODE_SPAN.finditer(line):
            text = span["text"]
            if PATH.fullmatch(text) and not (ROOT / text).exists():
                problems.append(f"{page_id(PAGE)}:{number}: `{text}` names no file of the repository")
            elif BARE_MODULE.fullmatch(text) and text != "__init__.py":
                problems.append(
                    f"{page_id(PAGE)}:{number}: `{text}`: name a module by its path from the repository root"
                )
    assert not problems, "\n".join(problems)
