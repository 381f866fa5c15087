"""``python -m fastload.convert.worker DST ON_ERROR``: a conversion worker process.

Reads group numbers from stdin, one per line, runs each task (``task.run_group``) and
writes its result as one JSON line to stdout. The torch engine's ranks run their tasks in
such processes: the processes that convert never import torch (a rank imports torch for its
process group; image sources load DALI's CPU decoder, the Loader's, to check every image),
they start once rather than once per task, and a task that
kills its process takes only that process down (the rank starts a new one and retries the
task). An exception in a task is a result too (``{"error": ...}``): only a process that
dies without answering is retried.
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    from . import task

    dst, on_error = (sys.argv[1:] if argv is None else argv)[:2]
    for line in sys.stdin:
        if not line.strip():
            continue
        group = int(line)
        try:
            res = task.run_group(dst, group, on_error)
        except Exception as e:
            res = {"group": group, "error": f"group {group} failed: {type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(res) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
