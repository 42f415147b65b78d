"""The job's failure rate from a prior and what the run itself saw: a conjugate Gamma–Poisson
estimate.

Failures arrive as a Poisson process of rate ``λ`` per second of the job's running time. The
prior on ``λ`` is a Gamma distribution with mean ``1/M₀`` (the prior's mean time to failure)
and shape ``w``: it weighs as much as ``w`` interruptions observed over ``w·M₀`` seconds. After
``n`` interruptions over an exposure of ``T`` seconds the posterior is
``Gamma(w + n, w·M₀ + T)``, whose mean rate gives

    M = (w·M₀ + T) / (w + n)

With no observation ``M = M₀``; as interruptions accumulate the run's own rate ``T/n`` takes
over (after ``n`` interruptions the prior weighs ``w/(w+n)`` of the estimate).

The default weight, :data:`DEFAULT_PRIOR_WEIGHT` = 0.25, makes the first observed interruption
count four times as much as the prior: a prior 10× too optimistic is within 25 % of the right
interval (``√M``) after about five interruptions. But a prior that was right then drifts long
on a lucky stretch (``M = M₀ + T/w`` before the first interruption: 4 s more per second
without one). So a rate the user *gave* is trusted more while the run agrees with it: the
prior is a mixture, half (:data:`DEFAULT_PRIOR_TRUST`) a ``Gamma(4, 4·M₀)`` (weighing
:data:`TRUSTED_PRIOR_WEIGHT` = 4 interruptions) and half the ``Gamma(w, w·M₀)`` above. Each
half's posterior is a Gamma again; the two are mixed by how well each predicted the run's
interruptions (their marginal likelihoods, negative binomial), and ``M`` is the inverse of the
mixture's mean rate. While the run's ``n`` and ``T`` fit ``M₀`` the weighty half keeps the
estimate near it; when they contradict it (10× too optimistic: failures come ten times too
soon) the light half takes over, one interruption later than it alone would (about six
instead of five). ``prior_trust=0`` is the light half alone: the closed form above.

With no prior given, :func:`default_prior` is the Llama 3 report's rate of all unexpected
interruptions (about one every 3 h on 16,384 GPUs), which is pessimistic next to hardware
AFRs of 1–5 %: conservative, short intervals until the run's own evidence says otherwise. It
is not anyone's knowledge of this job, so it is not trusted (``trust`` 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dcp_volumes.errors import ConfigError
from dcp_volumes.goodput._checks import MAX_DURATION_S, count, finite_or_none, non_negative
from dcp_volumes.goodput._model import FailureModel

__all__ = [
    "DEFAULT_FLEET_GPUS",
    "DEFAULT_FLEET_MTBF_HOURS",
    "DEFAULT_PRIOR_TRUST",
    "DEFAULT_PRIOR_WEIGHT",
    "TRUSTED_PRIOR_WEIGHT",
    "FailureEstimate",
    "FailurePrior",
    "default_prior",
    "estimate_failures",
]

#: the default prior's fleet: one unexpected interruption every ~3 h on 16,384 GPUs (Llama 3
#: report: 419 interruptions in 54 days)
DEFAULT_FLEET_MTBF_HOURS = 3.0
DEFAULT_FLEET_GPUS = 16_384
#: how many observed interruptions the prior weighs
DEFAULT_PRIOR_WEIGHT = 0.25
#: the prior's weight is bounded: above this it would never learn from the run
MAX_PRIOR_WEIGHT = 1000.0
#: the share of a given prior's mixture in its weighty half
DEFAULT_PRIOR_TRUST = 0.5
#: how many observed interruptions the weighty half of a given prior weighs
TRUSTED_PRIOR_WEIGHT = 4.0


@dataclass(frozen=True, kw_only=True)
class FailurePrior:
    """The prior on the job's failure rate: a mean time to failure and its weight.

    Args:
        mttf_s: The prior's job MTTF ``M₀`` in seconds (``inf``: no failures expected).
        weight: ``w``, in observed interruptions the prior's light half counts as (> 0).
        trust: The prior's share in its weighty half, ``Gamma(4, 4·M₀)`` (0: none, the
            conjugate estimate of weight ``w`` alone; at most 0.99).
        source: Where it came from, in words (``"given: ..."`` or ``"default: ..."``).
    """

    mttf_s: float
    weight: float = DEFAULT_PRIOR_WEIGHT
    trust: float = DEFAULT_PRIOR_TRUST
    source: str = "given"

    def __post_init__(self) -> None:
        m = non_negative("mttf_s", self.mttf_s, allow_inf=True)
        if m <= 0:
            raise ConfigError(f"mttf_s must be > 0, got {m:g}")
        w = non_negative("weight", self.weight, at_most=MAX_PRIOR_WEIGHT)
        if w <= 0:
            raise ConfigError(f"the prior's weight must be > 0 (in interruptions), got {w:g}")
        check_trust(self.trust)

    @classmethod
    def from_model(cls, model: FailureModel, *, weight: float = DEFAULT_PRIOR_WEIGHT,
                   trust: float = DEFAULT_PRIOR_TRUST, source: str | None = None) -> FailurePrior:
        """The prior of a :class:`~dcp_volumes.goodput.FailureModel` (AFR or fleet MTBF)."""
        return cls(mttf_s=model.mttf_s, weight=weight, trust=trust,
                   source=source if source is not None else f"given: {model.describe()}")

    def components(self) -> list[tuple[float, float]]:
        """The mixture's halves: (prior share, weight in interruptions)."""
        if self.trust <= 0 or self.weight == TRUSTED_PRIOR_WEIGHT:
            return [(1.0, self.weight)]
        return [(self.trust, TRUSTED_PRIOR_WEIGHT), (1.0 - self.trust, self.weight)]

    @property
    def default(self) -> bool:
        """The documented default, not a rate the user gave."""
        return self.source.startswith("default")

    def to_dict(self) -> dict[str, Any]:
        return {"mttf_s": finite_or_none(self.mttf_s), "weight": self.weight,
                "trust": self.trust, "source": self.source, "default": self.default}


