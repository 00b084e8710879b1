"""The statistics behind every repro verdict: a paired t test over seeds.

Student's t distribution is scipy's (``scipy.stats.t``). The test's statistic, p value and interval
are computed here from the differences' ``statistics.fmean``/``stdev`` rather than by
``scipy.stats.ttest_1samp``, because the report defines results where scipy returns NaN or warns
(one seed: no interval; identical differences: a zero-width interval and ``p`` 0 or 1).
"""

from __future__ import annotations

import math
import statistics

from scipy import stats

LEVEL = 0.95  # two-sided confidence level of every interval in the report


def _df(df: int) -> int:
    if df < 1 or int(df) != df:  # scipy answers NaN here; a wrong count of seeds is an error
        raise ValueError(f"degrees of freedom {df!r}: a positive integer is needed")
    return df


def t_quantile(level: float, df: int) -> float:
    """The two-sided critical value: the ``t`` with ``P(|T| <= t) = level`` (0.95 -> t(0.975, df))."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level {level} is not in (0, 1)")
    return float(stats.t.ppf(0.5 + level / 2, _df(df)))


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p value of a t statistic, ``P(|T| > |t|)``."""
    return float(2.0 * stats.t.sf(abs(t), _df(df)))


def t_central(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with ``df`` degrees of freedom."""
    return 1.0 - t_two_sided_p(t, df)


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
    if se > 0:
        t = mean / se
        p = t_two_sided_p(t, n - 1)
        ci = [float(x) for x in stats.t.interval(level, n - 1, loc=mean, scale=se)]
    else:  # scipy's t wants a positive scale
        t = math.copysign(math.inf, mean) if mean else 0.0
        p = 0.0 if mean else 1.0
        ci = [mean, mean]
    return {"n": n, "mean": mean, "sd": sd, "se": se, "ci": ci, "t": t, "p": p,
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
