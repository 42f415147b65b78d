"""One client connection of the fault proxy: read a request, apply its rule, relay the answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import TYPE_CHECKING, Any

from dcp_volumes.testing.faultproxy._http import (
    BUF,
    MAX_HEAD,
    Cut,
    Head,
    Sink,
    TokenBucket,
    abort,
    canned_response,
    read_head,
    relay_body,
    request_line,
    response_framing,
    status_of,
)
from dcp_volumes.testing.faultproxy._rules import FaultRule

if TYPE_CHECKING:
    from dcp_volumes.testing.faultproxy._proxy import FaultProxy

__all__ = ["Connection"]

logger = logging.getLogger(__name__)

#: the request headers that ask for a byte range (Azure's SDK sends its own)
_RANGE_HEADERS = (b"range", b"x-ms-range")


def _range_rewrite(req: Head, rule: FaultRule | None) -> dict[str, Any]:
    """``Head.serialize`` arguments for the request sent upstream: ``Expect`` always dropped;
    ``ignore_range`` drops the range headers, ``shift_range`` moves the range ``nbytes``."""
    drop = {b"expect"}
    replace: dict[bytes, bytes] = {}
    action = rule.action if rule is not None else None
    if action == "ignore_range":
        drop.update(_RANGE_HEADERS)
    elif rule is not None and action == "shift_range":
        by = 1 if rule.nbytes is None else rule.nbytes
        for name in _RANGE_HEADERS:
            value = req.fields.get(name.decode())
            moved = None if value is None else _shifted(value, by)
            if moved is not None:
                replace[name] = moved.encode("latin-1")
    return {"drop": frozenset(drop), "replace": replace}


def _shifted(value: str, by: int) -> str | None:
    """``bytes=a-b`` (or ``bytes=a-``) moved ``by`` bytes; None for any other form."""
    m = re.fullmatch(r"\s*bytes=(\d+)-(\d*)\s*", value)
    if m is None:
        return None
    last = f"{int(m.group(2)) + by}" if m.group(2) else ""
    return f"bytes={int(m.group(1)) + by}-{last}"


class Connection:
    """One client connection and the upstream connection it uses (opened lazily)."""

    def __init__(
        self, proxy: FaultProxy, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter
    ) -> None:
        self.proxy = proxy
        self.creader = creader
        self.cwriter = cwriter
        self.ureader: asyncio.StreamReader | None = None
        self.uwriter: asyncio.StreamWriter | None = None
        self._buckets: dict[str, TokenBucket] = {}
        cwriter.transport.set_write_buffer_limits(high=4 * BUF)
        self._location_from = proxy.upstream_url.encode()

    def close(self) -> None:
        for writer in (self.cwriter, self.uwriter):
            if writer is not None:
                writer.close()

    def _bucket(self, direction: str) -> TokenBucket | None:
        rate = self.proxy.profile.per_connection_bytes_per_s
        if rate is None:
            return None
        bucket = self._buckets.get(direction)
        if bucket is None or bucket.rate != rate:
            bucket = self._buckets[direction] = TokenBucket(rate)
        return bucket

    async def _upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """The upstream connection, (re)opened if the server closed it; third item: reused."""
        if (
            self.ureader is not None
            and self.uwriter is not None
            and not self.ureader.at_eof()
            and not self.uwriter.is_closing()
        ):
            return self.ureader, self.uwriter, True
        if self.uwriter is not None:
            self.uwriter.transport.abort()
        proxy = self.proxy
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(proxy.upstream_host, proxy.upstream_port, limit=MAX_HEAD),
            proxy.connect_timeout,
        )
        writer.transport.set_write_buffer_limits(high=4 * BUF)
        self.ureader, self.uwriter = reader, writer
        return reader, writer, False

    async def serve(self) -> None:
        """Handle requests until either side closes or a fault ends the connection."""
        while True:
            raw = await read_head(self.creader)
            if raw is None:
                return
            req = Head.parse(raw)
            method, target = request_line(req)
            framing, length = req.body_framing()
            has_body = framing == "chunked" or length > 0
            if "100-continue" in req.fields.get("expect", "").lower() and has_body:
                # Answer it here so every action sees the whole body; the upstream never sees
                # the Expect header (which SigV4 does not sign).
                self.cwriter.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await self.cwriter.drain()
            rule = self.proxy._select(method, target, req.fields)
            if rule is not None:
                logger.debug(
                    "fault proxy: %s on %s %s", rule.label, method, target.split("?", 1)[0]
                )
            keep_alive = await self._exchange(req, method, framing, length, rule)
            if not keep_alive or req.wants_close():
                return

    async def _exchange(
        self, req: Head, method: str, framing: str, length: int, rule: FaultRule | None
    ) -> bool:
        """Handle one request; return whether the client connection stays open."""
        if rule is not None and rule.action in ("status", "reset"):
            return await self._answer_here(rule, method, framing, length)
        if rule is not None and rule.action == "delay":
            await asyncio.sleep(rule.delay_s)
        ureader, uwriter, reused = await self._upstream_or_abort()
        if ureader is None or uwriter is None:
            return False
        if not await self._forward_request(req, uwriter, framing, length, rule):
            return False
        resp = await self._response_head(ureader, reused)
        if resp is None:
            return False
        return await self._relay_response(resp, method, ureader, uwriter, rule)

    async def _answer_here(self, rule: FaultRule, method: str, framing: str, length: int) -> bool:
        """``status`` and ``reset``: read the request body; the upstream never sees it."""
        await relay_body(self.creader, Sink(None), framing, length)
        if rule.action == "reset":
            abort(self.cwriter, rst=True)
            return False
        response = canned_response(rule, method)
        sink = await self._client_sink()
        await sink.send(response)
        return True

    async def _upstream_or_abort(
        self,
    ) -> tuple[asyncio.StreamReader | None, asyncio.StreamWriter | None, bool]:
        try:
            return await self._upstream()
        except (OSError, asyncio.TimeoutError) as exc:
            # Behave like the unreachable server would: the client sees its connection drop.
            logger.warning(
                "fault proxy: cannot reach upstream %s: %r", self.proxy.upstream_url, exc
            )
            abort(self.cwriter, rst=True)
            return None, None, False

    async def _forward_request(
        self,
        req: Head,
        uwriter: asyncio.StreamWriter,
        framing: str,
        length: int,
        rule: FaultRule | None,
    ) -> bool:
        """Send the request upstream (``fail_after_bytes``/``corrupt``/``ignore_range``/
        ``shift_range`` applied); false if cut."""
        uwriter.write(req.serialize(**_range_rewrite(req, rule)))
        action = rule.action if rule is not None else None
        limit = rule.nbytes if rule is not None and action == "fail_after_bytes" else None
        flip_at = None
        if rule is not None and action == "corrupt":
            flip_at = rule.nbytes if rule.nbytes is not None else length // 2
        sink = Sink(uwriter, self._bucket("up"), limit, flip_at)
        try:
            await relay_body(self.creader, sink, framing, length)
        except Cut:
            abort(self.cwriter, rst=True)
            abort(uwriter, rst=True)
            return False
        return True

    async def _response_head(self, ureader: asyncio.StreamReader, reused: bool) -> Head | None:
        """The upstream's final response head; ``None`` (client closed) if it sent none."""
        raw = await read_head(ureader)
        while raw is not None and 100 <= status_of(raw.split(b"\r\n", 1)[0]) < 200:
            raw = await read_head(ureader)  # interim responses: we answered 100 ourselves
        if raw is None:
            # The upstream closed without answering (e.g. an idle keep-alive timeout raced our
            # request). Close the client connection the same way; clients retry that.
            logger.debug("fault proxy: upstream closed before responding (reused=%s)", reused)
            abort(self.cwriter, rst=False)
            return None
        return Head.parse(raw)

    async def _relay_response(
        self,
        resp: Head,
        method: str,
        ureader: asyncio.StreamReader,
        uwriter: asyncio.StreamWriter,
        rule: FaultRule | None,
    ) -> bool:
        """Send the response to the client (``truncate`` applied); true if both stay open."""
        rframing, rlength = response_framing(resp, method)
        replace = self._rewritten_location(resp)
        csink = await self._client_sink()
        await csink.send(resp.serialize(replace=replace))
        if rule is not None and rule.action == "truncate":
            nbytes = rule.nbytes
            if nbytes is None:
                nbytes = rlength // 2 if rframing == "length" else 0
            csink.limit = csink.sent + nbytes
            with contextlib.suppress(Cut):
                await relay_body(ureader, csink, rframing, rlength)
            abort(self.cwriter, rst=False)
            abort(uwriter, rst=False)
            return False
        await relay_body(ureader, csink, rframing, rlength)
        if rframing == "eof" or resp.wants_close():
            abort(uwriter, rst=False)
            return False
        return True

    def _rewritten_location(self, resp: Head) -> dict[bytes, bytes]:
        """Header replacements pointing an upstream ``Location`` at the proxy instead."""
        location = resp.fields.get("location")
        if location is None:
            return {}
        raw = location.encode("latin-1")
        if not raw.startswith(self._location_from):
            return {}
        return {b"location": self.proxy.endpoint_url.encode() + raw[len(self._location_from) :]}

    async def _client_sink(self) -> Sink:
        """The sink to the client, once the profile's first-byte delay has passed."""
        delay = self.proxy.profile.first_byte_delay_s
        if delay:
            await asyncio.sleep(delay)
        return Sink(self.cwriter, self._bucket("down"))