def check_trust(trust: object) -> float:
    """A prior's trust: a number in [0, 0.99]."""
    if (isinstance(trust, bool) or not isinstance(trust, (int, float))
            or not 0.0 <= trust <= 0.99):
        raise ConfigError(f"the prior's trust must be a number in [0, 0.99] (0: the light "
                          f"prior alone), got {trust!r}")
    return float(trust)


def default_prior(gpus: int, *, weight: float = DEFAULT_PRIOR_WEIGHT) -> FailurePrior:
    """The conservative default for a job of ``gpus`` GPUs: the Llama 3 fleet's rate."""
    model = FailureModel.from_fleet(mtbf_hours=DEFAULT_FLEET_MTBF_HOURS,
                                    fleet_gpus=DEFAULT_FLEET_GPUS, gpus=count("gpus", gpus))
    return FailurePrior.from_model(
        model, weight=weight, trust=0.0,
        source=(f"default: Llama 3's observed rate, 1 interruption every "
                f"{DEFAULT_FLEET_MTBF_HOURS:g} h on {DEFAULT_FLEET_GPUS:,} GPUs, for {gpus} GPUs"))


@dataclass(frozen=True, kw_only=True)
class FailureEstimate:
    """The prior, the run's evidence and the posterior mean time to failure."""

    prior: FailurePrior
    interruptions: int
    exposure_s: float

    def _posterior(self) -> list[tuple[float, float]]:
        """Each half's posterior share and weight (shares by marginal likelihood)."""
        parts = self.prior.components()
        if len(parts) == 1:
            return parts
        n, t, m0 = self.interruptions, self.exposure_s, self.prior.mttf_s
        logs = [math.log(share) + math.lgamma(w + n) - math.lgamma(w)
                + w * math.log(w * m0) - (w + n) * math.log(w * m0 + t) for share, w in parts]
        top = max(logs)
        odds = [math.exp(x - top) for x in logs]
        return [(o / sum(odds), w) for o, (_, w) in zip(odds, parts)]

    @property
    def mttf_s(self) -> float:
        """The posterior job MTTF: the inverse of the posterior mean rate, ``(w·M₀ + T)/(w +
        n)`` for one Gamma (``inf`` only with an infinite prior and no interruption)."""
        m0, n, t = self.prior.mttf_s, self.interruptions, self.exposure_s
        if math.isinf(m0):
            return math.inf if n == 0 else max(t, 1.0) / n
        rate = sum(share * (w + n) / (w * m0 + t) for share, w in self._posterior())
        return 1.0 / rate

    @property
    def trusted_share(self) -> float:
        """The weighty half's posterior share (0 without one): how far the run agrees with
        the prior."""
        return 0.0 if len(self.prior.components()) == 1 else self._posterior()[0][0]

    @property
    def observed_mttf_s(self) -> float | None:
        """The run's own ``T/n`` (None before its first interruption)."""
        return self.exposure_s / self.interruptions if self.interruptions else None

    @property
    def prior_share(self) -> float:
        """How much of the estimate is still the prior: ``w/(w + n)`` for one Gamma, its
        posterior mean over the halves for two."""
        n = self.interruptions
        return sum(share * w / (w + n) for share, w in self._posterior())

    def describe(self) -> str:
        from dcp_volumes.goodput._durations import format_duration

        seen = (f"{self.interruptions} interruption(s) in {format_duration(self.exposure_s)} "
                "of running time")
        weighs = (f"weighing {self.prior.weight:g} interruption(s)"
                  if len(self.prior.components()) == 1 else
                  f"{self.prior.trust:.0%} weighing {TRUSTED_PRIOR_WEIGHT:g} and "
                  f"{1 - self.prior.trust:.0%} {self.prior.weight:g} interruption(s), the "
                  f"weighty part now {self.trusted_share:.0%}")
        return (f"M = {format_duration(self.mttf_s)} (prior {format_duration(self.prior.mttf_s)}"
                f" {weighs}, {self.prior_share:.0%} of the estimate; observed {seen})")

    def to_dict(self) -> dict[str, Any]:
        return {"prior": self.prior.to_dict(), "interruptions": self.interruptions,
                "exposure_s": self.exposure_s, "mttf_s": finite_or_none(self.mttf_s),
                "observed_mttf_s": self.observed_mttf_s, "prior_share": self.prior_share,
                "trusted_share": self.trusted_share}


def estimate_failures(prior: FailurePrior, *, interruptions: int,
                      exposure_s: float) -> FailureEstimate:
    """Combine ``prior`` with ``interruptions`` observed over ``exposure_s`` seconds."""
    if isinstance(interruptions, bool) or not isinstance(interruptions, int) or interruptions < 0:
        raise ConfigError(f"interruptions must be a whole number >= 0, got {interruptions!r}")
    t = non_negative("exposure_s", exposure_s, at_most=MAX_DURATION_S)
    return FailureEstimate(prior=prior, interruptions=interruptions, exposure_s=t)
