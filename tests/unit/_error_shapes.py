"""The shapes of the storage clients' errors, without the clients: what the error
translation reads (a ``response`` dict, ``status_code``/``error_code``, ``code``)."""

from __future__ import annotations


class ClientErrorShape(Exception):
    """The shape of botocore's ClientError (a ``response`` dict), without botocore."""

    def __init__(self, code: str | None, status: int | None) -> None:
        super().__init__(f"{code} {status}")
        self.response = {"Error": {"Code": code} if code else {},
                         "ResponseMetadata": {"HTTPStatusCode": status}}


class AzureErrorShape(Exception):
    """The shape of azure.core's HttpResponseError."""

    def __init__(self, status: int, error_code: str | None) -> None:
        super().__init__(f"{status} {error_code}")
        self.status_code = status
        self.error_code = error_code


class HttpErrorShape(Exception):
    """The shape of gcsfs' HttpError / aiohttp's ClientResponseError."""

    def __init__(self, code: int) -> None:
        super().__init__(str(code))
        self.code = code
