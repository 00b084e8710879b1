"""The rehearsal teacher's losses written from its definition (docs/sizing-a-run.md#the-rehearsal-teacher;
:mod:`pipeline.score_teacher.backends.rehearsal`) one token at a time with Python integers and a
hand-written interpolation: the reference its tests compare with."""

from __future__ import annotations

import bisect

import numpy as np

from pipeline.score_teacher.backends.rehearsal import LOSS_QUANTILES

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
SENTINEL = 0xFFFFFFFF
CONTEXT = 8


def mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


MULTIPLIERS = [mix(((k + 1) * GOLDEN) & MASK) | 1 for k in range(CONTEXT + 1)]


def reference_loss(seed: int, window: list[int], i: int) -> float:
    """The documented function for token ``i`` of ``window``, with Python integers."""
    h = seed * GOLDEN
    for k in range(CONTEXT + 1):
        h += MULTIPLIERS[k] * (window[i - k] if i - k >= 0 else SENTINEL)
    u = (mix(mix(h & MASK)) >> 11) / 2.0**53
    knots = [j / (len(LOSS_QUANTILES) - 1) for j in range(len(LOSS_QUANTILES))]  # probabilities j / K
    j = min(bisect.bisect_right(knots, u) - 1, len(knots) - 2)
    slope = (LOSS_QUANTILES[j + 1] - LOSS_QUANTILES[j]) / (knots[j + 1] - knots[j])
    return float(np.float32(slope * (u - knots[j]) + LOSS_QUANTILES[j]))


def reference_window(seed: int, window: list[int]) -> list[float]:
    return [float("nan")] + [reference_loss(seed, window, i) for i in range(1, len(window))]
