"""What a run is and what its marker says: :class:`RunIdentity` (the run across its restarts,
the process within it) and :class:`Holder`, parsed from the untrusted marker under a run root
(see :mod:`._run` for the lease itself).

Torch-free and store-free: identities from the caller or the environment, the marker's bytes
in and out, and whether a holder on this host is gone.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from dcp_volumes import errors

__all__ = [
    "LEASE_S",
    "MARKER",
    "MAX_MARKER_BYTES",
    "MAX_TEXT",
    "RUN_ID_ENV",
    "Holder",
    "RunIdentity",
    "holder_gone",
    "parse_marker",
    "run_identity",
    "this_host",
]

#: the lease object, right under the run root
MARKER = ".dcpv-run.json"
#: the most bytes read from a marker (a real one is a few hundred)
MAX_MARKER_BYTES = 64 * 1024
#: how long a lease lasts without a renewal (the holder renews every quarter of it)
LEASE_S = 60.0
#: environment variables that name a run across its restarts, first found wins
RUN_ID_ENV = ("DCP_VOLUMES_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")

MAX_TEXT = 256
_PROCESS_RUN_ID = uuid.uuid4().hex
_FORMAT = 1


@dataclass(frozen=True)
class RunIdentity:
    """One run (``run_id``, the same across its restarts where the caller or the launcher
    says so) in one process (``incarnation``, new in every process). ``named``: the run id
    came from the caller or the environment; False: made for this process, so a restart gets
    another one (the run record then takes the root as the run)."""

    run_id: str
    incarnation: str
    named: bool = True


def _check_text(name: str, value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT or not value.isprintable():
        raise errors.ConfigError(
            f"{name} must be a non-empty printable string of at most {MAX_TEXT} characters, "
            f"got {value!r:.80}")
    return value


def run_identity(run_id: str | None = None) -> RunIdentity:
    """This process's identity in run ``run_id`` (default: from the environment, see
    :data:`RUN_ID_ENV`, else one id for this process)."""
    if run_id is None:
        found = (os.environ.get(k, "") for k in RUN_ID_ENV)
        run_id = next((v for v in found if v and v.lower() != "none"), None)
        if run_id is None:
            return RunIdentity(_PROCESS_RUN_ID, uuid.uuid4().hex, named=False)
    return RunIdentity(_check_text("run_id", run_id), uuid.uuid4().hex)


@dataclass(frozen=True)
class Holder:
    """What a marker says about the run holding the root (parsed from untrusted bytes)."""

    run_id: str
    incarnation: str
    host: str
    pid: int
    beat: int
    lease_s: float
    renewed: float  # the holder's wall clock: shown to people, never compared across hosts
    released: bool = False

    def describe(self, now: float) -> str:
        ago = max(0.0, now - self.renewed)
        return (f"run {self.run_id!r} (host {self.host}, pid {self.pid}, last renewed "
                f"{ago:.0f}s ago by its clock{', released' if self.released else ''})")

    def to_bytes(self) -> bytes:
        return json.dumps({"format": _FORMAT, **asdict(self)}, sort_keys=True).encode()


def _field(raw: dict[str, Any], name: str, kind: type) -> Any:
    value = raw.get(name)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ValueError(name)
    if isinstance(value, str) and (len(value) > MAX_TEXT or not value.isprintable()):
        raise ValueError(name)
    return value


def parse_marker(raw: bytes) -> Holder | None:
    """The holder a marker names; None when it is not a marker this version can read."""
    if len(raw) > MAX_MARKER_BYTES:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            return None
        holder = Holder(
            run_id=_field(data, "run_id", str), incarnation=_field(data, "incarnation", str),
            host=_field(data, "host", str), pid=_field(data, "pid", int),
            beat=_field(data, "beat", int), lease_s=_field(data, "lease_s", float),
            renewed=_field(data, "renewed", float), released=_field(data, "released", bool))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not (0 <= holder.pid < 2**31 and 0 <= holder.beat < 2**62
            and 0.0 < holder.lease_s <= 86400.0):
        return None
    return holder


def this_host() -> str:
    return socket.gethostname()[:MAX_TEXT]


def holder_gone(holder: Holder) -> bool:
    """The holder ran on this host (one clock: its renewal time means something here) and
    its process no longer exists, or it stopped renewing for a whole lease."""
    if holder.host != this_host():
        return False
    if holder.pid <= 0 or time.time() - holder.renewed > holder.lease_s:
        return True
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, owned by someone else
        return False
    return False


