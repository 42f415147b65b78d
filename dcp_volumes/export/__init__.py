"""Export and interop: committed DCP checkpoints in any store to Hugging Face safetensors.

:func:`export_safetensors` (and ``dcp-volumes export SRC DEST --to safetensors``) reads a
committed checkpoint through the reader's serve path (ranged, verified), computes every
output file's header from ``.metadata`` before any tensor byte moves, and streams the bytes
into the upload in file order, so memory stays flat in the model size; the index (or the
single file) is committed last. See ``docs/export.md``.

Modules: ``_plan`` (pure, torch-free: selection, dtypes, files, headers, rank split),
``_fetch`` (the source: slabs through the serve path), ``_dest`` (clearing, streaming
uploads, the commit), ``_run`` (the lifecycle, one or many ranks).
"""

from __future__ import annotations

from dcp_volumes.export._run import ExportReport, export_safetensors

__all__ = ["ExportReport", "export_safetensors"]
