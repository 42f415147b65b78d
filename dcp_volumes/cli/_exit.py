"""The program name and exit codes of ``dcp-volumes`` (stable; scripts rely on them).

Shared by the dispatcher (:mod:`~dcp_volumes.cli._main`) and the command modules, which
import them from here rather than from the dispatcher that imports them.
"""

from __future__ import annotations

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_NOT_FOUND", "EXIT_OK", "EXIT_USAGE", "PROG"]

PROG = "dcp-volumes"
#: success
EXIT_OK = 0
#: a store error, or ``verify`` found a mismatch
EXIT_FAILURE = 1
#: usage or configuration error (bad flag, bad URL, bad option, a path that is not usable)
EXIT_USAGE = 2
#: no checkpoint, an incomplete one, a missing bucket, or no complete checkpoint for ``latest``
EXIT_NOT_FOUND = 3
#: Ctrl-C
EXIT_INTERRUPTED = 130
