"""``Checkpointer``: the one object a training loop holds -- when to save, where, how many to
keep, and where to resume from.

Example::

    ckpt = Checkpointer("s3://bucket/run-42", storage_options=opts, every_steps=500,
                        keep_last=3, keep_every=10_000, async_save=True)
    start = (ckpt.load_latest(state) or 0) + 1
    for step in range(start, total + 1):
        train_step()
        ckpt.save(step, state)        # saves when the policy says so
    ckpt.close()                      # waits for the last save; raises if it failed

Modules: ``_policy`` (the cadences: a frozen :class:`SavePolicy` with an injectable clock),
``_resume`` (what to resume from: a pure choice over what the ranks report, and its
collectives), ``_checkpointer`` (the object itself), ``_saves`` (making and settling its
saves), ``_restore`` (its resume), ``_fallback`` (the resume loop every integration uses:
the newest checkpoint that verifies), ``_run`` (the run's identity and its lease on the
root, for a process group), ``_lease`` (the lease object), ``_run_marker`` (identities and
the marker's bytes).
"""

from __future__ import annotations

from dcp_volumes.checkpointer._checkpointer import Checkpointer
from dcp_volumes.checkpointer._fallback import candidates, load_newest
from dcp_volumes.checkpointer._policy import SaveKind, SavePolicy

__all__ = ["Checkpointer", "SaveKind", "SavePolicy", "candidates", "load_newest"]
