"""``Checkpointer``: the one object a training loop holds -- when to save, where, how many to keep,
and where to resume from.

Example::

    ckpt = Checkpointer("s3://bucket/run-42", storage_options=opts, every_steps=500,
                        keep_last=3, keep_every=10_000, async_save=True)
    start = (ckpt.load_latest(state) or 0) + 1
    for step in range(start, total + 1):
        train_step()
        ckpt.save(step, state)        # saves when the policy says so
    ckpt.close()                      # waits for the last save; raises if it failed
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import _compat, _replicate, _tier, catalog, errors
from dcp_volumes._api import typed_errors, typed_failure
from dcp_volumes.backends import parse_url, redact_url
from dcp_volumes.config import LocalTierOptions, RetryOptions, SpoolOptions, TransferOptions
from dcp_volumes.reader import VolumeReader
from dcp_volumes.stats import LoadStats
from dcp_volumes.writer import VolumeWriter, check_local_tier

if TYPE_CHECKING:
    from types import TracebackType

    from typing_extensions import Self

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)

SaveKind = Literal["durable", "local-only"]


@dataclass
class _Pending:
    step: int
    url: str
    done: concurrent.futures.Future[None]


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
            triggers a save; with neither, every :meth:`save` call saves.
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
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        /,
        *,
        storage_options: dict[str, Any] | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
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
    ) -> None:
        url = os.fspath(root)
        parse_url(url)
        self.root = url.rstrip("/") if url.rstrip("/") else url
        if storage_options is not None and not isinstance(storage_options, dict):
            raise errors.ConfigError("storage_options must be a dict of fsspec options or None")
        self.storage_options = dict(storage_options or {})
        for name, steps in (("every_steps", every_steps),
                            ("local_every_steps", local_every_steps)):
            if steps is not None and (
                isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
            ):
                raise errors.ConfigError(
                    f"{name} must be a whole number >= 1 or None, got {steps!r}")
        for name, seconds in (("every_seconds", every_seconds),
                              ("local_every_seconds", local_every_seconds)):
            if seconds is not None and not seconds > 0:
                raise errors.ConfigError(f"{name} must be > 0 or None, got {seconds!r}")
        local_cadence = local_every_steps is not None or local_every_seconds is not None
        if local_cadence and local_tier is None:
            raise errors.ConfigError(
                "local_every_steps / local_every_seconds make local-only saves, which need a "
                "local tier: pass local_tier=LocalTierOptions(directory=...)")
        if local_cadence and every_steps is None and every_seconds is None:
            raise errors.ConfigError(
                "local_every_steps / local_every_seconds need a durable cadence too: set "
                "every_steps or every_seconds (local-only saves alone are never durable)")
        if not isinstance(drain, bool):
            raise errors.ConfigError(f"drain= must be True or False, got {drain!r}")
        if drain and not (local_cadence and async_save):
            raise errors.ConfigError(
                "drain=True turns local-only saves into durable ones while no upload is in "
                "flight: it needs async_save=True and local_every_steps / local_every_seconds")
        catalog.check_count("keep_last", keep_last)
        catalog.check_count("keep_every", keep_every)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.local_every_steps = local_every_steps
        self.local_every_seconds = local_every_seconds
        self.drain = drain
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = bool(async_save)
        for name, value, cls in (("spool", spool, SpoolOptions),
                                 ("transfer", transfer, TransferOptions),
                                 ("retry", retry, RetryOptions)):
            if value is not None and not isinstance(value, cls):
                raise errors.ConfigError(
                    f"{name}= must be a {cls.__name__} or None, got {type(value).__name__}")
        self.overwrite = bool(overwrite)
        self.spool, self.transfer, self.retry = spool, transfer, retry
        self.local_tier = check_local_tier(local_tier, spool or SpoolOptions())
        self.safe_globals = tuple(safe_globals)
        self.step_format = step_format
        self.step_pattern = catalog.compile_step_pattern(step_pattern)
        self._check_step_format()

        self._writer: VolumeWriter | None = None
        #: this rank's :class:`~dcp_volumes.LoadStats` of the last :meth:`load_latest`
        self.last_load_stats: LoadStats | None = None
        self._pending: _Pending | None = None
        self._closed = False
        self._last_step: int | None = None
        self._last_save_t = time.monotonic()  # the last durable save: every_seconds
        self._last_local_t = self._last_save_t  # the last save of any kind: local_every_seconds
        self._lock = threading.Lock()
        # Groups: control collectives (should_save, latest, sync save, load) run on the caller's
        # thread; background saves get a group of their own so the two never interleave.
        self._distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if self._distributed else 0
        self._ctl_group: dist.ProcessGroup | None = None
        self._save_group: dist.ProcessGroup | None = None
        if self._distributed:
            self._ctl_group = dist.new_group(backend="gloo")
            self._save_group = dist.new_group(backend="gloo") if self.async_save else None

    def _check_step_format(self) -> None:
        try:
            name = self.step_format.format(step=1234)
        except (KeyError, IndexError, ValueError) as exc:
            raise errors.ConfigError(
                f"step_format {self.step_format!r} is not a format string with {{step}} "
                f"({type(exc).__name__}); use e.g. 'step-{{step:08d}}'"
            ) from None
        if "/" in name or catalog.step_of(name, self.step_pattern) != 1234:
            raise errors.ConfigError(
                f"step_format {self.step_format!r} makes names like {name!r} that the step "
                f"pattern {self.step_pattern.pattern!r} does not parse back to 1234: pass a "
                "matching step_pattern (and no '/' in the name)"
            )

    # ---- policy --------------------------------------------------------------------------
    def url_for(self, step: int) -> str:
        """The URL checkpoint ``step`` is saved to."""
        return f"{self.root}/{self.step_format.format(step=step)}"

    @property
    def last_step(self) -> int | None:
        """The step of the last save started (or loaded by :meth:`load_latest`)."""
        return self._last_step

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
        if step == self._last_step:
            return None
        if self.every_steps is None and self.every_seconds is None:
            return "durable"
        if self.every_steps is not None and step % self.every_steps == 0:
            return "durable"  # the same answer on every rank: no collective needed
        now = time.monotonic()
        local_due = (
            (self.local_every_steps is not None and step % self.local_every_steps == 0)
            or (self.local_every_seconds is not None
                and now - self._last_local_t >= self.local_every_seconds))
        kind: SaveKind | None = "local-only" if local_due else None
        if self.every_seconds is not None and now - self._last_save_t >= self.every_seconds:
            kind = "durable"
        if self._distributed and (self.every_seconds is not None
                                  or self.local_every_seconds is not None):
            box: list[Any] = [kind]
            dist.broadcast_object_list(box, group_src=0, group=self._ctl_group)
            kind = box[0] if box[0] in ("durable", "local-only") else None
        return kind

    # ---- save ----------------------------------------------------------------------------
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
        if local_only is not None and not isinstance(local_only, bool):
            raise errors.ConfigError(
                f"local_only= must be True, False or None, got {local_only!r}")
        if local_only and self.local_tier is None:
            raise errors.ConfigError(
                "save(..., local_only=True) writes to the local tier only, and this "
                "Checkpointer has none: pass Checkpointer(..., local_tier=LocalTierOptions("
                "directory=...)), or save without local_only=True")
        if not force:
            kind = self.due(step)
            if kind is None:
                # A failed background save is raised at the next save that happens, not here:
                # every rank reaches that point at the same step, so all raise together.
                return False
            if local_only is None:
                local_only = kind == "local-only" and not (self.drain and self._upload_idle())
        local_only = bool(local_only)
        self._finish_pending()
        url = self.url_for(step)
        if self._writer is None:
            self._writer = VolumeWriter(
                url, storage_options=self.storage_options, overwrite=self.overwrite,
                spool=self.spool, transfer=self.transfer, retry=self.retry,
                local_tier=self.local_tier,
            )
        self._last_step = step
        self._last_local_t = time.monotonic()
        if not local_only:
            self._last_save_t = self._last_local_t
        writer = self._writer
        writer._local_only = local_only
        if not self.async_save:
            with typed_errors():
                dcp.save(state_dict, checkpoint_id=url, storage_writer=writer,
                         process_group=self._ctl_group)
            if local_only:
                self._complete_local_only(writer, step, url, self._ctl_group)
            else:
                self._after_commit(step, url)
            _replicate.replicate(self.local_tier, url, group=self._ctl_group)
            return True
        response = dcp.async_save(
            state_dict,
            checkpoint_id=url,
            storage_writer=self._writer,
            process_group=self._save_group,
            **_compat.async_executor("thread"),
        )
        upload = _compat.upload_future(response)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._pending = _Pending(step, url, done)

        def _settle(fut: concurrent.futures.Future[Any]) -> None:
            exc = fut.exception()
            if exc is None:
                try:
                    if local_only:
                        self._complete_local_only(writer, step, url, self._save_group)
                    else:
                        self._after_commit(step, url)
                except BaseException as late:  # noqa: BLE001 -- `done` must settle, or wait() hangs
                    exc = late
            if exc is not None:
                done.set_exception(exc)
            else:
                done.set_result(None)

        upload.add_done_callback(_settle)
        return True

    def _complete_local_only(self, writer: VolumeWriter, step: int, url: str,
                             group: dist.ProcessGroup | None) -> None:
        """Every rank stores the coordinator's ``.metadata`` and manifest in its tier, then
        its descriptor (a collective on ``group``: the bytes come from its rank 0)."""
        commit, writer._local_commit = writer._local_commit, None
        if self._distributed:
            box: list[Any] = [commit]
            dist.broadcast_object_list(box, group_src=0, group=group)
            commit = box[0] if isinstance(box[0], _tier.LocalCommit) else None
        if writer.complete_local_only(commit):
            logger.info("local-only save of step %d written to the local tier (%s)", step,
                        redact_url(url))
        else:
            logger.warning("rank %d: the local-only save of step %d could not be completed "
                           "in the local tier: it will not be used", self._rank, step)

    def _after_commit(self, step: int, url: str) -> None:
        logger.info("checkpoint of step %d committed at %s", step, redact_url(url))
        if self._rank != 0 or (self.keep_last is None and self.keep_every is None):
            return
        try:
            removed = catalog.apply_retention(
                self.root,
                keep_last=self.keep_last,
                keep_every=self.keep_every,
                storage_options=self.storage_options,
                step_pattern=self.step_pattern,
            )
        except Exception as exc:  # noqa: BLE001 -- the checkpoint is committed; say, don't fail
            logger.warning(
                "retention after step %d failed (%s: %s); old checkpoints stay until the next save",
                step,
                type(exc).__name__,
                exc,
            )
            return
        if removed:
            logger.info(
                "retention removed %d checkpoints: %s",
                len(removed),
                ", ".join(redact_url(u) for u in removed),
            )

    def _finish_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.done.result()
        except (Exception, CheckpointException) as exc:  # CheckpointException: BaseException
            note = (f"dcp_volumes: the background save of step {pending.step} to "
                    f"{redact_url(pending.url)} failed")
            typed = typed_failure(exc)
            failure = typed if typed is not None else exc
            if hasattr(failure, "add_note"):  # Python 3.11+
                failure.add_note(note)
            if typed is not None and typed is not exc:
                raise typed  # its cause stays the backend error; exc becomes its context
            raise
        # partner replicas of a background save: on the caller's thread (a collective on the
        # control group, which every rank reaches here after the same save)
        _replicate.replicate(self.local_tier, pending.url, group=self._ctl_group)

    def _upload_idle(self) -> bool:
        """No background save in flight (``drain``). Rank 0 decides for everyone: its save
        settles only after the commit, which follows every rank's upload."""
        with self._lock:
            pending = self._pending
        idle = pending is None or pending.done.done()
        if self._distributed:
            box: list[Any] = [idle]
            dist.broadcast_object_list(box, group_src=0, group=self._ctl_group)
            idle = bool(box[0])
        return idle

    def wait(self) -> None:
        """Wait for the background save in flight (if any); raise if it failed."""
        self._finish_pending()

    # ---- resume --------------------------------------------------------------------------
    def load_latest(self, state_dict: dict[str, Any]) -> int | None:
        """Load the newest complete checkpoint into ``state_dict`` (in place).

        Lists the root once, on rank 0, and broadcasts the answer. Returns its step, or
        ``None`` when there is no complete checkpoint (``state_dict`` is left as it is).
        """
        self._check_open()
        self._finish_pending()
        info = catalog.latest(
            self.root,
            storage_options=self.storage_options,
            step_pattern=self.step_pattern,
            process_group=self._ctl_group,
        )
        local = self._newest_local_only()
        step: int | None
        commit: _tier.LocalCommit | None
        if local is not None and (info is None or info.step is None or local[0] > info.step):
            step, url, commit = local
        elif info is not None:
            step, url, commit = info.step, info.url, None
        else:
            return None
        reader = VolumeReader(url, storage_options=self.storage_options,
                              transfer=self.transfer, retry=self.retry,
                              safe_globals=self.safe_globals, local_tier=self.local_tier)
        reader._local_commit = commit
        with typed_errors(lambda: reader.last_error):
            dcp.load(state_dict, storage_reader=reader, process_group=self._ctl_group)
        self.last_load_stats = reader.last_stats
        self._last_step = step
        self._last_save_t = self._last_local_t = time.monotonic()
        logger.info("resumed from %s (step %s%s)", redact_url(url), step,
                    ", local-only save" if commit is not None else "")
        return step

    def _newest_local_only(self) -> tuple[int, str, _tier.LocalCommit] | None:
        """The newest local-only save of this run that the whole group holds: every saving
        rank's descriptor found (and checked) in some rank's tier, with one save id and one
        manifest digest. One all_gather_object; the same answer on every rank."""
        if self.local_tier is None:
            return None
        prefix = _tier.normal_url(self.root) + "/"

        def step_of(url: str) -> int | None:
            name = url[len(prefix):] if url.startswith(prefix) else ""
            step = catalog.step_of(name, self.step_pattern) if name and "/" not in name \
                else None
            if step is None or _tier.normal_url(self.url_for(step)) != url:
                return None
            return step

        mine = _tier.find_local_only(self.local_tier, lambda u: step_of(u) is not None)
        found = [c.without_commit() for c in mine]
        if self._distributed:
            gathered: list[Any] = [None] * dist.get_world_size(self._ctl_group)
            dist.all_gather_object(gathered, found, group=self._ctl_group)
        else:
            gathered = [found]
        ranks: dict[tuple[str, str, str, int], set[int]] = {}
        holders: dict[tuple[str, str, str, int], list[int]] = {}
        created: dict[tuple[str, str, str, int], float] = {}
        for member, copies in enumerate(gathered):
            for c in copies if isinstance(copies, list) else []:
                if not isinstance(c, _tier.LocalOnlyCopy):
                    continue
                ranks.setdefault(c.key(), set()).add(c.rank)
                if member not in holders.setdefault(c.key(), []):
                    holders[c.key()].append(member)
                created[c.key()] = max(created.get(c.key(), 0.0), c.created)
        complete = []
        for key, got in ranks.items():
            step = step_of(key[0])
            if step is not None and got == set(range(key[3])):
                complete.append((step, created[key], key))
            elif step is not None:
                logger.info("local-only save of step %d (%s) is not complete across the group "
                            "(descriptors of %d of %d ranks): not used", step, key[1],
                            len(got), key[3])
        if not complete:
            return None
        step, _, key = max(complete)
        commit = next((c.commit for c in mine if c.key() == key), None)
        if self._distributed and len(holders[key]) < len(gathered):
            box: list[Any] = [commit]  # some rank's tier has no copy: the first holder's
            dist.broadcast_object_list(box, group_src=min(holders[key]), group=self._ctl_group)
            commit = box[0] if isinstance(box[0], _tier.LocalCommit) else None
        if commit is None:  # cannot happen: the save is complete, so some rank holds it
            raise errors.IntegrityError(f"the local-only save of step {step} lost its "
                                        ".metadata while loading")
        return step, self.url_for(step), commit

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
            self._finish_pending()
        finally:
            if self._writer is not None:
                self._writer.close()

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
