"""Whether a run record read back could be what this run wrote (pure).

:func:`~dcp_volumes.goodput._record.parse_record` checks each field's range; a record whose
every field is in range can still say what no run of this process chain could have written:
``earlier_interruptions = 10**9`` over one second of exposure (the autopilot then saves every
second, and writes the claim back at every save), an incarnation last seen in 2286 (the
record's clock would stay there), a save of a day in a run that has existed an hour. Here the
record is judged against what the store cannot forge:

* **the clock**: nothing in it ends after now (the reader's clock, with
  :data:`CLOCK_SKEW_S` for another host's), nor starts before the run's first record (its
  first incarnation's start, kept when it is folded), nor ends after its last sign of life
  (every save and resume is followed by one);
* **its own span**: no more exposure than the run has existed (from its first record to its
  last sign of life), incarnations that do not overlap, no more interruptions than
  incarnations (folded ones included, folded only once 64 are kept), no interval longer than
  the autopilot chooses (``max_interval_s``).

A record that fails is not used at all (not one of its figures: a record found to lie once
says nothing trustworthy) and the autopilot rewrites it from what its own run saw.
:func:`~dcp_volumes.goodput._auto.measured_costs` adds the third judge, the run's own
measurements: a claimed save cost counts only until the run measures one.
"""

from __future__ import annotations

import itertools

from dcp_volumes.goodput._record import MAX_INCARNATIONS, RunRecord

__all__ = ["CLOCK_SKEW_S", "judge_record"]

#: how far a record's time may be ahead of the reader's clock (another host's clock; the
#: autopilot starts its incarnation at the record's last sign of life then, with a WARNING)
CLOCK_SKEW_S = 3600.0
#: rounding between the wall clock and the monotonic one
_SLACK_S = 1.0


def judge_record(record: RunRecord, *, now: float, max_interval_s: float) -> list[str]:
    """Why ``record`` cannot be what this run wrote, read at wall-clock ``now`` by an
    autopilot whose intervals are at most ``max_interval_s`` (empty: nothing found)."""
    incs = record.incarnations
    if not incs:
        if record.saves or record.restores or _folded(record):
            return ["measurements without an incarnation"]
        return []
    first = record.first()
    assert first is not None
    last = max(i.last_seen for i in incs)
    why = _clock(record, now=now, first=first, last=last)
    why += _span(record, first=first, last=last)
    longest = max(i.interval_s for i in incs)
    if longest > max_interval_s + _SLACK_S:
        why.append(f"an incarnation's interval of {longest:.3g} s, longer than the autopilot "
                   f"chooses (max_interval_s {max_interval_s:.3g} s)")
    return why


def _folded(record: RunRecord) -> bool:
    return bool(record.earlier_incarnations or record.earlier_interruptions
                or record.earlier_exposure_s or record.first_started is not None)


def _clock(record: RunRecord, *, now: float, first: float, last: float) -> list[str]:
    why = []
    if last > now + CLOCK_SKEW_S:
        why.append(f"it was last seen {last - now:.3g} s after now (a time in the future)")
    starts = [i.started for i in record.incarnations]
    starts += [s.at - s.blocking_s - s.background_s for s in record.saves]
    starts += [r.at - r.start_to_train_s for r in record.restores]
    if min(starts) < first - _SLACK_S:
        why.append(f"something in it started {first - min(starts):.3g} s before the run's "
                   "first record")
    ends = [s.at for s in record.saves] + [r.at for r in record.restores]
    if ends and max(ends) > last + _SLACK_S:
        why.append("a save or resume ends after the run's last sign of life")
    return why


def _span(record: RunRecord, *, first: float, last: float) -> list[str]:
    why = []
    incs = record.incarnations
    if any(b.started < a.last_seen - _SLACK_S for a, b in itertools.pairwise(incs)):
        why.append("two incarnations overlap")
    if record.earlier_incarnations and (record.first_started is None
                                        or len(incs) < MAX_INCARNATIONS):
        why.append("folded incarnations without the run's first record or with fewer than "
                   f"{MAX_INCARNATIONS} kept")
    if record.earlier_interruptions > record.earlier_incarnations:
        why.append(f"{record.earlier_interruptions} earlier interruptions in "
                   f"{record.earlier_incarnations} earlier incarnations")
    if record.earlier_exposure_s > incs[0].started - first + _SLACK_S:
        why.append(f"{record.earlier_exposure_s:.3g} s of earlier exposure in "
                   f"{max(incs[0].started - first, 0.0):.3g} s before its oldest incarnation")
    _, exposure = record.evidence(last)  # the newest counted up to its last sign of life
    if exposure > last - first + _SLACK_S:
        why.append(f"{exposure:.3g} s of exposure in a run that has existed "
                   f"{last - first:.3g} s")
    return why
