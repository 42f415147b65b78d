"""The plan of a safetensors export, from a checkpoint's ``.metadata`` alone (pure, torch-free).

Which stored items become which tensors of which output file, in which order, with every
file's header computed before any tensor byte moves:

1. keys under ``prefix`` are kept and the prefix stripped; then ``rename(name)`` (``None``
   drops the tensor); non-tensor items that pass both are reported and skipped;
2. floating tensors are cast to ``dtype`` when one is asked (others keep theirs);
3. tensors are sorted by output name and split into files the way Hugging Face does it
   (``huggingface_hub.split_torch_state_dict_into_shards``): a file takes tensors until the
   next one would pass ``max_shard_size`` (tensor bytes, headers not counted), and a tensor
   bigger than the maximum gets a file of its own. One file is ``model.safetensors``; more
   are ``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``.

Tied duplicates (``tied=``, confirmed byte-equal by :mod:`~dcp_volumes.export._ties`) are
left out before the split, as ``save_pretrained`` leaves them out. How the work is cut
across ranks and into slabs is :mod:`~dcp_volumes.export._work`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from dcp_volumes import errors
from dcp_volumes.export import _format
from dcp_volumes.export._options import FLOATING, output_dtype, parse_size

__all__ = ["INDEX", "RESERVED_NAMES", "SINGLE", "ExportPlan", "PlannedFile", "PlannedTensor",
           "Selection", "SourceItem", "numbered", "plan_export", "plan_files",
           "select_tensors"]

#: the one file of an export that fits in ``max_shard_size``
SINGLE = "model.safetensors"
#: the index of a multi-file export: written last, it makes the export complete
INDEX = "model.safetensors.index.json"
#: the name of a numbered file of an earlier export (any N)
NUMBERED_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
#: names the safetensors format reserves in a header: a tensor by one of these names would
#: replace the file's format metadata and make the file unreadable, so it is refused
RESERVED_NAMES = frozenset({"__metadata__"})
#: the metadata Hugging Face loaders look for (transformers refuses other formats)
FILE_METADATA = {"format": "pt"}


def numbered(i: int, n: int) -> str:
    """``model-0000i-of-0000n.safetensors`` (1-based, five digits as Hugging Face writes)."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True)
class SourceItem:
    """One item of ``.metadata``: a tensor (its dtype name and global shape) or not."""

    fqn: str
    dtype: str | None  # torch dtype attribute name; None for a non-tensor (bytes) item
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor: where it comes from, its name, dtypes and shape."""

    source: str
    name: str
    source_dtype: str
    dtype: str
    shape: tuple[int, ...]
    element_size: int  # of ``dtype``
    source_element_size: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.element_size

    @property
    def source_nbytes(self) -> int:
        return math.prod(self.shape) * self.source_element_size


@dataclass(frozen=True)
class PlannedFile:
    """One output file: its tensors in data order and its encoded header."""

    name: str
    tensors: tuple[PlannedTensor, ...]
    header: _format.Header
    header_bytes: bytes

    @property
    def size(self) -> int:
        return self.header.file_size


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes: the files, the index (multi-file only), what it skips."""

    files: tuple[PlannedFile, ...]
    skipped: tuple[str, ...]  # non-tensor items that were selected: not exportable
    not_selected: int  # items outside the prefix, or dropped by rename
    tied: tuple[tuple[str, str], ...] = ()  # (left out, the equal tensor kept), by name

    @property
    def total_size(self) -> int:
        """Bytes of tensor data (the index's ``metadata.total_size``)."""
        return sum(t.nbytes for f in self.files for t in f.tensors)

    @property
    def tensors(self) -> int:
        return sum(len(f.tensors) for f in self.files)

    @property
    def file_bytes(self) -> int:
        """Bytes of every file, headers included."""
        return sum(f.size for f in self.files)

    @property
    def single(self) -> bool:
        return len(self.files) == 1

    def index_bytes(self) -> bytes | None:
        """``model.safetensors.index.json`` of a multi-file export (None for one file)."""
        if self.single:
            return None
        weight_map = {t.name: f.name for f in self.files for t in f.tensors}
        doc = {"metadata": {"total_size": self.total_size},
               "weight_map": dict(sorted(weight_map.items()))}
        return (json.dumps(doc, indent=2) + "\n").encode()


def _select(items: Iterable[SourceItem], prefix: str | None,
            rename: Callable[[str], str | None] | None
            ) -> tuple[list[tuple[str, SourceItem]], list[str], int]:
    """(output name, item) of the selected tensors; selected non-tensor fqns; others."""
    chosen: list[tuple[str, SourceItem]] = []
    skipped: list[str] = []
    dropped = 0
    for item in items:
        if prefix and not item.fqn.startswith(prefix):
            dropped += 1
            continue
        name: str | None = item.fqn[len(prefix):] if prefix else item.fqn
        if rename is not None:
            name = rename(name)  # type: ignore[arg-type]
            if name is not None and not isinstance(name, str):
                raise errors.ConfigError(
                    f"rename({item.fqn!r}) returned {type(name).__name__}: return the new "
                    "name (a str) or None to drop the tensor")
        if name is None:
            dropped += 1
            continue
        if item.dtype is None:
            skipped.append(item.fqn)
            continue
        if not name:
            raise errors.ConfigError(
                f"item {item.fqn!r} would be exported with an empty name: choose a prefix "
                "that leaves a name, or rename it")
        if name in RESERVED_NAMES:
            raise errors.ConfigError(
                f"item {item.fqn!r} would be exported as {name!r}, a name the safetensors "
                "format reserves for the file's metadata: rename it (rename=) or choose "
                "another prefix")
        chosen.append((name, item))
    return chosen, skipped, dropped


