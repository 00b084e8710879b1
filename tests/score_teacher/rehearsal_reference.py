"""The rehearsal teacher's losses written from its definition (docs/running-at-scale.md#rehearsing-at-scale;
:mod:`pipeline.score_teacher.backends.rehearsal`) one token at a time with Python integers and a
hand-written interpolation: the reference its tests compare with."""

from __future__ import annotations

import bisect

import numpy as np

from pipeline.score_teacher.backends.rehearsal import LOSS_QUANTILES

MASK = (1 << 64) - 1
MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9)
SENTINEL = 0xFFFFFFFF


def mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def reference_loss(seed: int, before2: int, before1: int, token: int) -> float:
    """The documented function for one token, with Python integers and a hand-written interpolation."""
    h = mix((seed + MULTIPLIERS[0] * token) & MASK) ^ ((MULTIPLIERS[1] * before1) & MASK) ^ ((MULTIPLIERS[2] * before2) & MASK)
    u = (mix(h) >> 11) / 2.0**53
    knots = [i / (len(LOSS_QUANTILES) - 1) for i in range(len(LOSS_QUANTILES))]  # probabilities k / K
    k = min(bisect.bisect_right(knots, u) - 1, len(knots) - 2)
    slope = (LOSS_QUANTILES[k + 1] - LOSS_QUANTILES[k]) / (knots[k + 1] - knots[k])
    return float(np.float32(slope * (u - knots[k]) + LOSS_QUANTILES[k]))


def reference_window(seed: int, window: list[int]) -> list[float]:
    out = [float("nan")]
    for i in range(1, len(window)):
        before1 = window[i - 1]
        before2 = window[i - 2] if i >= 2 else SENTINEL
        out.append(reference_loss(seed, before2, before1, window[i]))
    return out
