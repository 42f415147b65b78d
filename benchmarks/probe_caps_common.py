"""Shared pieces of ``probe_store_capabilities.py``: the result row, outcome capture, checksums.

Checksums are computed here (``crc32c`` is C; CRC-64/NVME is a table loop, ~1 s per 5 MiB),
so the probes send exactly the values they choose, right or deliberately wrong, instead of
relying on a client library that may compute, skip or validate them on its own.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c

__all__ = [
    "MIB",
    "Row",
    "attempt",
    "b64",
    "crc32c_b64",
    "crc32c_int",
    "crc64nvme_b64",
    "crc64nvme_int",
    "describe_error",
    "flip_b64",
    "md5_b64",
    "random_bytes",
]

MIB = 1024 * 1024

_CRC64_POLY = 0x9A6C9329AC4BC9B5  # CRC-64/NVME, reflected (S3's CRC64NVME)
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _crc64_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _CRC64_POLY if c & 1 else c >> 1
        table.append(c)
    return table


_CRC64_TABLE = _crc64_table()


@dataclass(frozen=True, kw_only=True)
class Row:
    """One probe's result: ``outcome`` is short (works / error CODE (HTTP n) / ignored ...)."""

    store: str
    probe: str
    outcome: str
    detail: str = ""


def attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run ``fn``; return ``(result, None)`` or ``(None, "error CODE (HTTP n)")``."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - every failure is a probe result
        return None, describe_error(exc)


def describe_error(exc: BaseException) -> str:
    """A short, comparable description of a client exception (boto, azure, requests)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        code = response.get("Error", {}).get("Code", "?")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        return f"error {code} (HTTP {status})"
    code = getattr(exc, "error_code", None)
    code = getattr(code, "value", code)  # azure's StorageErrorCode enum
    status = getattr(exc, "status_code", None)
    if response is not None:
        status = status or getattr(response, "status_code", None)
        headers = getattr(response, "headers", None) or {}
        code = code or headers.get("x-ms-error-code")
    if code is not None or status is not None:
        return f"error {code or '-'} (HTTP {status})"
    return f"error {type(exc).__name__}: {str(exc)[:120]}"


def random_bytes(n: int) -> bytes:
    return os.urandom(n)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def crc32c_int(data: bytes, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value=value))


def crc32c_b64(data: bytes) -> str:
    return b64(crc32c_int(data).to_bytes(4, "big"))


def crc64nvme_int(data: bytes) -> int:
    crc = _MASK64
    table = _CRC64_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ _MASK64


def crc64nvme_b64(data: bytes) -> str:
    return b64(crc64nvme_int(data).to_bytes(8, "big"))


def md5_b64(data: bytes) -> str:
    return b64(hashlib.md5(data).digest())


def flip_b64(value: str) -> str:
    """A well-formed but wrong checksum of the same length (first byte inverted)."""
    raw = bytearray(base64.b64decode(value))
    raw[0] ^= 0xFF
    return b64(bytes(raw))
