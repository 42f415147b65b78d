"""Error translation and transience, as tables: what each backend raises → what users get."""

from __future__ import annotations

import asyncio
import errno

import pytest
from _error_shapes import AzureErrorShape, ClientErrorShape, HttpErrorShape

from dcp_volumes import errors
from dcp_volumes.backends import redact_url
from dcp_volumes.backends.translate import is_transient, translate_error


class ServerDisconnectedError(Exception):
    """Matched by type name, so aiohttp need not be importable."""


def _wrapped(inner: BaseException) -> BaseException:
    """A filesystem re-raising a client error as a builtin (``raise OSError from inner``)."""
    try:
        try:
            raise inner
        except Exception as e:
            raise OSError("wrapped") from e
    except OSError as outer:
        return outer


TRANSLATIONS = [
    ("s3-access-denied", ClientErrorShape("AccessDenied", 403), errors.StoragePermissionError),
    ("s3-bad-key", ClientErrorShape("InvalidAccessKeyId", 403), errors.StoragePermissionError),
    ("http-401", HttpErrorShape(401), errors.StoragePermissionError),
    ("permission-builtin", PermissionError("no"), errors.StoragePermissionError),
    ("s3-no-bucket", ClientErrorShape("NoSuchBucket", 404), errors.BucketNotFoundError),
    ("azure-no-container", AzureErrorShape(404, "ContainerNotFound"), errors.BucketNotFoundError),
    ("s3-precondition", ClientErrorShape("PreconditionFailed", 412), errors.CheckpointExistsError),
    ("http-412", HttpErrorShape(412), errors.CheckpointExistsError),
    ("azure-exists", AzureErrorShape(409, "BlobAlreadyExists"), errors.CheckpointExistsError),
    ("file-exists", FileExistsError("x"), errors.CheckpointExistsError),
    ("s3-invalid-range", ClientErrorShape("InvalidRange", 416), errors.IntegrityError),
    ("s3-no-key", ClientErrorShape("NoSuchKey", 404), errors.ObjectNotFoundError),
    ("azure-no-blob", AzureErrorShape(404, "BlobNotFound"), errors.ObjectNotFoundError),
    ("file-not-found", FileNotFoundError("x"), errors.ObjectNotFoundError),
    ("wrapped-no-key", _wrapped(ClientErrorShape("NoSuchKey", 404)), errors.ObjectNotFoundError),
    ("s3-slowdown", ClientErrorShape("SlowDown", 503), errors.UploadError),
    ("http-500", HttpErrorShape(500), errors.UploadError),
    ("other", ValueError("odd"), errors.UploadError),
]


@pytest.mark.parametrize(("exc", "expected"), [(e, x) for _, e, x in TRANSLATIONS],
                         ids=[i for i, _, _ in TRANSLATIONS])
def test_translation_table(exc: BaseException, expected: type[errors.DCPVolumesError]) -> None:
    out = translate_error(exc, url="s3://KEY:SECRET@bucket/run/x", op="upload")
    assert type(out) is expected
    assert "SECRET" not in str(out)


@pytest.mark.parametrize("op", ["download", "list", "read"])
def test_read_side_failures_are_download_errors(op: str) -> None:
    assert type(translate_error(HttpErrorShape(500), url="s3://b/x", op=op)) is errors.DownloadError
    assert type(translate_error(ValueError(), url="s3://b/x", op=op)) is errors.DownloadError


def test_our_own_errors_pass_through_unchanged() -> None:
    mine = errors.IntegrityError("mine")
    assert translate_error(mine, url="s3://b/x", op="upload") is mine
    assert not is_transient(mine)


TRANSIENCE = [
    ("slowdown", ClientErrorShape("SlowDown", 503), True),
    ("throttling-code", ClientErrorShape("Throttling", 400), True),
    ("bad-digest", ClientErrorShape("BadDigest", 400), True),
    ("internal", ClientErrorShape("InternalError", 500), True),
    ("server-busy", AzureErrorShape(503, "ServerBusy"), True),
    ("http-429", HttpErrorShape(429), True),
    ("http-408", HttpErrorShape(408), True),
    ("http-502", HttpErrorShape(502), True),
    ("reset", ConnectionResetError(), True),
    ("timeout", TimeoutError(), True),
    ("asyncio-timeout", asyncio.TimeoutError(), True),
    ("disconnected-by-name", ServerDisconnectedError(), True),
    ("wrapped-slowdown", _wrapped(ClientErrorShape("SlowDown", 503)), True),
    ("econnreset-oserror", OSError(errno.ECONNRESET, "reset"), True),
    ("access-denied", ClientErrorShape("AccessDenied", 403), False),
    ("no-key", ClientErrorShape("NoSuchKey", 404), False),
    ("precondition", ClientErrorShape("PreconditionFailed", 412), False),
    ("http-400", HttpErrorShape(400), False),
    ("value-error", ValueError(), False),
    ("enospc", OSError(errno.ENOSPC, "full"), False),
]


@pytest.mark.parametrize(("exc", "transient"), [(e, t) for _, e, t in TRANSIENCE],
                         ids=[i for i, _, _ in TRANSIENCE])
def test_transience_table(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


@pytest.mark.parametrize(("url", "shown"), [
    ("s3://KEY:SECRET@bucket/x", "s3://***@bucket/x"),
    ("s3://bucket/x", "s3://bucket/x"),
    ("az://user@container/x", "az://***@container/x"),
], ids=["user-password", "none", "user-only"])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
