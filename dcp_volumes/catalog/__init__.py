"""The checkpoints of a run: list, latest, retention, verify, describe, remove, gc.

A run keeps its checkpoints under one root, one directory (prefix) per checkpoint::

    s3://bucket/run-42/
      step-00001000/   .metadata, .dcpv-manifest-<id>.json, __<rank>_<i>-<id>.distcp
      step-00002000/   (no .metadata: incomplete -- being written, or killed)

Listing costs **one** recursive listing of the root (a paginated LIST of the prefix on object
stores: one request per 1000 objects), grouped by the first path component -- never one LIST
per checkpoint, so it stays cheap with thousands of checkpoints. :func:`latest` lists on one
rank and broadcasts the answer. Every backend call goes through :class:`~dcp_volumes.backends.Backend`
so errors are translated in one place.

A checkpoint is *complete* only if it loads: its ``.metadata`` parses safely and, when
VolumeWriter wrote it, its manifest is there and belongs to the same save (the one
definition, :mod:`dcp_volumes._complete`, which the writer's existence check uses too).
:func:`latest`, :func:`apply_retention` and :func:`list_checkpoints` read the newest committed
checkpoints (newest first, concurrently) to tell; older ones are not read (see ``_check``).

Importing this package does not import torch; reading a ``.metadata`` (to check that a
checkpoint loads, to verify, describe or gc it) and a distributed :func:`latest` do.

Modules: ``_scan`` (one listing, grouped into checkpoints), ``_check`` (reading the newest
committed checkpoints), ``_listing`` (:func:`list_checkpoints`, :func:`latest`), ``_retention`` (:func:`remove`,
:func:`apply_retention`), ``_verify`` (+ ``_verify_read``, ``_verify_report``), ``_describe``, ``_gc`` (+
``_gc_survey``, ``_gc_report``), ``_committed`` (reading a
checkpoint's committed ``.metadata`` and manifest), ``_tiers`` (what a node's local tier
holds of a run: :func:`local_tier_copies`) and ``_common`` (step patterns, counts,
times).
"""

from __future__ import annotations

from dcp_volumes.catalog._common import (
    DEFAULT_STEP_PATTERN,
    Progress,  # noqa: F401 -- the progress callback type, importable as before
    check_count,
    compile_step_pattern,
    step_of,
)
from dcp_volumes.catalog._describe import CheckpointDetails, EntryInfo, describe
from dcp_volumes.catalog._gc import gc
from dcp_volumes.catalog._gc_report import GcReport
from dcp_volumes.catalog._listing import CheckpointInfo, latest, list_checkpoints
from dcp_volumes.catalog._retention import apply_retention, delete_checkpoint, remove
from dcp_volumes.catalog._tiers import TierCopy, local_tier_copies
from dcp_volumes.catalog._verify import verify
from dcp_volumes.catalog._verify_report import FileReport, VerifyReport

__all__ = [
    "DEFAULT_STEP_PATTERN",
    "CheckpointDetails",
    "CheckpointInfo",
    "EntryInfo",
    "FileReport",
    "GcReport",
    "TierCopy",
    "VerifyReport",
    "apply_retention",
    "check_count",
    "compile_step_pattern",
    "delete_checkpoint",
    "describe",
    "gc",
    "latest",
    "list_checkpoints",
    "local_tier_copies",
    "remove",
    "step_of",
    "verify",
]
