"""HTTP/1.1 plumbing for the fault proxy: message heads, body relays, bandwidth caps, aborts."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http
import socket
import struct
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from dcp_volumes.testing.faultproxy._rules import FaultRule

__all__ = [
    "BUF",
    "MAX_HEAD",
    "NO_BODY_STATUSES",
    "Cut",
    "Head",
    "ProtocolError",
    "Sink",
    "TokenBucket",
    "abort",
    "canned_response",
    "read_head",
    "relay_body",
    "request_line",
    "response_framing",
    "status_of",
]

BUF = 1 << 20
MAX_HEAD = 1 << 20
NO_BODY_STATUSES = frozenset((204, 304))


class Cut(Exception):
    """A byte limit was reached and the connection must be closed now."""


class ProtocolError(Exception):
    """Unparseable HTTP."""


@dataclass
class Head:
    start_line: bytes
    headers: list[tuple[bytes, bytes]]
    fields: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, raw: bytes) -> Head:
        lines = raw.split(b"\r\n")
        start_line = lines[0]
        headers: list[tuple[bytes, bytes]] = []
        fields: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                raise ProtocolError(f"bad header line {line[:80]!r}")
            name, value = name.strip(), value.strip()
            headers.append((name, value))
            key = name.decode("latin-1").lower()
            text = value.decode("latin-1")
            fields[key] = f"{fields[key]}, {text}" if key in fields else text
        return cls(start_line, headers, fields)

    def serialize(
        self, *, drop: frozenset[bytes] = frozenset(), replace: Mapping[bytes, bytes] | None = None
    ) -> bytes:
        parts = [self.start_line]
        for name, value in self.headers:
            lname = name.lower()
            if lname in drop:
                continue
            if replace and lname in replace:
                value = replace[lname]
            parts.append(name + b": " + value)
        parts.append(b"")
        parts.append(b"")
        return b"\r\n".join(parts)

    def body_framing(self) -> tuple[str, int]:
        """("chunked", 0) | ("length", n) | ("none", 0) as for a request."""
        if "chunked" in self.fields.get("transfer-encoding", "").lower():
            return "chunked", 0
        cl = self.fields.get("content-length")
        if cl is not None:
            try:
                n = int(cl.split(",")[0])
            except ValueError as exc:
                raise ProtocolError(f"bad Content-Length {cl!r}") from exc
            return "length", n
        return "none", 0

    def wants_close(self) -> bool:
        conn = self.fields.get("connection", "").lower()
        if "close" in conn:
            return True
        return self.start_line.endswith(b"HTTP/1.0") and "keep-alive" not in conn


class TokenBucket:
    """Debt-based token bucket: spend first, then sleep off any deficit."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.capacity = max(16384.0, rate * 0.05)
        self.chunk = int(min(self.capacity, BUF))
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    async def consume(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


class Sink:
    """Writes to one side of a connection, with an optional byte limit and bandwidth cap.

    With ``writer=None`` it discards what it is given (to read a request we answer ourselves).
    """

    def __init__(
        self,
        writer: asyncio.StreamWriter | None,
        bucket: TokenBucket | None = None,
        limit: int | None = None,
        flip_at: int | None = None,
    ) -> None:
        self.writer = writer
        self.bucket = bucket
        self.limit = limit
        self.flip_at = flip_at  # payload offset of the byte to corrupt (chunk framing excluded)
        self.sent = 0
        self.payload_sent = 0

    async def send(self, data: bytes | bytearray | memoryview, *, payload: bool = True) -> None:
        if payload:
            at = None if self.flip_at is None else self.flip_at - self.payload_sent
            self.payload_sent += len(data)
            if at is not None and 0 <= at < len(data):
                data = bytearray(data)
                data[at] ^= 0xFF
        cut = False
        if self.limit is not None and self.sent + len(data) > self.limit:
            data = memoryview(data)[: self.limit - self.sent]
            cut = True
        if self.writer is None:
            pass
        elif self.bucket is None:
            if data:
                self.writer.write(data)
                await self.writer.drain()
        else:
            view = memoryview(data)
            step = self.bucket.chunk
            for i in range(0, len(view), step):
                piece = view[i : i + step]
                await self.bucket.consume(len(piece))
                self.writer.write(piece)
                await self.writer.drain()
        self.sent += len(data)
        if cut:
            raise Cut


async def read_head(reader: asyncio.StreamReader) -> bytes | None:
    """Read one message head (up to the blank line); ``None`` on a clean EOF between messages."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise
    except asyncio.LimitOverrunError as exc:
        raise ProtocolError("message head too large") from exc
    # Tolerate stray CRLFs between pipelined messages (RFC 9112 section 2.2).
    return raw.lstrip(b"\r\n")


async def _relay_exact(reader: asyncio.StreamReader, sink: Sink, n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, BUF))
        if not data:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(data)
        await sink.send(data)


async def _relay_until_eof(reader: asyncio.StreamReader, sink: Sink) -> None:
    while data := await reader.read(BUF):
        await sink.send(data)


async def _relay_chunked(reader: asyncio.StreamReader, sink: Sink) -> None:
    """Relay a chunked body verbatim (framing included), parsing only the chunk sizes."""
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise ProtocolError(f"bad chunk size line {line[:40]!r}") from exc
        await sink.send(line, payload=False)
        if size == 0:
            while True:  # trailers, then the final CRLF
                trailer = await reader.readuntil(b"\r\n")
                await sink.send(trailer, payload=False)
                if trailer == b"\r\n":
                    return
        await _relay_exact(reader, sink, size)
        await sink.send(await reader.readexactly(2), payload=False)


async def relay_body(reader: asyncio.StreamReader, sink: Sink, framing: str, length: int) -> None:
    if framing == "chunked":
        await _relay_chunked(reader, sink)
    elif framing == "length":
        await _relay_exact(reader, sink, length)
    elif framing == "eof":
        await _relay_until_eof(reader, sink)


def abort(writer: asyncio.StreamWriter | None, *, rst: bool) -> None:
    """Close a connection at once; with ``rst`` the peer gets a TCP RST instead of a FIN."""
    if writer is None:
        return
    if rst:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def status_of(start_line: bytes) -> int:
    parts = start_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ProtocolError(f"bad status line {start_line[:80]!r}")
    try:
        return int(parts[1])
    except ValueError as exc:
        raise ProtocolError(f"bad status line {start_line[:80]!r}") from exc


def request_line(req: Head) -> tuple[str, str]:
    """``(METHOD, target)`` of a request; an absolute-form target is cut to path and query."""
    parts = req.start_line.split(b" ")
    if len(parts) != 3:
        raise ProtocolError(f"bad request line {req.start_line[:80]!r}")
    method = parts[0].decode("latin-1").upper()
    target = parts[1].decode("latin-1")
    if "://" in target:  # absolute-form: match on path and query only
        split = urllib.parse.urlsplit(target)
        target = split.path + (f"?{split.query}" if split.query else "")
    return method, target


def response_framing(resp: Head, method: str) -> tuple[str, int]:
    """How the body of ``resp`` (the answer to ``method``) ends: as ``Head.body_framing``, but
    a response without length or chunking runs to EOF, and some responses never have one."""
    status = status_of(resp.start_line)
    if method == "HEAD" or status in NO_BODY_STATUSES or status < 200:
        return "none", 0
    framing, length = resp.body_framing()
    return ("eof" if framing == "none" else framing), length


def canned_response(rule: FaultRule, method: str) -> bytes:
    """The whole response a ``status`` rule answers with (no body for ``HEAD``)."""
    body = rule.body if isinstance(rule.body, bytes) else rule.body.encode()
    try:
        reason = http.HTTPStatus(rule.status).phrase
    except ValueError:
        reason = "Fault"
    headers = {k.lower(): v for k, v in (rule.headers or {}).items()}
    if body and "content-type" not in headers:
        stripped = body.lstrip()
        headers["content-type"] = (
            "application/xml"
            if stripped.startswith(b"<")
            else "application/json"
            if stripped.startswith(b"{")
            else "text/plain"
        )
    headers["content-length"] = str(len(body))
    headers.setdefault("x-amz-request-id", "FAULTPROXY")
    headers.setdefault("date", time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()))
    head = (
        f"HTTP/1.1 {rule.status} {reason}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + "\r\n"
    )
    return head.encode("latin-1") + (b"" if method == "HEAD" else body)
