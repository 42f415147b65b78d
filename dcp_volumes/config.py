"""Frozen, validated option dataclasses for :class:`~dcp_volumes.VolumeWriter` and
:class:`~dcp_volumes.VolumeReader`.

Every field is documented in ``docs/configuration.md`` with its default and when to
change it. Construction validates the values and says what to change when one is wrong.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from dcp_volumes.errors import ConfigError

__all__ = ["LocalTierOptions", "MiB", "RetryOptions", "SpoolOptions", "TransferOptions",
           "check_local_tier", "checked_option"]

MiB = 1 << 20

SPOOL_DIR_ENV = "DCP_VOLUMES_SPOOL_DIR"


OptionsT = TypeVar("OptionsT")


def checked_option(name: str, value: object, cls: type[OptionsT]) -> OptionsT | None:
    """``name=`` (an options argument: ``retry=``, ``transfer=``, ``local_tier=``, ...)
    checked to be a ``cls`` or None, in one wording everywhere.

    Raises:
        ConfigError: naming the argument, the type expected and the type given.
    """
    if value is None or isinstance(value, cls):
        return value
    raise ConfigError(f"{name}= must be a {cls.__name__} or None, got {type(value).__name__}")


def _positive_int(name: str, value: object, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}: {hint}")


@dataclass(frozen=True, kw_only=True)
class SpoolOptions:
    """Where each rank serializes its shards before upload.

    Attributes:
        mode: ``"disk"`` writes shards to ``directory`` at disk speed, never waiting for the
            network; ``"memory"`` keeps at most ``max_concurrency + 1`` parts in RAM and makes
            serialization wait for uploads (use it where local disk is slower than the network).
        directory: spool directory for ``mode="disk"``. Default: ``$DCP_VOLUMES_SPOOL_DIR``,
            else the system temp dir. Put it on fast local NVMe.
        files_per_rank: shard files each rank writes, balanced by size. More files means more
            objects uploaded in parallel; each file is itself uploaded in parallel parts.
        free_space_margin: the spool must have ``margin × rank bytes`` free before a save starts.
        direct_io: write and read the spool files with ``O_DIRECT`` (``mode="disk"``),
            bypassing the page cache, which for a file read once and deleted only costs CPU
            (see docs/benchmarks.md, client CPU per GiB). ``None`` (default): on, unless a
            :class:`LocalTierOptions` keeps the files (a restart then finds them in the page
            cache). A filesystem that refuses ``O_DIRECT`` (tmpfs) is written through the
            cache whatever this says.
    """

    mode: Literal["disk", "memory"] = "disk"
    directory: str | None = None
    files_per_rank: int = 2
    free_space_margin: float = 1.1
    direct_io: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("disk", "memory"):
            raise ConfigError(f"SpoolOptions.mode must be 'disk' or 'memory', got {self.mode!r}")
        _positive_int("SpoolOptions.files_per_rank", self.files_per_rank, "use 1..16")
        if not (isinstance(self.free_space_margin, (int, float)) and self.free_space_margin >= 1.0):
            raise ConfigError(
                f"SpoolOptions.free_space_margin must be >= 1.0, got {self.free_space_margin!r}"
            )
        if self.directory is not None and not isinstance(self.directory, (str, os.PathLike)):
            raise ConfigError("SpoolOptions.directory must be a path string or None")
        if self.direct_io not in (None, True, False):
            raise ConfigError(
                f"SpoolOptions.direct_io must be True, False or None (automatic), got "
                f"{self.direct_io!r}")

    def resolved_directory(self) -> str:
        """The spool directory this process will use."""
        return os.fspath(self.directory or os.environ.get(SPOOL_DIR_ENV) or tempfile.gettempdir())


@dataclass(frozen=True, kw_only=True)
class TransferOptions:
    """Concurrency and sizes of uploads and downloads.

    Attributes:
        part_size: bytes per multipart part / Azure block / ranged GET. S3 requires >= 5 MiB.
        max_concurrency: requests in flight per rank (uploads: the most the adaptive limit
            may reach). Payload bytes held in memory by the transfer engine stay below
            ``max_concurrency × part_size``.
        adaptive_concurrency: let each save find its number of part uploads in flight: it
            starts at ``max_concurrency`` when the fastest of three small requests to the
            store (S3 ``HeadBucket``) takes 10 ms or more (far away: throughput grows with
            connections), else at 2, and doubles while
            that raises throughput by 25% or more (until serialization ends). A store that is
            CPU-bound (a local server) only slows down under more parallel parts. ``False``:
            always ``max_concurrency``.
        coalesce_gap: on load, neighbouring byte ranges of one file closer than this are fetched
            with one GET (the gap is read and discarded).
        max_range_size: on load, coalesced ranges stop growing past this size.
        throttle_backoff: react to throttling (S3 ``SlowDown``, HTTP 429/503, Azure
            ``ServerBusy``): this process then paces its requests to that bucket, cutting
            the rate to 0.7× what it sent on each throttle and growing it back linearly,
            shared by every save and load of the process; and each save halves its parts
            in flight, then adds one back per part that finishes without a further cut.
            ``False``: retries (backoff with full jitter) are the only reaction, as before.
        key_layout: ``"flat"`` puts every shard file right under the checkpoint directory
            (torch's own layout). ``"hashed"`` puts each shard file under a two-hex-digit
            directory hashed from its rank and file index (``<ckpt>/3f/__0_0-….distcp``), so
            a save's requests spread over up to 256 key prefixes, which S3 can partition
            apart. Both load with ``VolumeReader`` and with torch's own readers (see
            ``docs/configuration.md``).
    """

    part_size: int = 16 * MiB
    max_concurrency: int = 16
    adaptive_concurrency: bool = True
    coalesce_gap: int = 1 * MiB
    max_range_size: int = 32 * MiB
    throttle_backoff: bool = True
    key_layout: Literal["flat", "hashed"] = "flat"

    def __post_init__(self) -> None:
        _positive_int("TransferOptions.part_size", self.part_size, "e.g. 16 * 2**20")
        if self.part_size < 5 * MiB:
            raise ConfigError(
                f"TransferOptions.part_size must be >= 5 MiB (the S3 minimum part), got "
                f"{self.part_size}: raise it"
            )
        if self.part_size % (256 * 1024):
            raise ConfigError(
                f"TransferOptions.part_size must be a multiple of 256 KiB (GCS chunk rule), got "
                f"{self.part_size}"
            )
        _positive_int("TransferOptions.max_concurrency", self.max_concurrency, "use 1..64")
        if self.max_concurrency > 256:
            raise ConfigError("TransferOptions.max_concurrency above 256 is not supported")
        if isinstance(self.coalesce_gap, bool) or not isinstance(self.coalesce_gap, int) \
                or self.coalesce_gap < 0:
            raise ConfigError(f"TransferOptions.coalesce_gap must be >= 0, got {self.coalesce_gap!r}")
        _positive_int("TransferOptions.max_range_size", self.max_range_size, "e.g. 32 * 2**20")
        if not isinstance(self.adaptive_concurrency, bool):
            raise ConfigError("TransferOptions.adaptive_concurrency must be True or False, got "
                              f"{self.adaptive_concurrency!r}")
        if not isinstance(self.throttle_backoff, bool):
            raise ConfigError("TransferOptions.throttle_backoff must be True or False, got "
                              f"{self.throttle_backoff!r}")
        if self.key_layout not in ("flat", "hashed"):
            raise ConfigError(f"TransferOptions.key_layout must be 'flat' (the default, torch's "
                              f"layout) or 'hashed', got {self.key_layout!r}")


@dataclass(frozen=True, kw_only=True)
class RetryOptions:
    """Retries of transient failures (throttling, 5xx, resets, timeouts).

    Attributes:
        max_attempts: attempts per request, the first included. With
            ``TransferOptions.throttle_backoff`` on, a throttle answer (SlowDown, 429, 503)
            spends a quarter of one while the store answers the process's other requests
            (the pacing keeps those retries from adding load); a store that refuses
            everything gets whole attempts.
        initial_backoff_s: backoff before the first retry; doubles each retry.
        max_backoff_s: cap of one backoff.
        jitter: draw each backoff uniformly in ``[0, backoff]`` ("full jitter").
        deadline_s: stop retrying one request after this many seconds (None: no deadline).
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    jitter: bool = True
    deadline_s: float | None = 120.0

    def __post_init__(self) -> None:
        _positive_int("RetryOptions.max_attempts", self.max_attempts, "1 disables retries")
        for name in ("initial_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ConfigError(f"RetryOptions.{name} must be a number >= 0, got {value!r}")
        if self.deadline_s is not None and not (
            isinstance(self.deadline_s, (int, float)) and self.deadline_s > 0
        ):
            raise ConfigError(f"RetryOptions.deadline_s must be > 0 or None, got {self.deadline_s!r}")


@dataclass(frozen=True, kw_only=True)
class LocalTierOptions:
    """A local replica of every save on this node, used first when loading.

    With it, each rank keeps its spooled shard files after they uploaded (moved, not copied,
    when the tier and the spool share a filesystem) under
    ``<directory>/<checkpoint key>/<save id>/``, and a load reads every byte range it can
    from there (checked against the same CRC32C as a store read; anything missing, the wrong
    size or corrupt is fetched from the store instead). The store's ``.metadata`` stays the
    only record of what is committed: a local copy is used only for the save the committed
    ``.metadata`` names. Needs ``SpoolOptions(mode="disk")``.

    Attributes:
        directory: the tier's directory, on node-local disk (NVMe). Ranks on one node may
            share it; created on first use.
        keep_last: saves kept in the directory (all checkpoints together, oldest evicted
            first after each save); ``None``: no count limit.
        max_bytes: bytes kept in the directory (all checkpoints together, oldest saves
            evicted first after each save, the newest one too if it alone is larger);
            ``None``: no byte limit.
        partner_replicas: (opt-in) after each save (``Checkpointer`` only), every rank also
            sends its kept files to a partner rank on another node, which keeps them in its
            own tier as a replica: a node whose tier is lost restores from its partners over
            the process group instead of the store. Replicas count against ``keep_last``
            and ``max_bytes`` of the partner's tier; they are never durable.
        ranks_per_node: ranks on one node, for the derived partner map (partner of rank
            ``r``: ``(r + ranks_per_node) % world``, the same local rank on the next node).
            ``None``: ``$LOCAL_WORLD_SIZE`` (set by torchrun), else the ranks sharing rank
            0's host name.
        partners: explicit ``{rank: partner rank}`` overriding the derived partner of the
            ranks it names (each partner on another node).
    """

    directory: str
    keep_last: int | None = 2
    max_bytes: int | None = None
    partner_replicas: bool = False
    ranks_per_node: int | None = None
    partners: Mapping[int, int] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)) or not os.fspath(self.directory):
            raise ConfigError(
                f"LocalTierOptions.directory must be a non-empty path on node-local disk, got "
                f"{self.directory!r}"
            )
        if self.keep_last is not None:
            _positive_int("LocalTierOptions.keep_last", self.keep_last,
                          "the number of saves to keep locally (e.g. 2), or None for no limit")
        if self.max_bytes is not None:
            _positive_int("LocalTierOptions.max_bytes", self.max_bytes,
                          "a byte budget (e.g. 200 * 2**30), or None for no limit")
        if not isinstance(self.partner_replicas, bool):
            raise ConfigError(f"LocalTierOptions.partner_replicas must be True or False, got "
                              f"{self.partner_replicas!r}")
        if self.ranks_per_node is not None:
            _positive_int("LocalTierOptions.ranks_per_node", self.ranks_per_node,
                          "the ranks on one node (e.g. 8), or None for $LOCAL_WORLD_SIZE")
        if self.partners is not None:
            if not isinstance(self.partners, Mapping):
                raise ConfigError(f"LocalTierOptions.partners must be a mapping of rank to "
                                  f"partner rank or None, got {type(self.partners).__name__}")
            for rank, partner in self.partners.items():
                for what in (rank, partner):
                    if isinstance(what, bool) or not isinstance(what, int) or what < 0:
                        raise ConfigError(
                            f"LocalTierOptions.partners maps ranks (integers >= 0) to ranks, "
                            f"got {rank!r}: {partner!r}")
                if rank == partner:
                    raise ConfigError(
                        f"LocalTierOptions.partners maps rank {rank} to itself: a partner "
                        "holds a copy on another node; name a rank of another node")
                if self.ranks_per_node is not None and \
                        rank // self.ranks_per_node == partner // self.ranks_per_node:
                    raise ConfigError(
                        f"LocalTierOptions.partners maps rank {rank} to rank {partner}, on the "
                        f"same node ({self.ranks_per_node} ranks per node): a replica must be "
                        "on another node")
            object.__setattr__(self, "partners", dict(self.partners))
        if (self.ranks_per_node is not None or self.partners is not None) \
                and not self.partner_replicas:
            raise ConfigError("LocalTierOptions.ranks_per_node / partners are used only with "
                              "partner_replicas=True: set it, or drop them")

    def resolved_directory(self) -> str:
        """The tier directory as an absolute path."""
        return os.path.abspath(os.fspath(self.directory))


def check_local_tier(local_tier: object, spool: SpoolOptions) -> LocalTierOptions | None:
    """``local_tier=`` of a writer (or a Checkpointer) checked against its spool options."""
    tier = checked_option("local_tier", local_tier, LocalTierOptions)
    if tier is None:
        return None
    if spool.mode != "disk":
        raise ConfigError(
            "local_tier= keeps the spooled files, and SpoolOptions(mode='memory') spools to "
            "no file: use SpoolOptions(mode='disk') (ideally on the tier's filesystem, so "
            "files are moved, not copied), or drop local_tier=")
    return tier
