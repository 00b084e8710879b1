"""Sliding windows for documents longer than the teacher's context (docs/METHOD.md §1.3).

A document's model input is ``z = [BOS] + tokens``; position ``p`` is predicted from ``z[:p]``.
Window ``k`` is ``z[k * stride : k * stride + window]``; the first window scores every position it
can, each later one only the positions after the previous window's end. So every position is
scored by exactly one window, with at least ``window - stride`` tokens of left context, and nothing
is truncated. Both backends use this plan, so they store the same losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Window:
    start: int  # first z position fed to the model
    stop: int  # one past the last z position fed to the model
    first_scored: int  # first z position whose prediction is kept (start < first_scored <= stop)


def plan_windows(n: int, window: int, stride: int) -> list[Window]:
    """Windows over a sequence of ``n`` positions; see the module docstring."""
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    if not 1 <= stride <= window - 1:
        raise ValueError(f"stride must be in [1, window-1] = [1, {window - 1}], got {stride}")
    if n <= 1:
        return []
    windows = []
    start, scored_until = 0, 1
    while scored_until < n:
        stop = min(start + window, n)
        windows.append(Window(start=start, stop=stop, first_scored=scored_until))
        scored_until = stop
        start += stride
    return windows


def stitch(n: int, windows: list[Window], window_losses: list[np.ndarray]) -> np.ndarray:
    """Per-position losses of ``z`` (NaN at position 0) from each window's per-position losses.

    ``window_losses[k][i]`` is the loss of predicting ``z[start_k + i]`` inside window ``k``.
    """
    out = np.full(n, np.nan, dtype=np.float32)
    for w, losses in zip(windows, window_losses):
        lo = w.first_scored - w.start
        out[w.first_scored : w.stop] = losses[lo : w.stop - w.start]
    return out
