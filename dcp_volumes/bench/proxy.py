"""A :class:`~dcp_volumes.testing.faultproxy.FaultProxy` with a network profile, in its own
process, for ``dcp-volumes bench``.

The proxy is pure Python (asyncio); running it inside the measured process would make it
compete with the contender for the GIL, so the benchmark runs it here instead::

    python -m dcp_volumes.bench.proxy UPSTREAM_URL FIRST_BYTE_DELAY_S BYTES_PER_S

prints ``READY <endpoint_url>`` on stdout once it listens, then serves until stdin closes
or it receives SIGTERM.
"""

from __future__ import annotations

import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    from dcp_volumes.testing.faultproxy import FaultProxy, NetworkProfile

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print("usage: python -m dcp_volumes.bench.proxy UPSTREAM DELAY_S BYTES_PER_S",
              file=sys.stderr)
        return 2
    upstream, delay, rate = argv[0], float(argv[1]), float(argv[2])
    profile = NetworkProfile(first_byte_delay_s=delay,
                             per_connection_bytes_per_s=rate if rate > 0 else None)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    proxy = FaultProxy(upstream, profile=profile)
    proxy.start()
    try:
        print(f"READY {proxy.endpoint_url}", flush=True)

        def _watch_stdin() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=_watch_stdin, daemon=True).start()
        stop.wait()
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
