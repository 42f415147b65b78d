"""The one place backend exceptions are classified and translated.

Classification looks at exception types, HTTP status codes and service error codes, never at
message strings. :func:`translate_error` maps whatever a client raised onto the
:mod:`dcp_volumes.errors` hierarchy; :func:`is_transient` decides what the choke point
(:meth:`Backend.call <dcp_volumes.backends.base.Backend.call>`) retries, and
:func:`is_throttle` which of those retries mean "the store wants fewer requests" (the choke
point then slows this process's requests to that store down:
:class:`~dcp_volumes.backends.pacing.StoreThrottle`).
"""

from __future__ import annotations

import asyncio
import errno
import re

from dcp_volumes import errors

__all__ = [
    "is_connection_error",
    "is_throttle",
    "is_transient",
    "redact_url",
    "status_and_code",
    "throttled_too_long",
    "translate_error",
]

# Service error codes (S3 ``Error.Code``) that mean "try again later".
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
        "OperationAborted",
        "ServerBusy",
        "BadDigest",  # the body did not match its checksum in transit: resend it
        "OperationTimedOut",
    }
)
# Service error codes that say "too many requests" (a subset of the transient ones plus the
# spellings other services use): S3 SlowDown (503), Azure ServerBusy (503), GCS
# rateLimitExceeded (429), the AWS SDKs' throttling family.
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "SlowDownRead",
        "SlowDownWrite",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "ServerBusy",
        "ServiceUnavailable",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
        "rateLimitExceeded",
        "userRateLimitExceeded",
    }
)
# HTTP statuses that mean the same whatever the body says: 429 Too Many Requests, and 503,
# which S3, Azure Blob and GCS all answer when a prefix/partition/account is over its rate.
_THROTTLE_STATUSES = frozenset({429, 503})
_PERMISSION_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AuthorizationHeaderMalformed",
        "InvalidToken",
        "ExpiredToken",
        "AuthenticationFailed",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
    }
)
_MISSING_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound"})
_MISSING_KEY_CODES = frozenset({"NoSuchKey", "404", "NotFound", "BlobNotFound", "NoSuchUpload"})
_PRECONDITION_CODES = frozenset(
    {"PreconditionFailed", "ConditionNotMet", "BlobAlreadyExists", "ConditionalRequestConflict"}
)


def redact_url(url: str) -> str:
    """Drop any ``user:password@`` part of a URL so it can be logged."""
    return re.sub(r"(?<=://)[^/@]*@", "***@", url)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it wraps (filesystems re-raise client errors as builtins)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 8:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    """(HTTP status, service error code) of the first exception in the chain that has one."""
    for e in _chain(exc):
        status, code = _own_status_and_code(e)
        if status is not None or code is not None:
            return status, code
    return None, None


def _own_status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        err = response.get("Error", {}) or {}
        meta = response.get("ResponseMetadata", {}) or {}
        status = meta.get("HTTPStatusCode")
        code = err.get("Code")
        return (int(status) if status is not None else None), (str(code) if code else None)
    # azure.core.exceptions.HttpResponseError
    status_code = getattr(exc, "status_code", None)
    if isinstance(status_code, int):
        code = getattr(exc, "error_code", None)
        return status_code, (str(code) if code else None)
    if _client_side(exc):
        return None, None
    # gcsfs.retry.HttpError, aiohttp.ClientResponseError
    for attr in ("code", "status"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value, None
    return None, None


def _client_side(exc: BaseException) -> bool:
    """An HTTP client's own verdict on what it received (aiohttp's ``HttpProcessingError``
    family: a body shorter than its Content-Length is a ``ContentLengthError``): its
    ``code`` (400) is no status the store sent."""
    return any(cls.__name__ == "HttpProcessingError" for cls in type(exc).__mro__)


def is_connection_error(exc: BaseException) -> bool:
    """True when the connection failed (refused, reset, timed out, closed mid-body), as
    opposed to the store answering."""
    return _is_connection_error(exc)


def _is_connection_error(exc: BaseException) -> bool:
    return any(_own_connection_error(e) for e in _chain(exc))


def _own_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    # botocore / aiohttp / urllib3 / azure connection-level failures, matched by type name
    # so that none of those packages needs to be importable here.
    return bool(
        names
        & {
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ReadTimeoutError",
            "ConnectTimeoutError",
            "ResponseStreamingError",
            "IncompleteReadError",
            "ClientConnectionError",
            "ClientPayloadError",
            "ServerDisconnectedError",
            "ServerTimeoutError",
            "ClientOSError",
            "ServiceRequestError",
            "ServiceResponseError",
            "IncompleteRead",
            "ProtocolError",
        }
    )


def is_transient(exc: BaseException) -> bool:
    """True when retrying the same request later may succeed."""
    if isinstance(exc, errors.ShortBodyError):
        return True  # the next connection may carry the whole body
    if isinstance(exc, errors.DCPVolumesError):
        return False
    if _is_connection_error(exc):
        return True
    status, code = status_and_code(exc)
    if code in _TRANSIENT_CODES:
        return True
    if status is not None and (status == 429 or status == 408 or status >= 500):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.ETIMEDOUT,
                                                        errno.EPIPE)


