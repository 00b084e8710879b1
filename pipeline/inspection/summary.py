"""A scored dataset in numbers, computed with Polars lazily over all shards.

One pass over the data: for each shard the manifest lists, one ``pl.collect_all`` of four
streaming queries over its ``pl.scan_parquet`` (the queries share the scan), merged into running
results that never grow with the dataset:

* per shard: documents, empty documents, teacher tokens, NaN / infinite / finite losses, loss sum
  (the dataset totals are sums of this small table);
* the ``top_k`` highest- and lowest-mean-loss documents with at least ``min_tokens`` tokens;
* a histogram of the finite losses in bins of ``bin_width`` nats (a few thousand bins).

Why per shard rather than one scan of every shard: ``collect_all`` caches a subplan its queries
share, and over the whole dataset that cache (one row of statistics per document) grows with it;
per shard it is bounded by the shard. Memory is flat as the dataset grows (checked in
``tests/inspection/test_inspect_memory.py``); :meth:`ScoredDataset.scan` remains the one-frame view for
ad-hoc queries.

Loss quantiles come from that histogram (linear inside a bin), so they are exact to within one
bin width (1/128 nat by default); the mean, min and max are exact. Exact quantiles would need every
loss in memory at once, which is what this module avoids. Means ignore NaN (the first token of a
document without BOS has no prediction); infinite losses break the contract, are counted apart
and left out of every statistic. Skipped documents are not stored, so their counts by reason come
from the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import polars as pl

from pipeline.method.loss_histogram import (
    DEFAULT_BIN_WIDTH,
    LossHistogram,
    loss_histogram_query,
    merge_bins,
)
from storage_schemas import SKIP_REASONS, ZERO_TOKEN_REASONS
from storage_schemas import filesystem as sfs
from storage_schemas.reader import ScoredDataset, shard_problems

ENGINE = "streaming"  # polars' streaming engine: bounded memory for scans, explodes and group-bys

DEFAULT_QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


# --------------------------------------------------------------------------------------------
# The summary
# --------------------------------------------------------------------------------------------


@dataclass
class DatasetSummary:
    folder: str
    name: str
    complete: bool
    shards_listed: int
    shards_planned: int | None
    documents: int
    empty_documents: int  # stored with zero tokens (empty or whitespace-only text)
    tokens: int
    bytes_on_disk: int
    losses_finite: int
    losses_nan: int
    losses_inf: int
    loss_mean: float
    quantiles: dict[float, float]
    skipped: dict[str, int]  # not stored, by reason (manifest)
    zero_token: dict[str, int]  # stored with zero tokens, by reason (manifest)
    noted: dict[str, int]  # stored and scored, noted by reason (manifest)
    per_shard: pl.DataFrame
    highest: pl.DataFrame  # doc_id, file, tokens, mean_loss
    lowest: pl.DataFrame
    histogram: LossHistogram
    min_tokens: int = 1
    teacher: dict = field(default_factory=dict)
    damaged: dict[str, str] = field(default_factory=dict)  # shard file -> what is wrong with it; left out of the rest

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_on_disk / self.tokens if self.tokens else float("nan")

    @property
    def nan_share(self) -> float:
        return self.losses_nan / self.tokens if self.tokens else float("nan")

    @property
    def loss_min(self) -> float:
        return self.histogram.lowest

    @property
    def loss_max(self) -> float:
        return self.histogram.highest

    def to_dict(self) -> dict:
        """Plain JSON-able numbers (tables as lists of rows)."""
        scalars = {k: v for k, v in self.__dict__.items() if not isinstance(v, (pl.DataFrame, LossHistogram))}
        return {
            **scalars,
            "quantiles": {str(q): v for q, v in self.quantiles.items()},
            "bytes_per_token": self.bytes_per_token,
            "nan_share": self.nan_share,
            "loss_min": self.loss_min,
            "loss_max": self.loss_max,
            "quantile_resolution": self.histogram.bin_width,
            "per_shard": self.per_shard.to_dicts(),
            "highest": self.highest.to_dicts(),
            "lowest": self.lowest.to_dicts(),
        }


def per_document_stats(frame: pl.LazyFrame) -> pl.LazyFrame:
    """One row per document: tokens, NaN / infinite / finite loss counts, NaN-aware loss sum,
    min, max and mean (null when no finite loss). Keeps ``doc_id`` and ``file`` if present."""
    losses = pl.col("losses")
    finite = losses.list.eval(pl.element().cast(pl.Float64).filter(pl.element().is_finite()))
    keep = [c for c in ("doc_id", "file") if c in frame.collect_schema().names()]
    stats = frame.select(
        *keep,
        tokens=losses.list.len().cast(pl.Int64),
        nan=losses.list.eval(pl.element().is_nan()).list.sum().cast(pl.Int64),
        finite=finite.list.len().cast(pl.Int64),
        loss_sum=finite.list.sum(),
        loss_min=finite.list.min(),
        loss_max=finite.list.max(),
    )
    return stats.with_columns(
        inf=pl.col("tokens") - pl.col("nan") - pl.col("finite"),
        mean_loss=pl.when(pl.col("finite") > 0).then(pl.col("loss_sum") / pl.col("finite")),
    )


def _per_shard_query(stats: pl.LazyFrame) -> pl.LazyFrame:
    return stats.group_by("file").agg(
        documents=pl.len().cast(pl.Int64),
        empty_documents=(pl.col("tokens") == 0).sum().cast(pl.Int64),
        tokens=pl.col("tokens").sum(),
        nan=pl.col("nan").sum(),
        inf=pl.col("inf").sum(),
        finite=pl.col("finite").sum(),
        loss_sum=pl.col("loss_sum").sum(),
    )


def _extremes(stats: pl.LazyFrame, top_k: int, min_tokens: int) -> tuple[pl.LazyFrame, pl.LazyFrame]:
    eligible = stats.filter((pl.col("tokens") >= min_tokens) & pl.col("mean_loss").is_not_null())
    columns = ["doc_id", "file", "tokens", "mean_loss"]
    highest = eligible.top_k(top_k, by="mean_loss").select(columns)
    lowest = eligible.bottom_k(top_k, by="mean_loss").select(columns)
    return highest, lowest


def _by_reason(reasons: dict[str, int], group: tuple[str, ...]) -> dict[str, int]:
    return {k: int(v) for k, v in sorted(reasons.items()) if k in group}


Partial = tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]  # highest, lowest, histogram


def _merge(running: Partial | None, new: Partial, top_k: int) -> Partial:
    """Fold one shard's extremes and histogram into the running ones (their size stays bounded)."""
    if running is None:
        return new
    (highest, lowest, hist), (hi, lo, h) = running, new
    highest = pl.concat([highest, hi]).top_k(top_k, by="mean_loss")
    lowest = pl.concat([lowest, lo]).bottom_k(top_k, by="mean_loss")
    hist = merge_bins(hist, h)
    return highest, lowest, hist


