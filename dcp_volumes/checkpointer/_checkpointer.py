"""The :class:`Checkpointer` (see the package docstring)."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dcp_volumes import errors
from dcp_volumes._dist import gloo_group
from dcp_volumes.backends import redact_url
from dcp_volumes.checkpointer._autopilot import Autopilot, AutopilotOptions
from dcp_volumes.checkpointer._policy import (
    Marks,
    SaveKind,
    SavePolicy,
    check_local_only,
)
from dcp_volumes.checkpointer._restore import Restorer
from dcp_volumes.checkpointer._run import RunGuard
from dcp_volumes.checkpointer._saves import Saves, SaveSetup
from dcp_volumes.config import (
    LocalTierOptions,
    RetryOptions,
    SpoolOptions,
    TransferOptions,
)
from dcp_volumes.stats import LoadStats

if TYPE_CHECKING:
    from types import TracebackType

    from typing_extensions import Self

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)

class Checkpointer:
    """Save on a policy, keep what a retention policy says, resume from the latest checkpoint.

    Checkpoint ``N`` goes to ``f"{root}/{step_format.format(step=N)}"`` (default
    ``step-00000500``) through :class:`~dcp_volumes.VolumeWriter`; it is complete once its
    ``.metadata`` is committed. After each commit, rank 0 applies the retention policy
    (:func:`dcp_volumes.catalog.apply_retention`; a retention failure is logged as a warning,
    it never fails the save).

    Distributed runs: every rank constructs the Checkpointer at the same point (it creates gloo
    process groups over all ranks, so it works whatever the default backend is) and calls
    :meth:`save` and :meth:`load_latest` at the same steps. :meth:`should_save` is a collective
    when ``every_seconds`` is set (rank 0's clock decides for everyone); otherwise it is local.

    With ``async_save=True`` a save returns after staging (a memory copy) and uploads in a
    background thread (``dcp.async_save``, THREAD executor, on a process group of its own so it
    never interleaves with the training loop's collectives). The next :meth:`save` first waits
    for the previous one; a failed background save is raised by the next :meth:`save` that
    saves (a due step, or ``force``), :meth:`wait`, :meth:`load_latest` or :meth:`close` -- never
    swallowed.

    Args:
        root: the run root, e.g. ``"s3://bucket/run-42"`` or a local directory.
        storage_options: passed to fsspec unchanged; never logged.
        every_steps: save when ``step % every_steps == 0``.
        every_seconds: save when at least this long has passed since the last durable save
            started (or since construction / :meth:`load_latest`). With both set, either
            triggers a save; with neither, every :meth:`save` call saves. ``"auto"``: chosen
            from the run's measured costs and failures (see :attr:`stats`, docs/goodput.md).
        autopilot: ``AutopilotOptions`` of ``every_seconds="auto"`` (prior, bounds).
        local_every_steps: a second, faster cadence of *local-only* saves (needs
            ``local_tier=`` and a durable cadence, ``every_steps`` or ``every_seconds``):
            a local-only save when ``step % local_every_steps == 0``. A step due for both
            gets the durable save (which keeps a local copy too).
        local_every_seconds: a local-only save when at least this long has passed since the
            last save of either kind started. See ``docs/goodput.md`` (two tiers) for
            choosing both cadences (``dcp-volumes plan --local-save-s``).
        drain: with ``async_save`` and a local cadence: a save due as local-only is made
            durable instead when no upload is in flight (the previous durable save has
            committed), so durable saves follow each other as fast as the store takes them
            and local-only saves fill the time an upload takes. ``every_steps`` /
            ``every_seconds`` still force durable saves.
        keep_last: keep the last N complete checkpoints (see :func:`~dcp_volumes.catalog.
            apply_retention`); ``None`` keeps all.
        keep_every: also keep every checkpoint whose step is a multiple of K.
        async_save: upload in the background (see above).
        overwrite: replace a complete checkpoint already at a step's URL (as
            :class:`~dcp_volumes.VolumeWriter`'s ``overwrite``); off by default.
        spool: :class:`~dcp_volumes.SpoolOptions` for every save.
        transfer: :class:`~dcp_volumes.TransferOptions` for every save and load.
        retry: :class:`~dcp_volumes.RetryOptions` for every save and load.
        local_tier: :class:`~dcp_volumes.LocalTierOptions`: every save also keeps each rank's
            files on node-local disk, and :meth:`load_latest` reads what is there (checked
            against the committed checkpoint) before the store. Its ``keep_last`` and
            ``max_bytes`` apply to the local copies only (local-only saves included). Needed
            by ``save(..., local_only=True)``.
        safe_globals: classes a checkpoint's pickled non-tensor items may reference on load
            (as :class:`~dcp_volumes.VolumeReader`'s ``safe_globals``).
        step_format: directory name of a step, a ``str.format`` template with ``{step}``.
        step_pattern: regular expression that parses the step back from a directory name
            (default: :data:`dcp_volumes.catalog.DEFAULT_STEP_PATTERN`); must agree with
            ``step_format``.
        clock: the monotonic clock ``every_seconds`` / ``local_every_seconds`` are judged by
            (``time.monotonic``; tests and simulations pass their own).
        alone: this process saves and resumes by itself, with no collective, even when
            torch.distributed is initialized (DCP's ``no_dist``): for a caller that runs on
            one rank only, as Lightning's ``CheckpointIO`` on rank 0.
        run_id: names this run across its restarts (default: ``DCP_VOLUMES_RUN_ID``,
            ``TORCHELASTIC_RUN_ID`` or ``SLURM_JOB_ID``, else one id per process). The first
            save takes a lease on ``root`` for the run; a save while another run holds it
            raises :class:`~dcp_volumes.errors.RootInUseError` (see ``docs/guarantees.md``).
            ``every_seconds="auto"`` keeps its run record for the same run (a record of
            another run id under ``root`` is ignored; with no run id named, the root is
            the run).

    Raises:
        BucketNotFoundError: the bucket or container of ``root`` does not exist (checked
            with one request on rank 0 at construction).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        /,
        *,
        storage_options: dict[str, Any] | None = None,
        every_steps: int | None = None,
        every_seconds: float | str | None = None,
        local_every_steps: int | None = None,
        local_every_seconds: float | None = None,
        drain: bool = False,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = False,
        overwrite: bool = False,
        spool: SpoolOptions | None = None,
        transfer: TransferOptions | None = None,
        retry: RetryOptions | None = None,
        local_tier: LocalTierOptions | None = None,
        safe_globals: Sequence[Any] = (),
        step_format: str = "step-{step:08d}",
        step_pattern: str | re.Pattern[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        autopilot: AutopilotOptions | None = None,
        run_id: str | None = None,
        alone: bool = False,
    ) -> None:
        url = os.fspath(root)
        self._setup = SaveSetup.check(
            url, storage_options=storage_options, overwrite=overwrite, spool=spool,
            transfer=transfer, retry=retry, local_tier=local_tier, keep_last=keep_last,
            keep_every=keep_every, step_format=step_format, step_pattern=step_pattern,
            alone=alone, async_save=async_save)
        self._autopilot = Autopilot.create(every_seconds, local_every_seconds, autopilot, url,
                                           self.storage_options, retry, local_tier)
        self.policy = SavePolicy(every_steps, self._autopilot.every_seconds(every_seconds),
                                 local_every_steps, local_every_seconds, drain, clock)
        self.policy.check_with(local_tier=local_tier is not None, async_save=bool(async_save))
        self.safe_globals = tuple(safe_globals)
        self.step_format = step_format
        self._init_state(run_id)

    def _init_state(self, run_id: str | None) -> None:
        #: this rank's :class:`~dcp_volumes.LoadStats` of the last :meth:`load_latest`
        self.last_load_stats: LoadStats | None = None
        self._closed = False
        self._marks = Marks()
        self._marks.reset(self.policy.clock())
        # Groups: control collectives (should_save, latest, sync save, load) run on the caller's
        # thread; background saves get a group of their own so the two never interleave.
        self._distributed = not self.alone and dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if self._distributed else 0
        ctl = gloo_group(own=True) if self._distributed else None
        self._ctl_group = ctl
        self._restorer = Restorer(self.root, self.storage_options, self.step_format,
                                  self.step_pattern, self.transfer, self.retry, self.safe_globals,
                                  self.local_tier, ctl, self._distributed, self._rank)
        self._saves = Saves(self._setup, restorer=self._restorer,
                            autopilot=self._autopilot, ctl_group=ctl,
                            save_group=(gloo_group(own=True) if self._distributed and self.async_save
                                        else None),
                            rank=self._rank, distributed=self._distributed)
        self._run = RunGuard.open(self.root, run_id, storage_options=self.storage_options,
                                  retry=self.retry, group=ctl, distributed=self._distributed)
        #: this run and process (:class:`~dcp_volumes.checkpointer._run.RunIdentity`)
        self.run = self._run.identity
        # "auto": this incarnation is in the run's record from now on (the same run as the lease's)
        self._autopilot.begin(self.run.run_id if self.run.named else None)

    # what every save is made with, as checked at construction
    root = property(lambda self: self._setup.root)
    storage_options = property(lambda self: self._setup.storage_options)
    keep_last = property(lambda self: self._setup.keep_last)
    keep_every = property(lambda self: self._setup.keep_every)
    async_save = property(lambda self: self._setup.async_save)
    overwrite = property(lambda self: self._setup.overwrite)
    spool = property(lambda self: self._setup.spool)
    transfer = property(lambda self: self._setup.transfer)
    retry = property(lambda self: self._setup.retry)
    local_tier = property(lambda self: self._setup.local_tier)
    step_pattern = property(lambda self: self._setup.step_pattern)
    alone = property(lambda self: self._setup.alone)

    # the cadences, as the policy holds them
    every_steps = property(lambda self: self.policy.every_steps)
    every_seconds = property(lambda self: self.policy.every_seconds)
    local_every_steps = property(lambda self: self.policy.local_every_steps)
    local_every_seconds = property(lambda self: self.policy.local_every_seconds)
    drain = property(lambda self: self.policy.drain)
    stats = property(lambda self: self._autopilot.stats())  # "auto": the interval and why

    # ---- policy --------------------------------------------------------------------------
    def url_for(self, step: int) -> str:
        """The URL checkpoint ``step`` is saved to."""
        return f"{self.root}/{self.step_format.format(step=step)}"

    @property
    def last_step(self) -> int | None:
        """The step of the last save started (or loaded by :meth:`load_latest`)."""
        return self._marks.last_step

    def should_save(self, step: int) -> bool:
        """Whether the policy asks for a checkpoint (of either kind) at ``step``.

        False for the step saved last. Collective when ``every_seconds`` or
        ``local_every_seconds`` is set in a distributed run: every rank must call it at the
        same steps.
        """
        return self.due(step) is not None

    def due(self, step: int) -> SaveKind | None:
        """Which save the policy asks for at ``step``: ``"durable"``, ``"local-only"`` (the
        local cadence, between durable saves) or ``None``. A step due for both is durable.

        Collective when a ``*_every_seconds`` is set in a distributed run (rank 0's clock
        decides for everyone); otherwise local.
        """
        self.policy = self._autopilot.policy(self.policy)
        kind = self.policy.due(step, self._marks)
        if step == self._marks.last_step or not (self._distributed and self.policy.timed):
            return kind
        if self.policy.every_steps is not None and step % self.policy.every_steps == 0:
            return kind  # the same answer on every rank: no collective needed
        box: list[Any] = [kind]
        dist.broadcast_object_list(box, group_src=0, group=self._ctl_group)
        return box[0] if box[0] in ("durable", "local-only") else None

    # ---- save ----------------------------------------------------------------------------
    def claim(self) -> None:
        """Take the root for this run now (the first save does it otherwise): a framework
        that resumes and then saves calls it before resuming. Collective.

        Raises:
            RootInUseError: another run holds the root and is alive.
        """
        self._check_open()
        self._run.claim()

    def save(self, step: int, state_dict: dict[str, Any], *, force: bool = False,
             local_only: bool | None = None) -> bool:
        """Save ``state_dict`` as checkpoint ``step`` if the policy says so (or ``force``).

        Sync: returns once the checkpoint is committed. Async: waits for the previous save,
        stages ``state_dict`` and returns while it uploads.

        ``local_only=True`` writes the save to each rank's local tier only (needs
        ``local_tier=``): nothing goes to the store. It is *local-complete* once every rank
        wrote its copy; it is never durable (the catalog, ``latest`` and retention of the
        store do not see it), and :meth:`load_latest` uses it only when the whole group
        holds it and it is newer than the newest durable checkpoint. A rank that cannot
        write its copy (tier full, unwritable) logs a WARNING and the save is never used.
        ``local_only=None`` (the default) lets the policy pick the kind (:meth:`due`: the
        local cadence's steps are local-only, the others durable; ``force`` is durable);
        ``True`` or ``False`` picks it whenever a save happens.

        Returns:
            True if a save was started.

        Raises:
            DCPVolumesError: this save failed (sync), or the previous background save did
                (the typed error behind DCP's ``CheckpointException``, which it chains)
                (async; this save is then not started).
        """
        self._check_open()
        kind = self._kind(step, force, local_only)
        if kind is None:
            # A failed background save is raised at the next save that happens, not here:
            # every rank reaches that point at the same step, so all raise together.
            return False
        local = kind == "local-only"
        self._saves.finish_pending()
        if not local:  # the root is this run's (taken at the first durable save)
            self._run.claim()
        url = self.url_for(step)
        writer = self._saves.writer(url, local)
        self._marks.saved(step, self.policy.clock(), durable=not local)
        self._saves.start(step, url, kind, writer, state_dict)
        return True

    def _kind(self, step: int, force: bool, local_only: bool | None) -> SaveKind | None:
        """Which save :meth:`save` makes at ``step`` (None: none is due)."""
        check_local_only(local_only, has_tier=self.local_tier is not None)
        if not force:
            kind = self.due(step)
            if kind is None:
                return None
            if local_only is None:
                local_only = kind == "local-only" and not (self.drain and self._upload_idle())
        return "local-only" if local_only else "durable"

    def _upload_idle(self) -> bool:
        return self._saves.upload_idle()

    def wait(self) -> None:
        """Wait for the background save in flight (if any) and, with ``every_seconds="auto"``,
        for the run record's write; raise if the save failed."""
        self._saves.finish_pending()
        self._autopilot.flush()

    # ---- resume --------------------------------------------------------------------------
    def load_latest(self, state_dict: dict[str, Any]) -> int | None:
        """Load the newest complete checkpoint that verifies into ``state_dict`` (in place).

        Lists the root once, on rank 0, and broadcasts the answer. A checkpoint whose data
        does not match its checksums is skipped with a WARNING naming it, and the next older
        one is loaded. Returns its step, or ``None`` when there is no complete checkpoint
        (``state_dict`` is left as it is).

        Raises:
            IntegrityError: no complete checkpoint verified.
        """
        self._check_open()
        self._saves.finish_pending()
        started = time.monotonic()
        restored = self._restorer.restore(state_dict)
        self._saves.resumed(restored)
        if restored is None:
            return None
        self.last_load_stats = restored.stats
        self._marks.reset(self.policy.clock(), restored.step)
        self._autopilot.resumed(started, restored.step, restored.stats, restored.local_only)
        return restored.step

    # ---- lifetime ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise errors.DCPVolumesError("this Checkpointer is closed")

    def close(self) -> None:
        """Wait for the save in flight (raising if it failed) and free the staging buffers."""
        if self._closed:
            return
        self._closed = True
        try:
            self._saves.finish_pending()
            self._autopilot.closed()
        finally:
            self._run.release()
            self._saves.close_writers()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except BaseException as close_exc:  # noqa: BLE001 -- don't mask the body's error
            logger.error(
                "while unwinding: the last checkpoint save failed too (%s)",
                type(close_exc).__name__,
            )

    def __repr__(self) -> str:
        return (
            f"Checkpointer({redact_url(self.root)!r}, every_steps={self.every_steps}, "
            f"every_seconds={self.every_seconds}, "
            f"local_every_steps={self.local_every_steps}, "
            f"local_every_seconds={self.local_every_seconds}, keep_last={self.keep_last}, "
            f"keep_every={self.keep_every}, async_save={self.async_save})"
        )