def _prefixes(items: Sequence[SourceItem]) -> str:
    firsts = sorted({i.fqn.split(".", 1)[0] + ("." if "." in i.fqn else "")
                     for i in items if i.dtype is not None})
    return ", ".join(repr(p) for p in firsts[:10]) or "none (it holds no tensor)"


def _planned(name: str, item: SourceItem, dtype: str | None) -> PlannedTensor:
    assert item.dtype is not None
    out = dtype if dtype is not None and item.dtype in FLOATING else item.dtype
    try:
        code, source_code = _format.code_for(out), _format.code_for(item.dtype)
    except errors.ConfigError as exc:
        raise errors.ConfigError(f"tensor {item.fqn!r}: {exc}") from None
    return PlannedTensor(item.fqn, name, item.dtype, out, tuple(item.shape),
                         _format.DTYPES[code][1], _format.DTYPES[source_code][1])


def _split(tensors: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    groups: list[list[PlannedTensor]] = []
    size = 0
    for t in tensors:
        if not groups or (size + t.nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


@dataclass(frozen=True)
class Selection:
    """The tensors an export selects, sorted by output name, and what it leaves out."""

    tensors: tuple[PlannedTensor, ...]
    skipped: tuple[str, ...]  # selected non-tensor items
    not_selected: int  # items outside the prefix, or dropped by rename


def select_tensors(items: Sequence[SourceItem], *, prefix: str | None = None,
                   rename: Callable[[str], str | None] | None = None,
                   dtype: str | None = None) -> Selection:
    """Steps 1 and 2 of the module docstring (``rename`` is called once per item).

    Raises:
        ConfigError: as :func:`plan_export`.
    """
    out_dtype = output_dtype(dtype)
    chosen, skipped, dropped = _select(items, prefix, rename)
    if not chosen:
        under = f"under prefix {prefix!r}" if prefix else "selected"
        raise errors.ConfigError(
            f"no tensor of the checkpoint is {under} (of {len(items)} items; top-level "
            f"prefixes with tensors: {_prefixes(items)}): pass one of them as prefix "
            "(--prefix)")
    seen: dict[str, str] = {}
    for name, item in chosen:
        if name in seen:
            raise errors.ConfigError(
                f"items {seen[name]!r} and {item.fqn!r} would both be exported as {name!r}: "
                "change the prefix or the rename function so every name is unique")
        seen[name] = item.fqn
    tensors = sorted((_planned(n, i, out_dtype) for n, i in chosen), key=lambda t: t.name)
    return Selection(tuple(tensors), tuple(sorted(skipped)), dropped)


def plan_files(selection: Selection, max_shard_size: int | str = "5GB",
               tied: Mapping[str, str] | None = None) -> ExportPlan:
    """Step 3 of the module docstring, leaving out ``tied``: ``{name: kept name}`` of
    tensors each equal to a kept one (proven by :mod:`~dcp_volumes.export._ties`; here only
    checked to name exported tensors).

    Raises:
        ConfigError: a tie naming a tensor not exported or left out, a bad size.
    """
    max_bytes = parse_size(max_shard_size)
    tied = dict(tied or {})
    names = {t.name for t in selection.tensors}
    for name, kept in tied.items():
        if name not in names or kept not in names or kept in tied:
            raise errors.ConfigError(
                f"the tie {name!r} -> {kept!r} names a tensor that is not exported (or is "
                "itself left out): tie exported names to a kept one")
    groups = _split([t for t in selection.tensors if t.name not in tied], max_bytes)
    files = []
    for i, group in enumerate(groups, start=1):
        header, encoded = _format.layout(
            [(t.name, t.dtype, t.shape) for t in group], FILE_METADATA)
        name = SINGLE if len(groups) == 1 else numbered(i, len(groups))
        files.append(PlannedFile(name, tuple(group), header, encoded))
    return ExportPlan(tuple(files), selection.skipped, selection.not_selected,
                      tuple(sorted(tied.items())))


def plan_export(items: Sequence[SourceItem], *, prefix: str | None = None,
                rename: Callable[[str], str | None] | None = None, dtype: str | None = None,
                max_shard_size: int | str = "5GB", tied: Mapping[str, str] | None = None
                ) -> ExportPlan:
    """Plan the export of a checkpoint's ``items`` (see the module docstring):
    :func:`select_tensors`, then :func:`plan_files`.

    Raises:
        ConfigError: no tensor is selected (the message names the prefixes there are), two
            items map to one name, a name safetensors reserves (``__metadata__``), a
            tensor's dtype has no safetensors code, a tie naming a tensor not exported, a
            bad option.
    """
    parse_size(max_shard_size)
    selection = select_tensors(items, prefix=prefix, rename=rename, dtype=dtype)
    return plan_files(selection, max_shard_size, tied)
