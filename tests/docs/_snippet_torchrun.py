"""A loopback stand-in for ``torchrun`` on one machine, for the docs test.

Starts N local ranks of ``SCRIPT ARGS`` (or ``-m MODULE ARGS``) with the variables torchrun
sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR=127.0.0.1,
MASTER_PORT=a free port, TORCHELASTIC_RUN_ID) and fails, stopping the others, as soon as one
rank fails. Accepts ``--nproc-per-node N`` / ``--nproc_per_node=N``, ``--standalone`` and
``--nnodes 1``; any other launcher option is refused, so a page cannot depend on one silently.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

_USAGE = "usage: torchrun [--standalone] [--nnodes 1] --nproc-per-node N (SCRIPT | -m MODULE) ARGS"


def _parse(argv: list[str]) -> tuple[int, list[str]]:
    nproc = 1
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        name, _, value = argv[i][2:].replace("_", "-").partition("=")
        if name == "standalone":
            i += 1
            continue
        if name not in ("nproc-per-node", "nnodes"):
            sys.exit(f"loopback torchrun: option --{name} is not supported here\n{_USAGE}")
        if not value:
            i += 1
            value = argv[i] if i < len(argv) else ""
        if name == "nnodes" and value != "1":
            sys.exit(f"loopback torchrun: one node only (--nnodes {value})\n{_USAGE}")
        if name == "nproc-per-node":
            nproc = int(value)
        i += 1
    target = argv[i:]
    if not target:
        sys.exit(_USAGE)
    return nproc, target


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(procs: list[subprocess.Popen[bytes]]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return int(failed[0]) if failed[0] > 0 else 128 - int(failed[0])
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def main() -> None:
    nproc, target = _parse(sys.argv[1:])
    common = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
              "TORCHELASTIC_RUN_ID": uuid.uuid4().hex, "TORCHELASTIC_RESTART_COUNT": "0"}
    procs = [subprocess.Popen([sys.executable, *target],
                              env={**os.environ, **common, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(nproc)]
    sys.exit(_wait(procs))


if __name__ == "__main__":
    main()
