"""Statistics of a sweep's seeds: mean ± sd per arm, and paired differences with confidence intervals.

A study compares arms run with the same seeds. Seed ``s`` of two arms shares its initialisation and
data order, so the per-seed difference ``d_s = arm_s - baseline_s`` removes the variation the arms
have in common; the interval is Student's t on those differences (a paired t interval):

    mean(d) ± t_{1 - (1 - confidence)/2, n - 1} · sd(d) / sqrt(n)

with ``sd`` the sample standard deviation (``n - 1`` in the denominator). With fewer than two common
seeds there is no interval. A difference whose interval contains 0 is *within noise*.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``scipy.stats.t.ppf``)."""
    from scipy.stats import t

    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile: p={p} must be in (0, 1) and df={df} >= 1")
    return float(t.ppf(p, df))


@dataclass(frozen=True)
class PairedDifference:
    """``arm - baseline`` over the seeds both have: ``n`` pairs, their mean and sd, the interval
    ``[lo, hi]`` at ``confidence`` (None for fewer than two pairs) and the seeds used."""

    n: int
    mean: float
    sd: float | None
    lo: float | None
    hi: float | None
    confidence: float
    seeds: tuple

    @property
    def within_noise(self) -> bool | None:
        """True when the interval contains 0 (None: no interval)."""
        if self.lo is None:
            return None
        return self.lo <= 0.0 <= self.hi

    def format(self, digits: int = 4) -> str:
        """``-0.0123 [-0.0200, -0.0046]`` (with ``within noise`` when the interval holds 0)."""
        text = f"{self.mean:+.{digits}f}"
        if self.lo is None:
            return text + f" (n={self.n}: no interval)"
        text += f" [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"
        return text + (" within noise" if self.within_noise else "")


def paired_difference(arm: Mapping, baseline: Mapping, *, confidence: float = 0.95) -> PairedDifference | None:
    """The paired t interval of ``arm[s] - baseline[s]`` over the seeds ``s`` both map to a finite value.

    ``arm``, ``baseline``: ``{seed: value}``. None when no seed is shared."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")

    def finite(x) -> bool:
        return x is not None and math.isfinite(x)

    seeds = tuple(s for s in arm if s in baseline and finite(arm[s]) and finite(baseline[s]))
    if not seeds:
        return None
    d = [float(arm[s]) - float(baseline[s]) for s in seeds]
    n, mean = len(d), statistics.fmean(d)
    if n < 2:
        return PairedDifference(n, mean, None, None, None, confidence, seeds)
    sd = statistics.stdev(d)
    half = t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * sd / math.sqrt(n)
    return PairedDifference(n, mean, sd, mean - half, mean + half, confidence, seeds)


__all__ = ["PairedDifference", "paired_difference", "t_quantile"]
