"""Two scored folders of one corpus side by side: do they hold the same thing?

For checking one backend against another (vLLM against transformers), one dtype against another
(bfloat16 against float32), one storage setting against another, one cluster against another.
The documents, token ids and character offsets must be equal, document for document; the losses
are compared per token:

* the absolute difference: max, p99 and mean (the p99 from a histogram of log-spaced bins,
  exact to within 1%);
* the share of tokens whose **selection flips**: in each document the ``ratio`` share of tokens a
  flat student would select (the lowest teacher loss, ``k = ceil(ratio * n)`` as the guided loss
  counts it) is taken under both folders, and a token flips when one selects it and the other does
  not.

Tokens whose **context differs** (the two folders planned their windows differently: another
window, stride or BOS, so the token was predicted from another left context,
:mod:`pipeline.method.windows`) are counted apart, in their own statistics: a difference there is the
window plan's, not the engine's. A token with a NaN loss in one folder and not the other is
counted as a mismatch of its own.

Only the **shards both folders hold** are compared, paired by file name, when both planned their
shards alike (the same ``rows_per_shard``): a folder scored in part (``limit_shards``, a shard
given up) is compared on what it has, and the shards only one folder holds are named apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from pipeline.method.windows import plan_windows
from storage_schemas import filesystem as sfs
from storage_schemas.reader import ScoredDataset

# |difference| histogram: log-spaced bins from 1e-9 to 1e3 nats (p99 within one bin, 1%).
EDGES = np.concatenate([[0.0], np.geomspace(1e-9, 1e3, 2600)])


@dataclass
class Differences:
    """Per-token loss differences of one group of tokens (same context, or context differs)."""

    tokens: int = 0
    compared: int = 0  # finite in both
    nan_mismatch: int = 0  # NaN in one folder only
    flips: int = 0
    selected: int = 0  # tokens selected under the first folder
    max_abs: float = 0.0
    sum_abs: float = 0.0
    counts: np.ndarray = field(default_factory=lambda: np.zeros(len(EDGES), dtype=np.int64))

    def add(self, a: np.ndarray, b: np.ndarray, sel_a: np.ndarray, sel_b: np.ndarray) -> None:
        self.tokens += a.size
        finite = np.isfinite(a) & np.isfinite(b)
        self.nan_mismatch += int((np.isnan(a) != np.isnan(b)).sum())
        diff = np.abs(a[finite].astype(np.float64) - b[finite].astype(np.float64))
        self.compared += diff.size
        if diff.size:
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.sum_abs += float(diff.sum())
            self.counts += np.bincount(np.searchsorted(EDGES, diff, side="right") - 1, minlength=len(EDGES))
        self.flips += int((sel_a != sel_b).sum())
        self.selected += int(sel_a.sum())

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of |difference| (the upper edge of its bin)."""
        if self.compared == 0:
            return float("nan")
        at = int(np.searchsorted(np.cumsum(self.counts), math.ceil(q * self.compared)))
        return min(float(EDGES[min(at + 1, len(EDGES) - 1)]), self.max_abs)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "compared": self.compared, "nan_mismatch": self.nan_mismatch,
                "max_abs": self.max_abs if self.compared else float("nan"), "p99_abs": self.quantile(0.99),
                "mean_abs": self.sum_abs / self.compared if self.compared else float("nan"),
                "flips": self.flips, "flip_share": self.flips / self.tokens if self.tokens else float("nan"),
                "selected": self.selected}


@dataclass
class Parity:
    a: str
    b: str
    ratio: float
    documents: int = 0
    same_context: Differences = field(default_factory=Differences)
    context_differs: Differences = field(default_factory=Differences)
    windows: tuple[dict, dict] = ({}, {})
    mismatches: list[str] = field(default_factory=list)  # documents, ids or offsets that differ (first few)
    n_mismatched: int = 0
    shards: int = 0  # shard files compared (held by both)
    only_in: tuple[list[str], list[str]] = ([], [])  # shard files held by the first folder only, the second only

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "ratio": self.ratio, "documents": self.documents, "shards": self.shards,
                "shards_only_in_a": self.only_in[0], "shards_only_in_b": self.only_in[1],
                "same_context": self.same_context.to_dict(), "context_differs": self.context_differs.to_dict(),
                "windows": {"a": self.windows[0], "b": self.windows[1]},
                "mismatched_documents": self.n_mismatched, "mismatches": self.mismatches}


def flat_student_selection(losses: np.ndarray, ratio: float) -> np.ndarray:
    """(M,) bool: the ``ceil(ratio * n)`` finite-loss tokens with the lowest teacher loss (ties by
    position), what a flat student's excess loss selects in one sequence."""
    finite = np.flatnonzero(np.isfinite(losses))
    chosen = np.zeros(losses.shape, dtype=bool)
    if finite.size:
        k = max(1, math.ceil(ratio * finite.size - 1e-6))
        order = finite[np.argsort(losses[finite], kind="stable")]
        chosen[order[:k]] = True
    return chosen


