"""One page's Python interpreter: runs the page's untitled python blocks in order, in one
namespace, as a user pasting them into one script would.

Started by _snippet_run.py with the page's scratch directory as its working directory. Reads
one JSON request per line on stdin, ``{"page": "docs/x.md", "line": 12, "code": "..."}``,
executes it, and answers ``ok`` or ``fail`` on the file descriptor named in argv[1]; what the
block prints and any traceback (with the page's own line numbers) go to stdout/stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _run(request: dict[str, object], namespace: dict[str, object]) -> bool:
    # padded so a traceback names the page's own line numbers
    source = "\n" * int(str(request["line"])) + str(request["code"])
    try:
        exec(compile(source, str(request["page"]), "exec"), namespace)  # noqa: S102
    except SystemExit as exc:
        return exc.code in (None, 0)
    except BaseException:  # noqa: BLE001  (every failure of a block is reported, not raised)
        traceback.print_exc()
        return False
    return True


def main() -> None:
    answers = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    sys.argv = ["snippet"]
    sys.path.insert(0, os.getcwd())
    namespace: dict[str, object] = {"__name__": "__main__"}
    for line in sys.stdin:
        ok = _run(json.loads(line), namespace)
        sys.stdout.flush()
        sys.stderr.flush()
        answers.write("ok\n" if ok else "fail\n")


if __name__ == "__main__":
    main()
