"""The ``dcp-volumes`` command (``python -m dcp_volumes.cli``).

:mod:`~dcp_volumes.cli._main` builds the parser, dispatches and maps errors to exit codes;
one module per command group holds the commands: :mod:`~dcp_volumes.cli.lifecycle` (``ls``,
``latest``; it registers :mod:`~dcp_volumes.cli.examine`'s ``info``, ``verify`` and
:mod:`~dcp_volumes.cli.removal`'s ``rm``, ``gc``), :mod:`~dcp_volumes.cli.plan` (``plan``) and
:mod:`~dcp_volumes.cli.bench` (``bench``). ``_format`` and ``_options`` hold the output and the
options they share.
"""

from __future__ import annotations

from dcp_volumes.cli._main import main

__all__ = ["main"]