def _shard_figures(frame: pl.LazyFrame, top_k: int, min_tokens: int, bin_width: float) -> tuple[pl.DataFrame, Partial]:
    """One shard's row of the per-shard table, and its extremes and histogram (one pass over it)."""
    stats = per_document_stats(frame)
    hi, lo = _extremes(stats, top_k, min_tokens)
    shard, hi, lo, h = pl.collect_all([_per_shard_query(stats), hi, lo, loss_histogram_query(frame, bin_width)],
                                      engine=ENGINE)
    return shard, (hi, lo, h)


def damaged_shards(dataset: ScoredDataset, checksums: bool = True) -> dict[str, str]:
    """The listed shards that do not hold what the manifest records, each with its first problem
    (:func:`storage_schemas.reader.shard_problems`: missing, another size or, with ``checksums``,
    another sha256, an unreadable footer, another identity or row count)."""
    found, held = {}, {sfs.name(p) for p in dataset.shard_paths}
    for entry in [e for e in dataset.entries if e["file"] in held]:
        problems = shard_problems(dataset.folder, entry, dataset.manifest, checksum=checksums).problems
        if problems:
            found[entry["file"]] = "; ".join(p for _, p in problems)
    return found


def summarize(
    dataset: ScoredDataset,
    top_k: int = 10,
    min_tokens: int = 16,
    quantiles: tuple[float, ...] = DEFAULT_QUANTILES,
    bin_width: float = DEFAULT_BIN_WIDTH,
    checksums: bool = True,
) -> DatasetSummary:
    """The dataset's summary; extremes only among documents with ``>= min_tokens`` tokens. A shard
    that is damaged (missing, of another size or, with ``checksums``, another sha256 than the manifest
    records, unreadable, of another identity) is left out of every figure and named in ``damaged``."""
    damaged = damaged_shards(dataset, checksums)
    shards, running = [], None
    for path in [p for p in dataset.shard_paths if sfs.name(p) not in damaged]:
        try:
            shard, partial = _shard_figures(pl.scan_parquet(str(path)).with_columns(file=pl.lit(sfs.name(path))),
                                            top_k, min_tokens, bin_width)
        except (pl.exceptions.PolarsError, OSError) as exc:  # a footer that reads, pages that do not
            damaged[sfs.name(path)] = f"unreadable ({str(exc).splitlines()[0]})"
            continue
        shards.append(shard)
        running = _merge(running, partial, top_k)
    if running is None:  # no shard, or none readable: the figures of none
        shard, running = _shard_figures(replace(dataset, shards=[]).scan(with_file=True), top_k, min_tokens, bin_width)
        shards.append(shard)
    highest, lowest, hist = running
    shards = _shard_table(dataset, pl.concat(shards), damaged)
    histogram = LossHistogram.from_bins(hist, bin_width)
    total = {c: int(shards[c].sum()) for c in ("documents", "empty_documents", "tokens", "nan", "inf", "finite")}
    loss_sum = float(shards["loss_sum"].sum() or 0.0)
    reasons = (dataset.manifest.get("totals") or {}).get("reasons", {})
    return DatasetSummary(
        folder=str(dataset.folder),
        name=dataset.name,
        complete=bool(dataset.manifest.get("complete")),
        shards_listed=len(dataset.entries),
        shards_planned=dataset.manifest.get("n_shards_planned"),
        documents=total["documents"],
        empty_documents=total["empty_documents"],
        tokens=total["tokens"],
        bytes_on_disk=int(shards["bytes"].sum()),
        losses_finite=total["finite"],
        losses_nan=total["nan"],
        losses_inf=total["inf"],
        loss_mean=loss_sum / total["finite"] if total["finite"] else float("nan"),
        quantiles={q: histogram.quantile(q) for q in quantiles},
        skipped=_by_reason(reasons, SKIP_REASONS),
        zero_token=_by_reason(reasons, ZERO_TOKEN_REASONS),
        noted={k: int(v) for k, v in sorted(reasons.items()) if k not in SKIP_REASONS + ZERO_TOKEN_REASONS},
        per_shard=shards,
        highest=highest.sort("mean_loss", descending=True),
        lowest=lowest.sort("mean_loss"),
        histogram=histogram,
        min_tokens=min_tokens,
        teacher=dataset.teacher.get("teacher") or {},
        damaged=damaged,
    )


