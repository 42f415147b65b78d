"""The tests' own statement of the autopilot's failure estimate, written apart from
:mod:`dcp_volumes.goodput._estimate` so a test compares two derivations."""

from __future__ import annotations

import math


def mixture_mttf(m0: float, n: int, t: float) -> float:
    """The test's own posterior of half Gamma(4, 4·M₀) and half Gamma(0.25, 0.25·M₀): each
    half's marginal likelihood of n failures in t, Γ(a+n)/Γ(a) · b^a / (b+t)^(a+n)."""
    halves = [(4.0, 4.0 * m0), (0.25, 0.25 * m0)]
    like = [math.gamma(a + n) / math.gamma(a) * b**a / (b + t) ** (a + n) for a, b in halves]
    rate = sum(li * (a + n) / (b + t) for li, (a, b) in zip(like, halves)) / sum(like)
    return 1.0 / rate