def is_throttle(exc: BaseException) -> bool:
    """True when the store refused the request because it gets too many (SlowDown, 429, 503).

    A throttle is transient (:func:`is_transient`), and more: retrying at the same pace keeps
    it going, so the choke point slows this process's requests to the store down.
    """
    if isinstance(exc, errors.DCPVolumesError):
        return False
    status, code = status_and_code(exc)
    return code in _THROTTLE_CODES or status in _THROTTLE_STATUSES


def translate_error(exc: BaseException, *, url: str, op: str) -> errors.DCPVolumesError:
    """Map a backend exception onto the dcp_volumes hierarchy.

    Args:
        exc: what the backend raised.
        url: the object or checkpoint URL concerned (credentials are stripped).
        op: what we were doing, e.g. ``"upload"``, ``"download"``, ``"commit"``, ``"list"``.
    """
    if isinstance(exc, errors.ShortBodyError):  # the last of its retries
        return errors.ShortBodyError(
            f"{exc} (the last of the retries too): check the network path to the store (a "
            "proxy, a load balancer) or raise RetryOptions.max_attempts")
    if isinstance(exc, errors.DCPVolumesError):
        return exc
    where = redact_url(url)
    status, code = status_and_code(exc)
    kind = type(exc).__name__
    if code in _PERMISSION_CODES or status in (401, 403) or isinstance(exc, PermissionError):
        return errors.StoragePermissionError(
            f"{op} of {where} was refused ({code or status or kind}): check the credentials "
            "in storage_options or the environment and the bucket's access policy"
        )
    if code in _MISSING_BUCKET_CODES:
        return errors.BucketNotFoundError(
            f"{op} of {where} failed: the bucket/container does not exist; create it or fix the URL"
        )
    if code in _PRECONDITION_CODES or status == 412 or isinstance(exc, FileExistsError):
        return errors.CheckpointExistsError(
            f"{where} already exists (conditional write refused): another save committed first"
        )
    if code == "InvalidRange" or status == 416:
        return errors.IntegrityError(
            f"{op} of {where} asked for bytes past the end of the object: it is truncated"
        )
    if code in _MISSING_KEY_CODES or status == 404 or isinstance(exc, FileNotFoundError):
        return errors.ObjectNotFoundError(f"{op} of {where} failed: object not found")
    if is_transient(exc):
        detail = code or (f"HTTP {status}" if status else kind)
        cls = _error_class(op)
        return cls(f"{op} of {where} failed after retries ({detail}); the store is unavailable "
                   "or throttling: retry later or raise RetryOptions.max_attempts")
    detail = code or (f"HTTP {status}" if status else kind)
    return _error_class(op)(f"{op} of {where} failed ({detail})")


def _error_class(op: str) -> type[errors.DCPVolumesError]:
    """The error of a failed ``op`` that no more specific class describes."""
    if op in ("download", "list", "read"):
        return errors.DownloadError
    if op == "delete":
        return errors.DeleteError
    return errors.UploadError


def throttled_too_long(exc: BaseException, *, url: str, op: str, answers: int, seconds: float,
                       deadline_s: float | None) -> errors.DCPVolumesError:
    """The error of a transfer that the store kept throttling: ``answers`` throttle answers
    in a row, over ``seconds``, the last request ending in ``exc``."""
    status, code = status_and_code(exc)
    detail = code or (f"HTTP {status}" if status else type(exc).__name__)
    cls = _error_class(op)
    deadline = "None" if deadline_s is None else f"{deadline_s:g}s"
    return cls(
        f"{op} of {redact_url(url)} failed: the store kept throttling ({answers} throttle "
        f"answers in a row over {seconds:.1f}s, the last request ending in {detail}; "
        f"RetryOptions.deadline_s={deadline}); lower TransferOptions.max_concurrency or the "
        "number of ranks writing at once, spread the keys over prefixes "
        "(TransferOptions(key_layout='hashed')), or ask the store's operator for higher "
        "request-rate limits"
    )
