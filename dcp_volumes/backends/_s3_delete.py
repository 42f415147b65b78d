"""Deleting S3 objects: DeleteObjects for the keys its XML body can carry, DeleteObject for
the others, and every answer checked against the keys asked.

DeleteObjects sends its keys in an XML 1.0 body, which cannot carry every legal S3 key
(``\\x01``, ``\\x1f``, U+FFFE; a carriage return is read back as a line feed): one such key
fails the whole request (``MalformedXML``, or a 500 on moto). Those keys go one by one, in
DeleteObject requests that carry the key in the URL.

A DeleteObjects answer is trusted only for what it says about the keys asked: a key in its
``Deleted`` list, or reported ``NoSuchKey``, is gone; a key reported with another error is
retried at the choke point when the error is transient (only the keys still there are asked
again); a key the answer does not mention at all (a store or proxy that answers 200 and
deletes nothing) is a :class:`~dcp_volumes.errors.DeleteError`.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

from dcp_volumes import errors
from dcp_volumes.backends.translate import redact_url

if TYPE_CHECKING:
    from dcp_volumes.backends.base import Backend

__all__ = ["printable", "remove", "xml_can_carry"]

#: a character XML 1.0 cannot carry (its ``Char`` production), or a carriage return, which
#: an XML parser reads back as a line feed (so the store would delete another key)
_NOT_XML = re.compile("[^\t\n\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_can_carry(key: str) -> bool:
    """Whether ``key`` reaches the store unchanged in a DeleteObjects body."""
    return _NOT_XML.search(key) is None


def printable(key: str) -> str:
    """``key`` with the characters a terminal would not show escaped (for messages)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in key)


async def remove(backend: Backend, s3: Any, relatives: list[str], *, batch: int) -> None:
    """Delete the objects ``relatives`` (missing ones are fine) through the aiobotocore
    client ``s3``: DeleteObjects, ``batch`` keys a request, for the keys XML can carry, a
    DeleteObject for each other key. Every request runs to its end before the first failure is raised, so
    nothing is still being deleted when the caller hears of it.

    Raises:
        DeleteError: a key could not be deleted, or the store's answer did not say it was.
    """
    if not relatives:
        return
    keys = [backend.path(r).partition("/")[2] for r in relatives]
    batched = [k for k in keys if xml_can_carry(k)]
    n = batch
    try:
        outcomes = await asyncio.gather(
            *(_delete_batch(backend, s3, batched[i:i + n]) for i in range(0, len(batched), n)),
            *(_delete_one(backend, s3, k) for k in keys if not xml_can_carry(k)),
            return_exceptions=True,
        )
    finally:
        backend.fs.invalidate_cache(backend.root)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


async def _delete_one(backend: Backend, s3: Any, key: str) -> None:
    try:
        await backend.call(lambda: s3.delete_object(Bucket=backend.bucket, Key=key),
                           op="delete", url=f"{backend.scheme}://{backend.bucket}/"
                                            f"{printable(key)}")
    except errors.ObjectNotFoundError:
        pass


async def _delete_batch(backend: Backend, s3: Any, keys: list[str]) -> None:
    """One DeleteObjects request of ``keys``, retried at the choke point for the keys that
    are still there (deleting again is harmless); its error says how many are left."""
    pending = set(keys)
    try:
        await backend.call(lambda: _delete_pending(backend, s3, pending), op="delete",
                           url=backend.url)
    except errors.DCPVolumesError as exc:
        example = f"{backend.scheme}://{backend.bucket}/{printable(min(pending, default=''))}"
        raise type(exc)(
            f"{exc}; {len(pending)} of the {len(keys)} objects of one DeleteObjects request "
            f"are not deleted (e.g. {example}): run the deletion again"
        ) from exc


async def _delete_pending(backend: Backend, s3: Any, pending: set[str]) -> None:
    """Ask the store to delete ``pending``; take out of it every key the answer says is gone.

    Raises:
        ClientError: the answer reports a key it could not delete (the first such error,
            for the choke point to classify, retry or translate).
        DeleteError: the answer does not mention some key asked.
    """
    from botocore.exceptions import ClientError

    out = await s3.delete_objects(Bucket=backend.bucket, Delete={
        "Objects": [{"Key": k} for k in sorted(pending)], "Quiet": False})
    failed = []
    for entry in out.get("Deleted") or []:
        pending.discard(entry.get("Key"))
    for entry in out.get("Errors") or []:
        key = entry.get("Key")
        if key not in pending:
            continue  # not asked (or already gone): says nothing about what was
        if entry.get("Code") == "NoSuchKey":
            pending.discard(key)
        else:
            failed.append(entry)
    if failed:
        raise ClientError({"Error": {"Code": failed[0].get("Code"),
                                     "Message": failed[0].get("Message", "")}},
                          "DeleteObjects")
    if pending:
        raise errors.DeleteError(
            f"delete under {redact_url(backend.url)}: the store answered DeleteObjects "
            "without naming every key asked as deleted or failed (keys neither deleted nor "
            "reported are counted as still there; check the store, or a proxy in front of it)"
        )
