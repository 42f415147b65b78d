"""What a worker measures: wall and CPU time, and peak RSS sampled in a thread."""

from __future__ import annotations

import resource
import threading
import time

__all__ = ["RssSampler", "Timer", "cpu_s", "rss"]


def rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class RssSampler:
    """Peak RSS of this process, sampled every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.005) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._proc.memory_info().rss)
            except Exception:  # noqa: BLE001, S110 — a missed sample is fine
                pass
            self._stop.wait(self._interval)

    def __enter__(self) -> RssSampler:  # noqa: PYI034
        self.peak = self._proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Timer:
    def __enter__(self) -> Timer:  # noqa: PYI034
        self.cpu0 = cpu_s()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = cpu_s() - self.cpu0

