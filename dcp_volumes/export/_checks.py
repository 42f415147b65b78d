"""Checks an export makes before any byte moves: DEST is not SRC or inside it, and every
number ``.metadata`` claims for a tensor it exports is backed by stored bytes.

``.metadata`` is untrusted (``DESIGN.md``, "Trust boundary"): a 2 KB file may claim a tensor
of 10**15 elements, and an export that cut such a tensor into row slabs would build slabs in
proportion to the claim. So before any work is planned from a shape, every exported tensor's
stored chunks are checked against things not read from ``.metadata``: each chunk lies inside
the tensor and has a storage entry, the chunks' elements add up to the tensor's, every
entry lies inside its object's real size (one listing of SRC), and an entry stored as raw
bytes (no stream transform) holds at least its chunk's bytes, and an entry written through
a stream transform (zstd, or a custom one) claims no more than its stored bytes can decode
to (:data:`~dcp_volumes.transfer.transforms.MAX_RATIO` per byte, the bound the serve path
enforces as it decodes, as on load). Every transform is checked decodable here
(:func:`check_decodable`) before any byte is fetched.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from dcp_volumes import errors
from dcp_volumes.backends import Backend, redact_url
from dcp_volumes.export._plan import PlannedTensor
from dcp_volumes.transfer import transforms

__all__ = ["EXPORT_HOW", "check_claims", "check_decodable", "check_not_inside"]

#: where an export takes torch's ``ExtensionRegistry`` (named in its errors)
EXPORT_HOW = ("export_safetensors(..., extension_registry=registry), or on the command line "
              "dcp-volumes export --extension MODULE:CLASS")

#: the largest dimension a stored shape may claim (torch sizes are int64)
MAX_DIM = 2**62


def check_not_inside(src: Backend, dest: Backend) -> None:
    """Refuse a DEST that is SRC or inside it (``rm -r SRC`` would remove the export too,
    and the export's files would sit among the checkpoint's).

    Raises:
        ConfigError: DEST is SRC, or a directory or prefix inside it.
    """
    s_kind, s_end, s_root = src.place()
    d_kind, d_end, d_root = dest.place()
    if (s_kind, s_end) != (d_kind, d_end):
        return
    if d_root == s_root or d_root.startswith(s_root.rstrip("/") + "/"):
        raise errors.ConfigError(
            f"the destination {redact_url(dest.url)} is the checkpoint {redact_url(src.url)} "
            "or inside it: export to a directory or prefix outside the checkpoint")


def _bad(url: str, fqn: str, why: str) -> errors.IntegrityError:
    return errors.IntegrityError(
        f"{url}: .metadata of tensor {fqn!r} {why}: it is damaged or crafted; save the "
        "checkpoint again")


def check_claims(backend: Backend, metadata: Any, tensors: Iterable[PlannedTensor],
                 url: str) -> None:
    """Check what ``.metadata`` claims for each of ``tensors`` against SRC's real objects
    (module docstring), before anything is planned from it.

    Raises:
        IntegrityError: a claim is not backed by the stored bytes.
    """
    sizes = {o.name: o.size for o in backend.run(backend.scan)}
    for t in tensors:
        md = metadata.state_dict_metadata.get(t.source)
        shape = tuple(md.size) if md is not None else ()
        if md is None or not all(0 <= int(d) < MAX_DIM for d in shape):
            raise _bad(url, t.source, f"claims shape {list(shape)[:8]}")
        covered = sum(_check_chunk(metadata, t, chunk, shape, sizes, url)
                      for chunk in md.chunks)
        if covered != math.prod(shape):
            raise _bad(url, t.source, f"has chunks of {covered} elements in all, but its "
                                      f"shape {list(shape)} has {math.prod(shape)}")


def _check_chunk(metadata: Any, t: PlannedTensor, chunk: Any, shape: tuple[int, ...],
                 sizes: dict[str, int], url: str) -> int:
    """The elements of one stored chunk of ``t``, once its claims are checked."""
    offsets, lengths = tuple(chunk.offsets), tuple(chunk.sizes)
    if len(offsets) != len(shape) or len(lengths) != len(shape) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, lengths, shape)):
        raise _bad(url, t.source, f"has a chunk at {list(offsets)} of {list(lengths)} outside "
                                  f"its shape {list(shape)}")
    info = _storage_info(metadata, t.source, chunk)
    if info is None:
        raise _bad(url, t.source, f"has a chunk at {list(offsets)} with no storage entry")
    real = sizes.get(str(info.relative_path))
    offset, length = int(info.offset), int(info.length)
    if real is None or offset < 0 or length < 0 or offset + length > real:
        raise _bad(url, t.source, f"puts a chunk at bytes {offset}..{offset + length} of "
                                  f"{info.relative_path}, which has "
                                  f"{'no object' if real is None else f'{real} bytes'}")
    elements = math.prod(lengths)
    stored_max = length * transforms.MAX_RATIO if getattr(
        info, "transform_descriptors", None) else length
    if elements * t.source_element_size > stored_max:
        raise _bad(url, t.source, f"claims a chunk of {elements} elements stored in "
                                  f"{length} bytes")
    return elements


def check_decodable(metadata: Any, tensors: Iterable[PlannedTensor], registry: Any,
                    url: str) -> None:
    """Check that every stream transform an exported tensor's chunks were written through
    can be decoded here (zstd; a custom one when ``registry`` has it), before any fetch.

    Raises:
        UnsupportedTransformError: one cannot; the message names it and what to pass.
    """
    for t in tensors:
        for chunk in metadata.state_dict_metadata[t.source].chunks:
            info = _storage_info(metadata, t.source, chunk)
            descriptors = getattr(info, "transform_descriptors", None)
            if descriptors:
                transforms.check_transforms(descriptors, f"tensor {t.source!r} of {url}",
                                            registry, how=EXPORT_HOW)


def _storage_info(metadata: Any, fqn: str, chunk: Any) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    try:
        return metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
    except (TypeError, ValueError):
        return None
