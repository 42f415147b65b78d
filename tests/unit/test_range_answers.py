"""The check of a GET's answer before its body is used (issue 37, finding 6): the pure rules
of :class:`~dcp_volumes.backends._ranges.RangeAnswer`, the retry decision for each kind of
wrong answer, and the store's status in messages (aiohttp's own 400 for a short body is no
status the store sent). The same answers from real servers behind the fault proxy:
tests/integration/test_ranged_answers.py."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp.http_exceptions import ContentLengthError

from dcp_volumes import errors
from dcp_volumes.backends._ranges import RangeAnswer, asked_range, check_read, range_header
from dcp_volumes.backends.translate import is_transient, status_and_code, translate_error

URL = "s3://bucket/run/step-1/__0_0.distcp"


def _answer(start: int | None, end: int | None, status: int, content_range: str | None,
            content_length: int | None) -> RangeAnswer:
    return RangeAnswer(url=URL, start=start, end=end, status=status,
                       content_range=content_range, content_length=content_length)


GOOD = {
    "206-the-range-asked": ((100, 200, 206, "bytes 100-199/1000", 100), 100),
    "206-unknown-total": ((100, 200, 206, "bytes 100-199/*", 100), 100),
    "206-cut-at-the-objects-end": ((900, 1200, 206, "bytes 900-999/1000", 100), 100),
    "206-open-ended": ((900, None, 206, "bytes 900-999/1000", 100), 100),
    "200-whole-object-asked": ((None, None, 200, None, 1000), 1000),
    "200-range-covering-the-object": ((0, 4096, 200, None, 1000), 1000),
    "200-range-exactly-the-object": ((0, 1000, 200, None, 1000), 1000),
}


@pytest.mark.parametrize(("answer", "expected"), GOOD.values(), ids=GOOD.keys())
def test_an_answer_of_the_bytes_asked_gives_their_length(answer: tuple, expected: int) -> None:
    assert _answer(*answer).expected() == expected


BAD = {
    "200-whole-object-for-a-range": ((100, 200, 200, None, 1000), "HTTP 200, no Content-Range"),
    "200-from-zero-but-short-of-the-object": ((0, 100, 200, None, 1000), "whole object"),
    "206-shifted": ((100, 200, 206, "bytes 101-200/1000", 100), "another range"),
    "206-shorter-not-at-the-end": ((100, 200, 206, "bytes 100-149/1000", 50), "another range"),
    "206-longer": ((100, 200, 206, "bytes 100-299/1000", 200), "another range"),
    "206-past-a-claimed-total": ((100, 200, 206, "bytes 100-199/150", 100), "another range"),
    "206-no-content-range": ((100, 200, 206, None, 100), "must name its range"),
    "206-garbled-content-range": ((100, 200, 206, "bytes=100-199", 100), "must name its range"),
    "206-length-not-its-range": ((100, 200, 206, "bytes 100-199/1000", 99), "its length"),
    "206-for-the-whole-object": ((None, None, 206, "bytes 0-99/1000", 100), "another range"),
    "204": ((100, 200, 204, None, 0), "HTTP 204"),
}


@pytest.mark.parametrize(("answer", "says"), BAD.values(), ids=BAD.keys())
def test_an_answer_of_other_bytes_is_a_mismatch_naming_what_came(answer: tuple,
                                                                 says: str) -> None:
    with pytest.raises(errors.RangeMismatchError) as info:
        _answer(*answer).expected()
    message = str(info.value)
    assert says in message and URL in message and f"HTTP {answer[2]}" in message
    assert not is_transient(info.value)  # asking again gets the same answer


def test_a_body_shorter_than_announced_is_short_and_retried() -> None:
    answer = _answer(100, 200, 206, "bytes 100-199/1000", 100)
    with pytest.raises(errors.ShortBodyError, match=r"ended after 40 of 100 bytes") as info:
        answer.check_length(40, 100)
    assert is_transient(info.value)
    final = translate_error(info.value, url=URL, op="download")
    assert isinstance(final, errors.ShortBodyError) and "RetryOptions.max_attempts" in str(final)
    with pytest.raises(errors.RangeMismatchError, match="more than"):
        answer.check_length(101, 100)
    answer.check_length(100, 100)


def test_aiohttps_own_400_is_no_status_of_the_store() -> None:
    try:
        try:
            raise ContentLengthError("Not enough data to satisfy content length header")
        except ContentLengthError as inner:
            raise aiohttp.ClientPayloadError("Response payload is not completed") from inner
    except aiohttp.ClientPayloadError as exc:
        cut = exc
    assert status_and_code(cut) == (None, None)
    assert is_transient(cut)
    assert "HTTP 400" not in str(translate_error(cut, url=URL, op="download"))


def test_range_headers_round_trip() -> None:
    assert range_header(5, 10) == "bytes=5-9" and range_header(5, None) == "bytes=5-"
    assert asked_range("bytes=5-9") == (5, 10) and asked_range("bytes=5-") == (5, None)
    assert asked_range(None) == (None, None) and asked_range("bytes=-5") == (None, None)


def test_a_filesystem_read_longer_than_asked_is_a_mismatch() -> None:
    check_read(URL, 0, 10, 10)
    check_read(URL, 0, 10, 4)  # the object ends earlier: the caller's checks say so
    check_read(URL, None, None, 10**6)
    with pytest.raises(errors.RangeMismatchError, match="ignores Range"):
        check_read(URL, 0, 10, 11)
