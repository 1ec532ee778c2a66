"""`gateway` command line."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("not yet", file=sys.stderr)
    return 1
