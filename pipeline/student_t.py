"""Student's t distribution for an integer number of degrees of freedom, with no scipy: the
confidence intervals of ``make eval-student`` and the paired tests of ``make repro``.

It has a closed form (Abramowitz & Stegun 26.7.3 and 26.7.4): with ``theta = atan(t / sqrt(df))``,
``P(|T| <= t)`` is a finite sum in ``sin(theta)`` and ``cos(theta)``. Quantiles come from bisection on it.
"""

from __future__ import annotations

import math


def t_central(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with ``df`` (a positive integer) degrees of freedom."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom {df!r}: a positive integer is needed")
    if math.isinf(t):
        return 1.0
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    term = total = 1.0
    if df % 2 == 1:
        if df == 1:
            return 2.0 * theta / math.pi
        for k in range(2, df - 1, 2):  # 1 + 2/3 c^2 + (2*4)/(3*5) c^4 + ... up to c^(df-3)
            term *= k / (k + 1) * c * c
            total += term
        return 2.0 / math.pi * (theta + s * c * total)
    for k in range(1, df - 2, 2):  # 1 + 1/2 c^2 + (1*3)/(2*4) c^4 + ... up to c^(df-2)
        term *= k / (k + 1) * c * c
        total += term
    return s * total


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p value of a t statistic."""
    return max(0.0, 1.0 - t_central(t, df))


def t_quantile(level: float, df: int) -> float:
    """The ``t`` with ``P(|T| <= t) = level`` (e.g. 0.95 -> the 97.5% quantile), to 1e-10."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level {level} is not in (0, 1)")
    lo, hi = 0.0, 1.0
    while t_central(hi, df) < level:
        hi *= 2.0
    while hi - lo > 1e-10 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if t_central(mid, df) < level:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
