"""Torch's stream transforms on load: the ``transform_descriptors`` a ``FileSystemWriter(...,
_extensions=[ZStandard()])`` records per item, decoded with a bound.

torch writes such an item as ``transform(torch.save(value))`` and records the transforms'
descriptors (``"stream.zstd/1"``) in the item's ``_StorageInfo``; its own reader undoes them
in the order listed. Here:

- :func:`check_transforms` refuses, before any byte is fetched, a descriptor this
  installation cannot decode (an unknown name or version, or ``stream.zstd`` with neither
  ``zstandard`` nor ``pyzstd`` importable) with :class:`~dcp_volumes.errors.
  UnsupportedTransformError` naming it and what to install. A custom transform (torch's
  ``StreamTransformExtension``, e.g. an encryption) is decoded when the reader is given a
  torch ``ExtensionRegistry`` with it registered, as torch's ``FileSystemReader`` is.
- :func:`decode` undoes them with an output bound (:func:`decode_bound`): what the item's
  metadata allows (:func:`decoded_limit`), and never more than zstd's format can make of the
  bytes actually held (:data:`MAX_RATIO` per byte). ``.metadata`` is untrusted, so the first
  alone would let it claim any size; its chunks are checked to lie inside their tensor
  (:mod:`dcp_volumes._metacheck`), whose shape DCP's planner checks against the caller's
  own tensor. A frame that claims, or inflates to, more than the bound is an
  :class:`~dcp_volumes.errors.IntegrityError` before that memory is allocated, so a small
  crafted item cannot exhaust memory (the zstd decoders: :mod:`~dcp_volumes.transfer._zstd`;
  export decodes with the same bounds). A custom transform's stream is read in pieces and
  stopped past the same bound. The decoded item is a ``torch.save`` zip, whose
  per-record CRC-32 (written by torch by default) is checked (:func:`check_zip_crcs`):
  torch's own zip reader does not check it, and torch's zstd frames carry no checksum.
- :func:`check_untransformed` refuses an item whose ``.metadata`` records no transform
  (``None`` or an empty list) while its bytes are a zstd frame: its descriptors are missing,
  which torch's unpickler would report as "Unsupported operand 181" (the frame's second byte).
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from collections.abc import Sequence
from typing import Any

from dcp_volumes import errors
from dcp_volumes.transfer._zstd import decode_zstd, zstd_module

__all__ = ["MAX_OBJECT_BYTES", "MAX_RATIO", "READER_HOW", "TENSOR_OVERHEAD", "ZSTD_MAGIC",
           "check_transforms", "check_untransformed", "check_zip_crcs", "checked_registry",
           "decode", "decode_bound", "decoded_limit"]

#: the most a non-tensor item may decode to (DCP's pickled objects: configs, RNG and
#: dataloader state, optimizer param groups)
MAX_OBJECT_BYTES = 256 * 2**20
#: what ``torch.save`` adds to a tensor's bytes (its pickle, records, zip directory), at most
TENSOR_OVERHEAD = 64 * 2**10

#: the most one byte of a zstd stream can decode to: a block yields at most 128 KiB and takes
#: at least 4 bytes (an RLE block), so no stream, valid or crafted, inflates more
MAX_RATIO = 32768

_ZSTD = "stream.zstd"
#: the first bytes of every zstd frame (its magic number, 0xFD2FB528 little-endian)
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _parse(descriptor: object, what: str) -> tuple[str, str]:
    if not isinstance(descriptor, str) or len(descriptor) > 200:
        raise errors.UnsupportedTransformError(
            f"{what} has a stream transform descriptor that is not a short string: the "
            ".metadata is damaged or was not written by torch")
    name, _, version = descriptor.partition("/")
    return name, version


#: where a load takes the registry (what the errors tell a user to do)
READER_HOW = "VolumeReader(..., extension_registry=registry)"


def check_transforms(descriptors: Sequence[str], what: str, registry: Any = None, *,
                     how: str = READER_HOW) -> tuple[str, ...]:
    """The descriptors, once each is known to be decodable here.

    ``registry``: torch's ``ExtensionRegistry`` (what torch's ``FileSystemReader`` takes as
    ``_extension_registry``) with the custom stream transforms the writer used registered;
    ``stream.zstd`` is always decoded here, by the bounded decoder. ``how``: where the
    caller passes a registry (named in the error when one is missing).

    Raises:
        UnsupportedTransformError: an unknown transform or version (not ``stream.zstd`` and
            not in ``registry``), or ``stream.zstd`` without ``zstandard``/``pyzstd``; the
            message names it and what to install or register.
    """
    if isinstance(descriptors, (str, bytes)) or not isinstance(descriptors, Sequence) \
            or len(descriptors) > 8:
        raise errors.UnsupportedTransformError(
            f"{what} has stream transform descriptors that are not a short list: the "
            ".metadata is damaged or was not written by torch")
    out = []
    for descriptor in descriptors:
        name, version = _parse(descriptor, what)
        if name != _ZSTD:
            _extension(registry, descriptor, what, how)
            out.append(descriptor)
            continue
        if version.partition(".")[0] != "1":
            raise errors.UnsupportedTransformError(
                f"{what} was written with version {version!r} of {_ZSTD!r}; dcp_volumes "
                "decodes version 1: upgrade dcp_volumes")
        zstd_module(what, descriptor)
        out.append(descriptor)
    return tuple(out)


def checked_registry(registry: Any) -> Any:
    """``registry`` if it is None or a torch ``ExtensionRegistry`` (duck-typed: torch's
    class is experimental and not in every version).

    Raises:
        ConfigError: it has no ``from_descriptor_list``.
    """
    if registry is not None and not callable(getattr(registry, "from_descriptor_list", None)):
        raise errors.ConfigError(
            "extension_registry= must be a torch ExtensionRegistry (torch.distributed."
            f"checkpoint._extension), got {type(registry).__name__}")
    return registry


def _extension(registry: Any, descriptor: str, what: str, how: str = READER_HOW) -> Any:
    """The registered extension that undoes ``descriptor`` (torch's ``from_descriptor``)."""
    if registry is None:
        raise errors.UnsupportedTransformError(
            f"{what} was written through the stream transform {descriptor!r}, which "
            f"dcp_volumes does not decode by itself (it decodes {_ZSTD!r}, torch's ZStandard "
            "extension): register the writer's extension in a torch ExtensionRegistry and "
            f"pass it as {how}")
    try:
        (extension,) = registry.from_descriptor_list([descriptor])
    except Exception as exc:  # torch raises ValueError; a custom from_descriptor anything
        raise errors.UnsupportedTransformError(
            f"{what} was written through the stream transform {descriptor!r}, which the "
            f"extension registry passed cannot decode ({type(exc).__name__}: is its "
            f"extension registered, at that version? it is passed as {how})") from exc
    if not callable(getattr(extension, "transform_from", None)):
        raise errors.UnsupportedTransformError(
            f"{what}: the extension registered for {descriptor!r} is not a stream transform "
            "(it has no transform_from)")
    return extension


def decoded_limit(chunk_sizes: Sequence[int] | None, element_size: int) -> int:
    """The most an item may decode to: a tensor chunk of ``chunk_sizes`` elements of
    ``element_size`` bytes plus ``torch.save``'s overhead, or (``None``: a non-tensor item)
    :data:`MAX_OBJECT_BYTES`."""
    if chunk_sizes is None:
        return MAX_OBJECT_BYTES
    return math.prod(chunk_sizes) * element_size + TENSOR_OVERHEAD


def decode_bound(limit: int, stored: int) -> int:
    """The most ``stored`` bytes of a zstd stream may decode to, given the ``limit`` the
    item's metadata allows (:func:`decoded_limit`): the smaller of the two and of what zstd's
    format can make of ``stored`` bytes (:data:`MAX_RATIO`). ``stored`` is the number of
    bytes actually held, not one read from storage; load and export both decode with it."""
    return max(0, min(limit, stored * MAX_RATIO))


def decode(descriptors: Sequence[str], data: memoryview, *, limit: int, what: str,
           registry: Any = None) -> memoryview:
    """Undo the transforms (in the order torch lists them), each output at most
    :func:`decode_bound` of ``limit`` and its input. ``stream.zstd`` is decoded here; any
    other descriptor by the extension ``registry`` has for it (:func:`check_transforms`),
    read in pieces and stopped past the same bound.

    Raises:
        IntegrityError: the data is not a valid stream of that transform, or claims or
            decodes to more than that bound.
    """
    out = data
    for descriptor in descriptors:
        bound = decode_bound(limit, len(out))
        if _parse(descriptor, what)[0] != _ZSTD:
            out = memoryview(_custom(_extension(registry, descriptor, what), out, bound,
                                     what, descriptor))
            continue
        out = memoryview(decode_zstd(zstd_module(what, descriptor), out, bound, what))
    return out


#: what a custom transform's stream is asked for at a time
_PIECE = 4 * 2**20


def _custom(extension: Any, data: memoryview, limit: int, what: str, descriptor: str
            ) -> bytes:
    """Read ``extension.transform_from(data)`` to its end, refusing more than ``limit``
    bytes: the work done is bounded by the bytes held and the item's metadata, never by a
    number the stream itself carries."""
    out = bytearray()
    try:
        stream = extension.transform_from(io.BytesIO(data))
        while True:
            piece = stream.read(min(_PIECE, limit + 1 - len(out)))
            if piece is None:  # a non-blocking stream with nothing to give: no progress
                raise ValueError("the stream returned no data before its end")
            if not piece:
                break
            out += piece
            if len(out) > limit:
                break
    except Exception as exc:  # the extension is caller code: whatever it raises
        raise errors.IntegrityError(
            f"{what}: its {descriptor!r} stream cannot be decoded ({type(exc).__name__}): "
            "the stored bytes are corrupt") from exc
    if len(out) > limit:
        raise errors.IntegrityError(
            f"{what}: its {descriptor!r} stream decodes to more than the {limit} bytes its "
            "metadata and its stored size allow: the stored bytes are damaged or crafted; "
            "refusing to decode it")
    return bytes(out)


def check_untransformed(data: memoryview, what: str) -> None:
    """Refuse a whole stored item that ``.metadata`` records as written without a stream
    transform when its bytes are a zstd frame. Such an item is a ``torch.save`` zip (or a
    legacy pickle) unless it went through torch's ZStandard extension, so its
    ``transform_descriptors`` were lost (``None`` or an empty list, which torch never
    writes for a transformed item).

    Raises:
        IntegrityError: the bytes start with :data:`ZSTD_MAGIC`.
    """
    if bytes(data[:4]) == ZSTD_MAGIC:
        raise errors.IntegrityError(
            f"{what} is stored compressed (a zstd frame, as torch's ZStandard extension "
            "writes), but .metadata records no stream transform for it: its "
            "transform_descriptors are missing. The .metadata is damaged or crafted; load an "
            "earlier checkpoint, or save this one again")


_LOCAL = struct.Struct("<4s5H3L2H")  # a zip local file header (30 bytes)


def check_zip_crcs(data: memoryview, what: str) -> None:
    """Check every stored record of a ``torch.save`` zip against its CRC-32 (torch writes
    them unless ``torch.serialization.set_crc32_options(False)``: a CRC of 0 is taken as
    not recorded). Data that is not a zip (a raw ``io.BytesIO`` value) is left alone.

    Raises:
        IntegrityError: a record's bytes do not match its CRC-32, or the zip is damaged.
    """
    if bytes(data[:4]) != b"PK\x03\x04":
        return
    import zipfile

    try:
        infos = zipfile.ZipFile(io.BytesIO(data)).infolist()  # the directory only
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise errors.IntegrityError(f"{what}: the decoded item is a damaged zip "
                                    f"({exc})") from exc
    for info in infos:
        start = info.header_offset
        if start + _LOCAL.size > len(data):
            raise errors.IntegrityError(f"{what}: the decoded zip's records are damaged")
        fields = _LOCAL.unpack_from(data, start)
        begin = start + _LOCAL.size + fields[9] + fields[10]
        end = begin + info.compress_size
        if fields[0] != b"PK\x03\x04" or end > len(data):
            raise errors.IntegrityError(f"{what}: the decoded zip's records are damaged")
        if info.compress_type != zipfile.ZIP_STORED or info.CRC == 0:
            continue
        if zlib.crc32(data[begin:end]) != info.CRC:
            raise errors.IntegrityError(
                f"{what}: record {info.filename!r} of the decoded item does not match its "
                "CRC-32: the stored bytes are corrupt")
