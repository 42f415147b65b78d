"""The ``dcp-volumes`` command: the parser, dispatch and exit codes.

Commands live in one module per group (:mod:`~dcp_volumes.cli.lifecycle`,
:mod:`~dcp_volumes.cli.export`, :mod:`~dcp_volumes.cli.plan`, :mod:`~dcp_volumes.cli.bench`); each has a
``register(sub, common)`` that adds its subcommands, listed in :func:`_command_groups` in
``dcp-volumes --help`` order. A subcommand is two functions. ``_add_<name>(sub, common)``
declares its parser with ``sub.add_parser("<name>", parents=[common], ...)`` (``common``
carries ``--debug``) and calls ``set_defaults(handler=_run_<name>)``; ``_run_<name>(args) -> int``
does the work and returns the exit code. ``--json`` output goes through
:func:`~dcp_volumes.cli._format.print_json`. Commands that touch storage also take
``parents=[storage_options_parser()]`` (``--endpoint-url``, ``--storage-option``, ``--anon``)
and build their fsspec options with :func:`~dcp_volumes.cli._options.storage_options_for`.
Handlers raise; they never print errors or call ``sys.exit``: :func:`main` turns
``dcp_volumes.errors`` exceptions, ``OSError`` and ``ValueError`` into one line
``dcp-volumes: error: ...`` on stderr (the traceback only with ``--debug``) and picks the exit
code. Exit codes (stable; scripts rely on them; defined in :mod:`~dcp_volumes.cli._exit`):

* 0 -- success.
* 1 -- failure: a store error, or ``verify`` found a mismatch.
* 2 -- usage or configuration error (bad flag, bad URL, bad option).
* 3 -- not found: no checkpoint, an incomplete one, a missing bucket, or ``latest`` found no
  complete checkpoint.
* 130 -- interrupted (Ctrl-C).

The commands import torch only where they must unpickle ``.metadata`` (``info``, ``verify``,
``gc``); ``ls``, ``latest``, ``rm`` and ``plan`` start fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from dcp_volumes.cli import bench, export, lifecycle, plan
from dcp_volumes.cli._exit import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
)
from dcp_volumes.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    ConfigError,
    DCPVolumesError,
    IncompleteCheckpointError,
)

__all__ = [
    "EXIT_FAILURE",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "build_parser",
    "main",
]

Handler = Callable[[argparse.Namespace], int]
Registrar = Callable[[Any, argparse.ArgumentParser], None]


class _UsageError(ConfigError):
    """The command line itself is wrong (unknown flag, bad value type, missing argument)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors go through :func:`main`'s one-line error path."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _common_options() -> argparse.ArgumentParser:
    # Shared by the top-level parser and every subparser, so `--debug` works on either side of
    # the subcommand. SUPPRESS keeps a subparser's default from overwriting the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log at DEBUG and show full tracebacks on errors",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    """The ``dcp-volumes`` argument parser with every registered subcommand."""
    common = _common_options()
    parser = _Parser(
        prog=PROG,
        description="PyTorch Distributed Checkpoint on object storage: tools.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in _command_groups():
        register(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``dcp-volumes``; returns the process exit code.

    Args:
        argv: Arguments after the program name; ``None`` reads ``sys.argv[1:]``.
    """
    args_list = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args_list
    try:
        args = build_parser().parse_args(args_list)
        debug = bool(getattr(args, "debug", False))
        logging.basicConfig(
            level=logging.DEBUG if debug else logging.WARNING,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        handler: Handler | None = getattr(args, "handler", None)
        if handler is None:
            build_parser().print_help(sys.stderr)
            return EXIT_USAGE
        return handler(args)
    except SystemExit as exc:  # --help / --version exit through argparse
        return exc.code if isinstance(exc.code, int) else EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `dcp-volumes ls ... | head`: the reader left. Say nothing; keep the interpreter from
        # complaining again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    except (DCPVolumesError, OSError, ValueError) as exc:
        if debug:
            traceback.print_exc()
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return _exit_code(exc)


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, (CheckpointNotFoundError, IncompleteCheckpointError, BucketNotFoundError)):
        return EXIT_NOT_FOUND
    # ConfigError is a ValueError, so both read as "change your input".
    return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILURE


def _one_line(exc: BaseException) -> str:
    # Messages may carry newlines (OSError from some backends); the contract is one line.
    return " ".join(str(exc).split()) or type(exc).__name__


def _version() -> str:
    from dcp_volumes._version import __version__

    return __version__


def _command_groups() -> tuple[Registrar, ...]:
    """One entry per command group, in ``dcp-volumes --help`` order."""
    return (lifecycle.register, export.register, plan.register, bench.register)
