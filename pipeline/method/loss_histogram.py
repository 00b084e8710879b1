"""A histogram of per-token losses in fixed bins, built with Polars in bounded memory.

Losses are counted per bin ``floor(loss / bin_width)`` (a few thousand bins whatever the dataset's
size); quantiles read from it are exact to within one bin, the min and max exactly. ``make
inspect``'s summary and the dataset card both build their loss statistics with it, so they report
the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_BIN_WIDTH = 1.0 / 128  # a power of two: bin edges are exact in float32


@dataclass(frozen=True)
class LossHistogram:
    """Counts of finite losses per bin ``[k w, (k+1) w)``; ``bins`` are the integers ``k``."""

    bin_width: float
    bins: np.ndarray  # (B,) int64, sorted
    counts: np.ndarray  # (B,) int64
    lowest: float  # exact min and max of the values counted
    highest: float

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (numpy's "linear" rank ``q (n-1)``), exact to within one bin."""
        if self.total == 0:
            return float("nan")
        rank = q * (self.total - 1)
        cum = np.cumsum(self.counts)  # (B,)
        b = int(np.searchsorted(cum, rank, side="right"))
        before = cum[b - 1] if b > 0 else 0
        inside = (rank - before + 0.5) / self.counts[b]  # position inside the bin, in (0, 1)
        value = (self.bins[b] + inside) * self.bin_width
        return float(min(max(value, self.lowest), self.highest))

    def edges(self) -> np.ndarray:
        """(B+1,) bin edges of a dense histogram from the lowest to the highest bin."""
        if self.bins.size == 0:
            return np.zeros(1)
        return np.arange(self.bins[0], self.bins[-1] + 2) * self.bin_width

    def dense_counts(self) -> np.ndarray:
        """(B,) counts of the dense histogram of :meth:`edges` (empty bins as zeros)."""
        if self.bins.size == 0:
            return np.zeros(0, dtype=np.int64)
        dense = np.zeros(int(self.bins[-1] - self.bins[0] + 1), dtype=np.int64)
        dense[self.bins - self.bins[0]] = self.counts
        return dense

    @classmethod
    def from_bins(cls, frame: pl.DataFrame, bin_width: float) -> "LossHistogram":
        """From the rows of :func:`loss_histogram_query` (or :func:`merge_bins`), in any order."""
        if frame.height == 0:
            return cls(bin_width, np.zeros(0, np.int64), np.zeros(0, np.int64), float("nan"), float("nan"))
        frame = frame.sort("bin")
        return cls(
            bin_width=bin_width,
            bins=frame["bin"].to_numpy().astype(np.int64),
            counts=frame["count"].to_numpy().astype(np.int64),
            lowest=float(frame["lowest"].min()),
            highest=float(frame["highest"].max()),
        )


def loss_histogram_query(frame: pl.LazyFrame, bin_width: float = DEFAULT_BIN_WIDTH) -> pl.LazyFrame:
    """Finite losses exploded and counted per bin ``floor(loss / bin_width)`` (bounded groups)."""
    import polars as pl  # lazy: seconds to import; a config error is refused first
    return (
        frame.select(pl.col("losses").explode().cast(pl.Float64))
        .filter(pl.col("losses").is_finite())
        .group_by(bin=(pl.col("losses") / bin_width).floor().cast(pl.Int64))
        .agg(count=pl.len(), lowest=pl.col("losses").min(), highest=pl.col("losses").max())
        .sort("bin")
    )


def merge_bins(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """Two sets of :func:`loss_histogram_query` rows as one (counts added per bin)."""
    import polars as pl  # lazy: seconds to import; a config error is refused first
    return pl.concat([a, b]).group_by("bin").agg(
        count=pl.col("count").sum(), lowest=pl.col("lowest").min(), highest=pl.col("highest").max()
    )
