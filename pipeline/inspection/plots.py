"""PNG pictures with matplotlib (Agg backend, no display needed): the loss histogram, the mapped
share of a student, teacher tokens per student token, and chunk-level IoU/IoS against chunk count."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pipeline.inspection.align_report import AlignReport  # noqa: E402
from pipeline.inspection.summary import DatasetSummary  # noqa: E402

DPI = 120


def _short(name: str) -> str:
    """A tokenizer source as a short title: the file or folder name, or the hub id."""
    return Path(name).name if "/" in name and Path(name).suffix else name


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def loss_histogram(summary: DatasetSummary, path: str | os.PathLike, max_bars: int = 120) -> Path:
    """Histogram of the finite teacher losses (bins merged to at most ``max_bars``), with the
    mean and the median."""
    hist = summary.histogram
    fig, ax = plt.subplots(figsize=(8, 4.5))
    counts, edges = hist.dense_counts(), hist.edges()
    if counts.size:
        merge = max(1, int(np.ceil(counts.size / max_bars)))
        pad = (-counts.size) % merge
        merged = np.pad(counts, (0, pad)).reshape(-1, merge).sum(axis=1)
        left = edges[0] + np.arange(merged.size) * merge * hist.bin_width
        ax.bar(left, merged, width=merge * hist.bin_width, align="edge", color="#fd8d3c", edgecolor="none")
        ax.axvline(summary.loss_mean, color="#800026", linestyle="-", label=f"mean {summary.loss_mean:.3f}")
        median = summary.quantiles.get(0.5, hist.quantile(0.5))
        ax.axvline(median, color="#333333", linestyle="--", label=f"median {median:.3f}")
        ax.legend()
    ax.set_xlabel("teacher loss per token (nats)")
    ax.set_ylabel("tokens")
    ax.set_title(f"{summary.name}: {hist.total:,} finite losses, NaN share {100 * summary.nan_share:.2f}%")
    return _save(fig, path)


def mapped_share(report: AlignReport, path: str | os.PathLike) -> Path:
    """Per-document mapped share of the student's tokens, with the overall share."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    values = np.asarray(report.doc_mapped_share)
    if values.size:
        ax.hist(values * 100, bins=50, color="#41ab5d")
    overall = report.token_level.to_dict()["mapped_share"]
    ax.axvline(overall * 100, color="#000000", linestyle="--", label=f"all tokens {100 * overall:.2f}%")
    ax.set_xlabel("mapped student tokens per document (%)")
    ax.set_ylabel("documents")
    ax.set_title(f"student {_short(report.student)}: mapped share over {report.documents:,} documents")
    ax.legend()
    return _save(fig, path)


def teacher_per_student(report: AlignReport, path: str | os.PathLike) -> Path:
    """Bar chart of ``|A(i)|``: how many teacher tokens each student token maps to."""
    counts = report.to_dict()["teacher_per_student"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(counts), list(counts.values()), color="#6baed6")
    ax.set_yscale("log")
    ax.set_xlabel("teacher tokens per student token |A(i)|")
    ax.set_ylabel("student tokens (log)")
    ax.set_title(f"student {_short(report.student)}: mean {report.mean_teacher_per_student:.3f} over mapped tokens")
    return _save(fig, path)


def chunk_quality(report: AlignReport, path: str | os.PathLike) -> Path:
    """Chunk-level IoU and IoS against the chunk count, token level as dashed lines."""
    d = report.to_dict()
    counts = [int(n) for n in d["chunk_level"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, colour, label in (("iou_mean", "#e31a1c", "IoU"), ("ios_mean", "#2171b5", "IoS")):
        ax.plot(counts, [d["chunk_level"][str(n)][key] for n in counts], marker="o", color=colour, label=f"chunk level {label}")
        ax.axhline(d["token_level"][key], color=colour, linestyle="--", label=f"token level {label} {d['token_level'][key]:.3f}")
    if counts:
        ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("chunks per document C")
    ax.set_ylabel("mean over mapped student tokens")
    ax.set_title(f"student {_short(report.student)}: token-level vs chunk-level alignment")
    ax.legend(loc="center right", fontsize="small")
    return _save(fig, path)
