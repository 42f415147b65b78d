"""torch's ``stream.zstd/1`` decoded with a bound (``zstandard`` or ``pyzstd``, whichever is
installed): a frame that claims, or inflates to, more than the bound is an
:class:`~dcp_volumes.errors.IntegrityError` before that memory is allocated."""

from __future__ import annotations

import importlib
from typing import Any

from dcp_volumes import errors

__all__ = ["INSTALL", "decode_zstd", "zstd_module"]

INSTALL = "pip install zstandard"


def zstd_module(what: str, descriptor: str) -> Any:
    for module in ("zstandard", "pyzstd"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise errors.UnsupportedTransformError(
        f"{what} is compressed with torch's ZStandard extension ({descriptor!r}), and "
        f"neither zstandard nor pyzstd is installed: {INSTALL}")


def decode_zstd(module: Any, data: memoryview, limit: int, what: str) -> bytes:
    """``data`` decoded by ``module`` (:func:`zstd_module`'s), at most ``limit`` bytes.

    Raises:
        IntegrityError: not a valid, complete zstd stream, or more than ``limit`` bytes.
    """
    if module.__name__ == "zstandard":
        return _zstandard(module, data, limit, what)
    return _pyzstd(module, data, limit, what)


def _bomb(what: str, why: str, limit: int) -> errors.IntegrityError:
    return errors.IntegrityError(
        f"{what}: its zstd stream {why}, more than the {limit} bytes its metadata and its "
        "stored size allow: the stored bytes are damaged or crafted; refusing to decode it")


def _corrupt(what: str, exc: BaseException) -> errors.IntegrityError:
    return errors.IntegrityError(
        f"{what}: its zstd stream cannot be decoded ({exc}): the stored bytes are corrupt")


def _zstandard(zstd: Any, data: memoryview, limit: int, what: str) -> bytes:
    try:
        claimed = zstd.frame_content_size(data)
    except zstd.ZstdError as exc:
        raise _corrupt(what, exc) from exc
    # the one-shot decoder allocates what the frame claims, so the claim is checked first;
    # without one it allocates max_output_size and fails beyond it
    if claimed > limit:
        raise _bomb(what, f"claims {claimed} bytes", limit)
    try:
        return bytes(zstd.ZstdDecompressor().decompress(data, max_output_size=max(limit, 1)))
    except zstd.ZstdError as exc:
        if claimed < 0 and "full frame" in str(exc):
            # a complete frame that does not fit, or a truncated one: both refused
            raise errors.IntegrityError(
                f"{what}: its zstd stream is truncated or decodes to more than the {limit} "
                "bytes its metadata and its stored size allow: the stored bytes are damaged "
                "or crafted") from exc
        raise _corrupt(what, exc) from exc


def _pyzstd(pyzstd: Any, data: memoryview, limit: int, what: str) -> bytes:
    decompressor = pyzstd.EndlessZstdDecompressor()
    out = bytearray()
    source: Any = data
    try:
        while True:
            piece = decompressor.decompress(source, max_length=limit + 1 - len(out))
            source = b""
            out += piece
            if len(out) > limit:
                raise _bomb(what, "inflates", limit)
            if not piece and decompressor.needs_input:
                break
    except pyzstd.ZstdError as exc:
        raise _corrupt(what, exc) from exc
    if not decompressor.at_frame_edge:
        raise errors.IntegrityError(f"{what}: its zstd stream is truncated: the stored "
                                    "bytes are damaged")
    return bytes(out)
