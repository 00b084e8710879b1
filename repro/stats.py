"""The statistics behind every repro verdict: a paired t test over seeds, with no scipy.

Student's t distribution for an integer number of degrees of freedom has a closed form
(Abramowitz & Stegun 26.7.3 and 26.7.4): with ``theta = atan(t / sqrt(df))``, ``P(|T| <= t)`` is a
finite sum in ``sin(theta)`` and ``cos(theta)``. Quantiles come from bisection on it.
"""

from __future__ import annotations

import math
import statistics

LEVEL = 0.95  # two-sided confidence level of every interval in the report


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


def paired_test(diffs: list[float], level: float = LEVEL) -> dict:
    """Mean of seed-paired differences, its ``level`` t interval and the two-sided p value.

    One difference gives no interval (``ci`` is ``None``, ``p`` NaN). Identical non-zero
    differences give a zero-width interval and ``p = 0``; all zero gives ``p = 1``.
    """
    n = len(diffs)
    if n == 0:
        raise ValueError("no paired differences")
    mean = statistics.fmean(diffs)
    if n == 1:
        return {"n": 1, "mean": mean, "sd": math.nan, "se": math.nan, "ci": None, "t": math.nan, "p": math.nan,
                "df": 0, "level": level, "diffs": list(diffs)}
    sd = statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    half = t_quantile(level, n - 1) * se
    if se > 0:
        t = mean / se
        p = t_two_sided_p(t, n - 1)
    else:
        t = math.copysign(math.inf, mean) if mean else 0.0
        p = 0.0 if mean else 1.0
    return {"n": n, "mean": mean, "sd": sd, "se": se, "ci": [mean - half, mean + half], "t": t, "p": p,
            "df": n - 1, "level": level, "diffs": list(diffs)}


HOLDS, INCONCLUSIVE, DOES_NOT_HOLD, NOT_RUN = "holds", "inconclusive", "does not hold", "not run"
_STRENGTH = {DOES_NOT_HOLD: 0, NOT_RUN: 1, INCONCLUSIVE: 2, HOLDS: 3}


def verdict(test: dict | None, claimed: int = -1) -> str:
    """``holds`` when the interval excludes zero on the claimed side (``claimed=-1``: the mean
    difference is claimed negative), ``does not hold`` when it excludes zero on the other side,
    ``inconclusive`` otherwise (also with one seed, where there is no interval)."""
    if test is None:
        return NOT_RUN
    if test["ci"] is None:
        return INCONCLUSIVE
    lo, hi = test["ci"]
    if (claimed < 0 and hi < 0) or (claimed > 0 and lo > 0):
        return HOLDS
    if (claimed < 0 and lo > 0) or (claimed > 0 and hi < 0):
        return DOES_NOT_HOLD
    return INCONCLUSIVE


def weakest(verdicts: list[str]) -> str:
    """A claim made of several comparisons is as strong as its weakest one (never upgraded): any
    ``does not hold`` makes it ``does not hold``; else anything short of ``holds`` makes it
    ``inconclusive`` (``not run`` when nothing was run)."""
    if not verdicts or all(v == NOT_RUN for v in verdicts):
        return NOT_RUN
    worst = min(verdicts, key=_STRENGTH.__getitem__)
    return INCONCLUSIVE if worst == NOT_RUN else worst