def context_starts(n_tokens: int, windows: dict) -> np.ndarray:
    """(n_tokens,) the first model-input position of the window that scored each token: its left
    context, under a folder's window plan (``windows``: window, stride, bos)."""
    bos = 1 if windows["bos"] else 0
    n = n_tokens + bos
    starts = np.zeros(n, dtype=np.int64)
    for w in plan_windows(n, windows["window"], windows["stride"]):
        starts[w.first_scored:w.stop] = w.start
    return starts[bos:]


def _plan(dataset: ScoredDataset) -> dict:
    identity = dataset.folders[0].identity
    w = identity.get("windows") or {}
    return {"window": w.get("window"), "stride": w.get("stride"),
            "bos": (identity.get("teacher") or {}).get("bos_id") is not None}


def shared_shards(a: ScoredDataset, b: ScoredDataset) -> tuple[ScoredDataset, ScoredDataset, list[str], list[str]]:
    """``a`` and ``b`` cut to the shards both hold (by file name, in ``a``'s order), and the names of
    those only ``a`` and only ``b`` holds; both whole where they planned their shards otherwise (another
    ``rows_per_shard``: a shard's name then means other documents)."""
    def rows(d: ScoredDataset):
        return (d.folders[0].identity.get("corpus") or {}).get("rows_per_shard")

    if rows(a) is None or rows(a) != rows(b):
        return a, b, [], []
    names_a, names_b = [sfs.name(s.path) for s in a.shards], [sfs.name(s.path) for s in b.shards]
    both = [n for n in names_a if n in set(names_b)]
    by_name = dict(zip(names_b, b.shards))
    return (replace(a, shards=[s for n, s in zip(names_a, a.shards) if n in set(both)]),
            replace(b, shards=[by_name[n] for n in both]),
            [n for n in names_a if n not in set(both)], [n for n in names_b if n not in set(both)])


def compare_folders(a: ScoredDataset, b: ScoredDataset, ratio: float = 0.4, limit_docs: int | None = None,
                    named: int = 10) -> Parity:
    """Compare ``a`` and ``b`` document for document, in dataset order, over the shards both hold
    (module docstring)."""
    result = Parity(a=str(a.folders[0].path), b=str(b.folders[0].path), ratio=ratio, windows=(_plan(a), _plan(b)))
    a, b, *only = shared_shards(a, b)
    result.shards, result.only_in = len(a.shards), (only[0], only[1])
    same_plan = result.windows[0] == result.windows[1]
    docs_b = b.iter_documents(limit=limit_docs)
    for da in a.iter_documents(limit=limit_docs):
        db = next(docs_b, None)
        problem = _mismatch(da, db)
        if problem:
            result.n_mismatched += 1
            if len(result.mismatches) < named:
                result.mismatches.append(problem)
            if db is None or db.doc_id != da.doc_id:
                break  # not the same documents in the same order: nothing further can be paired
            continue
        result.documents += 1
        sel_a, sel_b = flat_student_selection(da.losses, ratio), flat_student_selection(db.losses, ratio)
        if same_plan:
            same = np.ones(len(da.ids), dtype=bool)
        else:
            same = context_starts(len(da.ids), result.windows[0]) == context_starts(len(db.ids), result.windows[1])
        result.same_context.add(da.losses[same], db.losses[same], sel_a[same], sel_b[same])
        result.context_differs.add(da.losses[~same], db.losses[~same], sel_a[~same], sel_b[~same])
    extra = next(docs_b, None)
    if extra is not None and result.n_mismatched == 0:
        result.n_mismatched += 1
        result.mismatches.append(f"{extra.doc_id}: in {result.b} only (and every later document)")
    return result


def _mismatch(da, db) -> str | None:
    if db is None:
        return f"{da.doc_id}: in the first folder only (and every later document)"
    if db.doc_id != da.doc_id:
        return f"document {da.doc_id} where the second folder has {db.doc_id}: not the same documents in the same order"
    if da.text != db.text:
        return f"{da.doc_id}: the texts differ"
    for name in ("ids", "starts", "ends"):
        x, y = getattr(da, name), getattr(db, name)
        if x.shape != y.shape or not np.array_equal(x, y):
            at = int(np.flatnonzero(x[: min(len(x), len(y))] != y[: min(len(x), len(y))])[0]) \
                if not np.array_equal(x[: min(len(x), len(y))], y[: min(len(x), len(y))]) else min(len(x), len(y))
            return f"{da.doc_id}: token {'ids' if name == 'ids' else 'offsets'} differ (first at token {at})"
    return None
