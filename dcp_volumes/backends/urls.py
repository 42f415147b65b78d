"""Checkpoint URLs: the one parser, mapping a URL's scheme to the backend that serves it.

:func:`parse_url` refuses what is not a usable checkpoint URL (mistyped schemes, credentials
in the URL, read-only or wrapping protocols) with a :class:`~dcp_volumes.errors.ConfigError`
that says what to write instead.
"""

from __future__ import annotations

import os
import re

import fsspec

from dcp_volumes import errors
from dcp_volumes.backends.azure import AzureBackend
from dcp_volumes.backends.base import Backend
from dcp_volumes.backends.gcs import GCSBackend
from dcp_volumes.backends.generic import FsspecBackend
from dcp_volumes.backends.local import LocalBackend
from dcp_volumes.backends.memory import MemoryBackend
from dcp_volumes.backends.s3 import S3Backend
from dcp_volumes.backends.translate import redact_url

__all__ = ["SCHEMES", "backend_class", "parse_url"]

#: URL scheme → the backend that serves it
SCHEMES: dict[str, type[Backend]] = {
    "s3": S3Backend,
    "s3a": S3Backend,
    "gs": GCSBackend,
    "gcs": GCSBackend,
    "az": AzureBackend,
    "abfs": AzureBackend,
    "abfss": AzureBackend,
    "file": LocalBackend,
    "local": LocalBackend,
    "memory": MemoryBackend,
}


#: fsspec protocols that cannot hold a checkpoint (read-only, or wrappers of another URL)
_NOT_STORAGE = frozenset({
    "http", "https", "github", "git", "zip", "tar", "libarchive", "reference", "cached",
    "blockcache", "filecache", "simplecache", "dir", "data", "jupyter", "jlab", "dbfs+wrap",
})

_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def _known_protocol(word: str) -> bool:
    word = word.lower()
    return word in SCHEMES or word in fsspec.available_protocols()


def _refuse_typos(url: str) -> None:
    """``s3:/bucket/x``, ``s3//bucket/x``, ``s3:bucket/x``: a scheme with its ``://`` mistyped
    would otherwise name a local path and write under the current directory."""
    head = _SCHEME_RE.match(url)
    if head is None:
        return
    word, rest = head.group(0), url[head.end():]
    meant = None
    if rest.startswith(":/") or (rest.startswith(":") and _known_protocol(word)):
        meant = f"{word}://{rest[1:].lstrip('/')}"
    elif rest.startswith("//") and _known_protocol(word):
        meant = f"{word}://{rest.lstrip('/')}"
    if meant is not None:
        raise errors.ConfigError(
            f"checkpoint URL {redact_url(url)!r} looks like a mistyped scheme: did you mean "
            f"{redact_url(meant)!r}? (a local path would be written under the current directory; "
            "spell local paths without a scheme-like prefix, or as file:///absolute/path)"
        )


def _refuse_credentials(url: str, scheme: str, rest: str) -> None:
    netloc = rest.split("/", 1)[0]
    userinfo, at, _ = netloc.rpartition("@")
    if at and (":" in userinfo or SCHEMES.get(scheme) in (S3Backend, GCSBackend)):
        raise errors.ConfigError(
            f"checkpoint URL {redact_url(url)!r} carries credentials: URLs are logged and shown "
            "in errors, so pass keys through storage_options (e.g. {'key': ..., 'secret': ...}) "
            "or the environment instead"
        )


def parse_url(url: object) -> tuple[str, type[Backend]]:
    """``(scheme, backend class)`` of a checkpoint URL, validated.

    Raises:
        ConfigError: the URL is not a string or path, is empty, malformed, looks like a
            mistyped scheme, carries credentials, or names a protocol that cannot hold a
            checkpoint; the message says what to write instead.
    """
    url = _text_of(url)
    if "://" not in url:
        _refuse_typos(url)
        return "file", LocalBackend
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise errors.ConfigError(f"malformed checkpoint URL {redact_url(url)!r}")
    _refuse_credentials(url, scheme, rest)
    cls = _backend_class(scheme, url)
    _check_path(url, scheme, rest, cls)
    return scheme, cls


def _text_of(url: object) -> str:
    """The URL as non-empty text (a path-like turned into its string)."""
    if not isinstance(url, (str, os.PathLike)):
        raise errors.ConfigError(
            f"checkpoint URL must be a string or os.PathLike, got {type(url).__name__}: pass "
            "e.g. 's3://bucket/run/step-100' or a local directory path")
    url = os.fspath(url)
    if not isinstance(url, str):
        raise errors.ConfigError("checkpoint URL must be text, not bytes: decode it first")
    if not url.strip():
        raise errors.ConfigError("checkpoint URL is empty: pass e.g. s3://bucket/run/step-100")
    return url


def _backend_class(scheme: str, url: str) -> type[Backend]:
    """The backend for ``scheme``: ours, else any installed fsspec protocol that can hold a
    checkpoint."""
    cls = SCHEMES.get(scheme)
    if cls is not None:
        return cls
    if scheme in _NOT_STORAGE:
        raise errors.ConfigError(
            f"{scheme}:// cannot hold a checkpoint ({redact_url(url)!r}): use s3://, gs://, "
            "az://, abfs://, file:// or memory://")
    try:
        fsspec.get_filesystem_class(scheme)
    except (ValueError, ImportError) as exc:
        raise errors.ConfigError(
            f"unknown URL scheme {scheme!r} in {redact_url(url)!r}: use s3://, gs://, az://, "
            "abfs://, file:// or memory:// (or any installed fsspec protocol)"
        ) from exc
    return FsspecBackend


def _check_path(url: str, scheme: str, rest: str, cls: type[Backend]) -> None:
    """The part after the scheme names a bucket (object stores) and a path."""
    if cls.object_store and (not rest or rest.startswith("/")):
        raise errors.ConfigError(
            f"malformed checkpoint URL {redact_url(url)!r}: expected {scheme}://bucket/path"
        )
    if not rest.strip("/"):
        raise errors.ConfigError(
            f"checkpoint URL {redact_url(url)!r} names no path (it would save into the current "
            f"or root directory): write e.g. {scheme}:///absolute/path/step-100"
            if cls is LocalBackend else
            f"checkpoint URL {redact_url(url)!r} names no path: write {scheme}://location/path"
        )


def backend_class(url: str | os.PathLike[str]) -> type[Backend]:
    """The backend class that serves ``url`` (validated as by :func:`parse_url`)."""
    return parse_url(url)[1]
