"""Export and interop: committed DCP checkpoints in any store to Hugging Face safetensors,
and safetensors in any store as a DCP source.

:func:`export_safetensors` (and ``dcp-volumes export SRC DEST --to safetensors``) reads a
committed checkpoint through the reader's serve path (ranged, verified), computes every
output file's header from ``.metadata`` before any tensor byte moves, and streams the bytes
into the upload in file order, so memory stays flat in the model size; the index (or the
single file) is committed last. :class:`SafetensorsReader` is the other way: a DCP
``StorageReader`` over safetensors files whose headers are untrusted input, each rank
fetching only the element ranges its shards need. See ``docs/export.md``.

Modules: ``_format`` (the safetensors header: layout and the untrusted parse; torch-free),
``_options``, ``_plan``, ``_work`` and ``_ties`` (pure, torch-free: sizes and dtypes;
selection, files, headers; the rank split and slabs; tied duplicates), ``_fetch`` (the
source: slabs through the serve path), ``_dest`` (clearing, streaming uploads, the commit),
``_checks`` (before any byte moves), ``_group``, ``_stream``, ``_report`` and ``_run`` (the
lifecycle, one or many ranks), ``_source`` (:class:`SafetensorsReader`).

The names are resolved lazily (module ``__getattr__``), so ``_format`` and ``_plan`` are used
without importing torch (:func:`parse_size`, ``max_shard_size``'s parser, is torch-free: the
CLI checks a size before torch is imported).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcp_volumes.export._options import parse_size
    from dcp_volumes.export._report import ExportReport
    from dcp_volumes.export._run import export_safetensors
    from dcp_volumes.export._source import SafetensorsReader

__all__ = ["ExportReport", "SafetensorsReader", "export_safetensors", "parse_size"]

_LAZY: dict[str, str] = {
    "ExportReport": "dcp_volumes.export._report",
    "export_safetensors": "dcp_volumes.export._run",
    "SafetensorsReader": "dcp_volumes.export._source",
    "parse_size": "dcp_volumes.export._options",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
