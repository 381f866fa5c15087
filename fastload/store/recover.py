"""``fastload recover DST`` (also ``python -m fastload.store.recover DST``): finish an
overwrite of DST that was killed while it swapped the new dataset in (see :mod:`fastload.store.transaction`). DST then holds exactly
the new dataset, and ``fastload verify DST`` passes. Safe to run on any dataset directory:
without an interrupted swap it changes nothing (or removes what a finished one left)."""
from __future__ import annotations

import sys
from pathlib import Path

from .transaction import recover

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m fastload.store.recover DST", file=sys.stderr)
        return 2
    path = Path(args[0])
    if not path.is_dir():
        print(f"{path} is not a directory", file=sys.stderr)
        return 2
    did = recover(path)
    print(f"{path}: {did or 'no interrupted overwrite to finish'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
