"""The docs' pages and their fenced blocks, as the docs' checks read them (tests/unit/test_docs.py) and the
SQL blocks' run on a store (tests/engine/test_sql_docs.py)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
DOCS_PAGES = PAGES[1:]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# The fenced blocks of a page.

FENCE = re.compile(r"(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)")
NOT_RUN = re.compile(r"<!--\s*not run\b(?P<colon>:?)(?P<reason>.*?)-->")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    """The opening fence's line (from 1); the body starts on the next line."""
    end: int
    """The closing fence's line (the page's last line when the fence is never closed)."""
    language: str
    body: str
    before: str
    """The line just before the opening fence, stripped."""

    @property
    def not_run(self) -> str | None:
        """The reason of the `<!-- not run: ... -->` marker just before the fence, if there is one."""
        marker = NOT_RUN.fullmatch(self.before)
        return marker["reason"].strip() if marker else None

    def at(self, offset: int) -> str:
        """`page:line` of the body's line `offset` (from 0)."""
        return f"{self.page}:{self.line + 1 + offset}"


@functools.cache
def fenced_blocks(page: Path) -> tuple[Block, ...]:
    """The page's fenced blocks, nested fences left inside their block (CommonMark: a fence closes on a
    line of the same character, at least as long, with nothing after it)."""
    lines = page.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.fullmatch(lines[index])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        closing = re.compile(rf"[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*")
        end = next((i for i in range(index + 1, len(lines)) if closing.fullmatch(lines[i])), len(lines))
        body = "\n".join(re.sub(rf"^[ \t]{{0,{indent}}}", "", line) for line in lines[index + 1 : end])
        info = opening["info"].strip().lstrip("{").lstrip(".")
        blocks.append(
            Block(
                page=page_id(page),
                line=index + 1,
                end=min(end + 1, len(lines)),
                language=info.split()[0].rstrip("}") if info else "",
                body=body,
                before=lines[index - 1].strip() if index else "",
            )
        )
        index = end + 1
    return tuple(blocks)


def blocks_of(page: Path, language: str) -> list[Block]:
    return [block for block in fenced_blocks(page) if block.language == language]


def prose_lines(page: Path) -> Iterator[tuple[int, str]]:
    """The page's lines outside fenced blocks, with their numbers (from 1)."""
    fenced = {n for block in fenced_blocks(page) for n in range(block.line, block.end + 1)}
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if number not in fenced:
            yield number, line
