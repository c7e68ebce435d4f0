"""Paired statistics of the ablation's deltas: mean per-seed difference, its 95% t interval, its sign count.

Two cells trained with the same seed share the model initialisation and the data
order, so their difference is a paired sample: the interval is the one-sample
Student t interval of the per-seed differences, ``mean ± t(0.975, n-1) * sd / sqrt(n)``.
The t quantile is computed here (the regularised incomplete beta function by its
continued fraction, inverted by bisection): scipy is only a development dependency.
With one seed there is no spread to estimate, so no interval is reported.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PairedDelta", "paired_delta", "t_quantile", "NO_DIFFERENCE"]

NO_DIFFERENCE = "no significant difference"

_EPS = 1e-15
_TINY = 1e-300


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz), converging for x < (a+1)/(a+b+2)."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 1000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # even step
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # odd step
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + num / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"incomplete beta fraction did not converge (a={a}, b={b}, x={x})")


def _regularised_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)``, the regularised incomplete beta function, for ``0 <= x <= 1``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b  # symmetry: I_x(a,b) = 1 - I_(1-x)(b,a)


def _t_cdf(t: float, df: float) -> float:
    """Student t distribution function with ``df`` degrees of freedom."""
    tail = 0.5 * _regularised_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``scipy.stats.t.ppf(p, df)``).

    Example:
        >>> round(t_quantile(0.975, 1), 4), round(t_quantile(0.975, 9), 4)
        (12.7062, 2.2622)
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if not df > 0:
        raise ValueError(f"Student t needs df > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:  # bracket: the cdf is increasing
        lo, hi = hi, 2.0 * hi
    for _ in range(200):  # bisection to the float's resolution
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2.0


@dataclass(frozen=True)
class PairedDelta:
    """The mean of paired per-seed differences ``other - base``, its 95% t interval and sign count.

    ``low``/``high`` are ``None`` with one seed: the interval is undefined, not zero-width.
    """

    mean: float
    low: float | None
    high: float | None
    n: int
    positive: int  # seeds where the difference is > 0

    @property
    def significant(self) -> bool | None:
        """``None`` with one seed; else whether the 95% interval excludes 0."""
        if self.low is None or self.high is None:
            return None
        return not self.low <= 0.0 <= self.high

    @property
    def verdict(self) -> str:
        if self.significant is None:
            return "interval undefined (1 seed)"
        if not self.significant:
            return NO_DIFFERENCE
        return "higher" if self.mean > 0 else "lower"

    def __str__(self) -> str:
        """``+0.13 [-0.40, +0.66], 1/2 > 0, no significant difference``."""
        interval = "" if self.low is None or self.high is None else f" [{self.low:+.2f}, {self.high:+.2f}]"
        return f"{self.mean:+.2f}{interval}, {self.positive}/{self.n} > 0, {self.verdict}"

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {"mean": self.mean, "ci_low": self.low, "ci_high": self.high, "n": self.n,
                "positive": self.positive, "verdict": self.verdict}


def paired_delta(base: Mapping[int, float], other: Mapping[int, float], level: float = 0.95) -> PairedDelta | None:
    """``other - base`` over the seeds both have (``None`` if none): mean, t interval at ``level``, positives.

    Example:
        >>> d = paired_delta({0: 50.0, 1: 51.0, 2: 52.0}, {0: 51.0, 1: 51.5, 2: 53.5})
        >>> round(d.mean, 4), round(d.low, 4), round(d.high, 4), d.positive, d.verdict
        (1.0, -0.2421, 2.2421, 3, 'no significant difference')
    """
    seeds = sorted(set(base) & set(other))
    diffs = [other[s] - base[s] for s in seeds]
    if not diffs:
        return None
    mean = statistics.fmean(diffs)
    positive = sum(d > 0 for d in diffs)
    if len(diffs) < 2:
        return PairedDelta(mean, None, None, 1, positive)
    half = t_quantile(0.5 + level / 2.0, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return PairedDelta(mean, mean - half, mean + half, len(diffs), positive)
