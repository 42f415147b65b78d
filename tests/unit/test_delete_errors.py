"""A delete's error is a delete error, and which S3 keys DeleteObjects' XML can carry
(issue 37, finding 3; the store-level behaviour is in
tests/integration/test_delete_all_or_nothing.py)."""

from __future__ import annotations

import pytest
from _error_shapes import AzureErrorShape, ClientErrorShape, HttpErrorShape

from dcp_volumes import errors
from dcp_volumes.backends._s3_delete import printable, xml_can_carry
from dcp_volumes.backends.translate import throttled_too_long, translate_error

DELETES = [
    ("s3-malformed-xml", ClientErrorShape("MalformedXML", 400), errors.DeleteError),
    ("s3-internal-after-retries", ClientErrorShape("InternalError", 500), errors.DeleteError),
    ("http-500", HttpErrorShape(500), errors.DeleteError),
    ("azure-other", AzureErrorShape(409, "LeaseIdMissing"), errors.DeleteError),
    ("other", ValueError("odd"), errors.DeleteError),
    # a more specific error still wins
    ("s3-access-denied", ClientErrorShape("AccessDenied", 403), errors.StoragePermissionError),
    ("s3-no-bucket", ClientErrorShape("NoSuchBucket", 404), errors.BucketNotFoundError),
]


@pytest.mark.parametrize(("exc", "expected"), [(e, x) for _, e, x in DELETES],
                         ids=[i for i, _, _ in DELETES])
def test_a_failed_delete_is_a_delete_error(exc: BaseException,
                                          expected: type[errors.DCPVolumesError]) -> None:
    out = translate_error(exc, url="s3://KEY:SECRET@bucket/run/step-1", op="delete")
    assert type(out) is expected, repr(out)
    assert "SECRET" not in str(out)
    assert not isinstance(out, errors.UploadError)


def test_a_delete_the_store_kept_throttling_is_a_delete_error() -> None:
    out = throttled_too_long(ClientErrorShape("SlowDown", 503), url="s3://b/run", op="delete",
                             answers=9, seconds=130.0, deadline_s=120.0)
    assert type(out) is errors.DeleteError and "kept throttling" in str(out)


def test_delete_error_is_an_oserror_of_the_hierarchy() -> None:
    assert issubclass(errors.DeleteError, errors.DCPVolumesError)
    assert issubclass(errors.DeleteError, OSError)
    assert not issubclass(errors.DeleteError, errors.UploadError)


KEYS = [
    ("plain", "run/step-1/__0_0-6b0c22f0-4c8e65a2af79.distcp", True),
    ("tab-and-newline", "run/a\tb\nc", True),
    ("non-ascii", "run/été/日本/\U0001f600", True),
    ("x01", "run/a\x01b", False),
    ("x1f", "run/a\x1fb", False),
    ("nul", "run/a\x00b", False),
    ("carriage-return", "run/a\rb", False),  # read back as a line feed: another key
    ("ufffe", "run/a\ufffeb", False),
    ("uffff", "run/a\uffffb", False),
]


@pytest.mark.parametrize(("key", "carried"), [(k, c) for _, k, c in KEYS],
                         ids=[i for i, _, _ in KEYS])
def test_which_keys_deleteobjects_xml_can_carry(key: str, carried: bool) -> None:
    assert xml_can_carry(key) is carried


def test_keys_in_messages_show_what_a_terminal_would_hide() -> None:
    assert printable("run/a\x01b\ufffe.txt") == "run/a\\x01b\\ufffe.txt"
    assert printable("run/été") == "run/été"
