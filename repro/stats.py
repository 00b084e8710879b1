"""The statistics behind every repro verdict: a paired t test over seeds, with no scipy.

Student's t distribution comes from :mod:`pipeline.student_t` (the library's, which
``make eval-student`` uses too).
"""

from __future__ import annotations

import math
import statistics

from pipeline.student_t import t_central, t_quantile, t_two_sided_p  # noqa: F401  (part of this module's interface)

LEVEL = 0.95  # two-sided confidence level of every interval in the report


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
