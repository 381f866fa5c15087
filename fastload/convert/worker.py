"""``python -m fastload.convert.worker DST GROUP ON_ERROR``: one task in a fresh process.

The torch engine's ranks run their tasks this way, so that the processes that convert
import neither torch nor DALI (a rank imports torch for its process group) and a task that
dies takes only its own process down (the rank retries it). Prints the task's result as
one JSON line on stdout (an exception in the task too: only a process that dies without a
result is retried).
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    from . import task

    dst, group, on_error = (sys.argv[1:] if argv is None else argv)[:3]
    try:
        res = task.run_group(dst, int(group), on_error)
    except Exception as e:  # a failure of the task, not of its process: reported, not retried
        res = {"group": int(group), "error": f"group {group} failed: {type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(res) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
