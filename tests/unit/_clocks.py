"""Fake wall and monotonic clocks for the autopilot's tests."""

from __future__ import annotations

T0 = 1.8e9


class Clocks:
    """A wall clock and a monotonic one; ``step`` moves the wall clock only."""

    def __init__(self) -> None:
        self.wall_t, self.mono_t = T0, 5000.0

    def wall(self) -> float:
        return self.wall_t

    def mono(self) -> float:
        return self.mono_t

    def advance(self, seconds: float) -> None:
        self.wall_t += seconds
        self.mono_t += seconds

    def step(self, seconds: float) -> None:
        self.wall_t += seconds
