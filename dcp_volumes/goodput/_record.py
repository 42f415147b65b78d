"""A run's record of what its checkpoints cost and how often it was interrupted.

One small JSON object under the run root (:data:`RECORD_NAME`), written by rank 0 of the
Checkpointer (``every_seconds="auto"``) and read back by the next incarnation of the run and by
``dcp-volumes plan --from-run``. Bounded: the newest :data:`MAX_SAVES` saves,
:data:`MAX_RESTORES` restores and :data:`MAX_INCARNATIONS` incarnations are kept, older
incarnations folded into counts (how many, their interruptions and exposure) and the run's
first start.

The bytes are untrusted like everything read from a store: :func:`parse_record` refuses more
than :data:`MAX_RECORD_BYTES`, a record of another root or format, and drops each entry whose
numbers are not finite and in range; :func:`~dcp_volumes.goodput._judge.judge_record` then
judges the whole against the clock and its own span. The caller logs the reasons as one
WARNING and goes on with what is left, or a fresh record where the record fails as a whole: a
record never fails a save or a resume.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dcp_volumes.goodput._checks import MAX_DURATION_S, MAX_GPUS

__all__ = [
    "MAX_RECORD_BYTES",
    "RECORD_NAME",
    "Incarnation",
    "RestoreSample",
    "RunRecord",
    "SaveSample",
    "dump_record",
    "parse_record",
    "run_key",
]

RECORD_NAME = ".dcpv-run-record.json"
FORMAT = "dcp-volumes-run-record"
VERSION = 1
#: a record we write is ~20 KB; anything far larger is not ours
MAX_RECORD_BYTES = 256 * 1024
MAX_SAVES = 32
MAX_RESTORES = 16
MAX_INCARNATIONS = 64
#: wall-clock timestamps outside (2001, 2286) are not timestamps
_MIN_WALL, _MAX_WALL = 1e9, 1e10
_MAX_BYTES = 1e16
#: a save or a restore measured at more than a day is not a measurement to plan by
MAX_MEASURED_S = 86400.0
_MAX_COUNT = 10**9

Kind = Literal["durable", "local-only"]


def run_key(run_id: str | None, root: str) -> str:
    """The record's name for the run: 32 hex digits of ``run_id`` (the Checkpointer's
    :class:`~dcp_volumes.checkpointer.RunIdentity`, stable across restarts where the caller or
    the launcher names the run), or of the record ``root`` where nothing names it (a run id
    made per process would change at every restart: the root is then the run). Always safe as
    a name: a digest, never the caller's text."""
    named = f"run:{run_id}" if run_id is not None else f"root:{root}"
    return hashlib.sha256(named.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass(frozen=True)
class SaveSample:
    """One save: what it blocked, its completion after that (upload), its bytes (this rank),
    and whether it was the first of its incarnation (which also pays one-time setup: the
    writer, the staging buffers, the store's connections)."""

    kind: str
    blocking_s: float
    background_s: float
    bytes: int
    at: float
    first: bool = False


@dataclass(frozen=True)
class RestoreSample:
    """One resume: the load itself, and the process's start to training again."""

    restore_s: float
    start_to_train_s: float
    source: str  # "local" (the local tier) or "store"
    at: float


@dataclass
class Incarnation:
    """One process lifetime of the run: started (process start), last seen alive (its last
    record write), whether it closed cleanly, and the save interval it had then (how long
    after ``last_seen`` it may have lived)."""

    started: float
    last_seen: float
    closed: bool = False
    interval_s: float = 0.0


@dataclass
class RunRecord:
    """The record (see the module docstring)."""

    root: str
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    gpus: int = 1
    saves: list[SaveSample] = field(default_factory=list)
    restores: list[RestoreSample] = field(default_factory=list)
    incarnations: list[Incarnation] = field(default_factory=list)
    earlier_interruptions: int = 0
    earlier_exposure_s: float = 0.0
    #: how many incarnations were folded into the two counts above
    earlier_incarnations: int = 0
    #: the run's first incarnation's start, kept once it is folded (None: the first kept one's)
    first_started: float | None = None

    def add_save(self, sample: SaveSample) -> None:
        self.saves = [*self.saves, sample][-MAX_SAVES:]

    def add_restore(self, sample: RestoreSample) -> None:
        self.restores = [*self.restores, sample][-MAX_RESTORES:]

    def add_incarnation(self, inc: Incarnation) -> None:
        """Start a new incarnation; the oldest ones beyond the cap are folded into counts."""
        self.incarnations.append(inc)
        while len(self.incarnations) > MAX_INCARNATIONS:
            n, t = _span(self.incarnations[0], self.incarnations[1].started)
            if self.first_started is None:
                self.first_started = self.incarnations[0].started
            self.earlier_interruptions += n
            self.earlier_incarnations = min(self.earlier_incarnations + 1, _MAX_COUNT)
            self.earlier_exposure_s = min(self.earlier_exposure_s + t, MAX_DURATION_S)
            self.incarnations.pop(0)

    def first(self) -> float | None:
        """When the run's first incarnation started, as far as the record says (None: it
        holds no incarnation)."""
        if self.first_started is not None:
            return self.first_started
        return self.incarnations[0].started if self.incarnations else None

    def evidence(self, now: float) -> tuple[int, float]:
        """Interruptions and exposure (seconds of running time), the running incarnation
        counted up to ``now``."""
        n, t = _evidence(self.incarnations, now)
        return (min(n + self.earlier_interruptions, _MAX_COUNT),
                min(t + self.earlier_exposure_s, MAX_DURATION_S))


def _span(inc: Incarnation, next_started: float | None,
          now: float | None = None) -> tuple[int, float]:
    """Whether ``inc`` was interrupted, and how long it ran. An incarnation followed by
    another without closing was interrupted; it ran from its start until half a save interval
    past its last sign of life (a live process writes the record at every durable save), and
    not past the next one's start (a start before that last sign of life -- a clock stepped
    back -- adds nothing). The running one counts up to ``now``."""
    if next_started is not None:
        # the gap to the next start spans processes (wall clocks, maybe stepped): bounded to
        # [0, half an interval], so a clock step never reads as exposure
        gap = min(max(next_started - inc.last_seen, 0.0), inc.interval_s / 2)
        end = inc.last_seen if inc.closed else inc.last_seen + gap
        interrupted = 0 if inc.closed else 1
    else:
        end = inc.last_seen if now is None or inc.closed else max(now, inc.last_seen)
        interrupted = 0
    return interrupted, max(0.0, end - inc.started)


def _evidence(incs: list[Incarnation], now: float | None = None) -> tuple[int, float]:
    n, total = 0, 0.0
    for i, inc in enumerate(incs):
        nxt = incs[i + 1].started if i + 1 < len(incs) else None
        k, t = _span(inc, nxt, now)
        n, total = n + k, total + t
    return n, total


def dump_record(record: RunRecord) -> bytes:
    doc = {"format": FORMAT, "version": VERSION, **asdict(record)}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


# ---- reading (untrusted) ---------------------------------------------------------------


def _num(value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("not a number")
    x = float(value)
    if not math.isfinite(x) or not low <= x <= high:
        raise ValueError("out of range")
    return x


def _duration(value: Any) -> float:
    return _num(value, 0.0, MAX_DURATION_S)


def _measured(value: Any) -> float:
    return _num(value, 0.0, MAX_MEASURED_S)


def _wall(value: Any) -> float:
    return _num(value, _MIN_WALL, _MAX_WALL)


def _save(d: Any) -> SaveSample:
    if d.get("kind") not in ("durable", "local-only"):
        raise ValueError("unknown kind")
    first = d.get("first", False)
    if not isinstance(first, bool):
        raise TypeError("first: not a boolean")
    return SaveSample(d["kind"], _measured(d["blocking_s"]), _measured(d["background_s"]),
                      int(_num(d["bytes"], 0, _MAX_BYTES)), _wall(d["at"]), first)


def _restore(d: Any) -> RestoreSample:
    if d.get("source") not in ("local", "store"):
        raise ValueError("unknown source")
    return RestoreSample(_measured(d["restore_s"]), _measured(d["start_to_train_s"]),
                         d["source"], _wall(d["at"]))


def _incarnation(d: Any) -> Incarnation:
    started, seen = _wall(d["started"]), _wall(d["last_seen"])
    if seen < started or not isinstance(d["closed"], bool):
        raise ValueError("inconsistent")
    return Incarnation(started, seen, d["closed"], _duration(d["interval_s"]))


def _entries(doc: dict[str, Any], key: str, cap: int, parse: Any,
             problems: list[str]) -> list[Any]:
    raw = doc.get(key)
    if not isinstance(raw, list):
        problems.append(f"{key}: not a list")
        return []
    out = []
    for item in raw[-cap:]:
        try:
            if not isinstance(item, dict):
                raise TypeError("not an object")
            out.append(parse(item))
        except (KeyError, ValueError, TypeError, OverflowError):
            problems.append(f"{key}: an invalid entry dropped")
    return out


def parse_record(data: bytes, *, root: str,
                 run: str | None = None) -> tuple[RunRecord | None, list[str]]:
    """The record in ``data`` for the run at ``root`` (normalised URL), and the problems
    found (empty: clean). ``None``: nothing usable (too large, not JSON, another format,
    another root, or -- ``run`` given, a :func:`run_key` -- another run); otherwise invalid
    entries are dropped and listed."""
    if len(data) > MAX_RECORD_BYTES:
        return None, [f"larger than {MAX_RECORD_BYTES // 1024} KiB"]
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, ["not JSON"]
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        return None, ["not a version-1 dcp-volumes run record"]
    if doc.get("root") != root:
        return None, ["written for another run root"]
    run_id = doc.get("run_id")
    if not isinstance(run_id, str) or not 0 < len(run_id) <= 64 or not run_id.isalnum():
        return None, ["no valid run id"]
    if run is not None and run_id != run:
        return None, ["written by another run (another run id under this root)"]
    problems: list[str] = []
    record = RunRecord(root=root, run_id=run_id)
    record.saves = _entries(doc, "saves", MAX_SAVES, _save, problems)
    record.restores = _entries(doc, "restores", MAX_RESTORES, _restore, problems)
    incs = _entries(doc, "incarnations", MAX_INCARNATIONS, _incarnation, problems)
    record.incarnations = sorted(incs, key=lambda i: i.started)
    try:
        record.gpus = int(_num(doc.get("gpus", 1), 1, MAX_GPUS))
    except (ValueError, TypeError):
        problems.append("gpus: invalid, dropped")
    try:
        _folded(doc, record)
    except (ValueError, TypeError):
        problems.append("earlier counts or first start: invalid, dropped")
    return record, problems


def _folded(doc: dict[str, Any], record: RunRecord) -> None:
    """The folded incarnations' counts and the run's first start, all or none."""
    first = doc.get("first_started")
    n = int(_num(doc.get("earlier_interruptions", 0), 0, _MAX_COUNT))
    t = _duration(doc.get("earlier_exposure_s", 0.0))
    k = int(_num(doc.get("earlier_incarnations", 0), 0, _MAX_COUNT))
    record.first_started = None if first is None else _wall(first)
    record.earlier_interruptions, record.earlier_exposure_s, record.earlier_incarnations = n, t, k


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")