def _size(location) -> int:
    size = sfs.size(location)
    if size is None:
        raise FileNotFoundError(f"{location}: listed in the manifest but missing")
    return size


def _shard_table(dataset: ScoredDataset, stats: pl.DataFrame, damaged: dict[str, str]) -> pl.DataFrame:
    """The per-shard statistics in manifest order, with bytes on disk and skipped counts; the
    ``damaged`` shards left out."""
    entries = [e for e in dataset.entries if e["file"] not in damaged]
    listed = pl.DataFrame(
        {
            "file": [e["file"] for e in entries],
            "bytes": [_size(sfs.child(dataset.folder, e["file"])) for e in entries],
            "skipped": [sum(v for k, v in e.get("reasons", {}).items() if k in SKIP_REASONS) for e in entries],
        },
        schema={"file": pl.String, "bytes": pl.Int64, "skipped": pl.Int64},
    )
    table = listed.join(stats, on="file", how="left", maintain_order="left").fill_null(0)
    return table.with_columns(
        bytes_per_token=pl.col("bytes") / pl.col("tokens"),
        mean_loss=pl.when(pl.col("finite") > 0).then(pl.col("loss_sum") / pl.col("finite")),
        nan_share=pl.when(pl.col("tokens") > 0).then(pl.col("nan") / pl.col("tokens")),
    )
