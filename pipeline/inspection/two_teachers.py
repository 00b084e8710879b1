"""Two teachers seen through one student tokenizer (``make inspect ARGS="command=two-teachers ..."``).

The documents both scored datasets hold (same ``doc_id``, same text) are tokenized with the student
tokenizer and each teacher's losses aligned to the student tokens separately, as stage 2 does
(docs/METHOD.md §2.1, §2.6). Over the student tokens both teachers map:

* the Pearson and Spearman correlation of the two aligned losses;
* how often the teachers' top-``ratio`` selections disagree. Without a student model the excess
  loss ``l_s - L_t`` is taken for a student whose loss is the same on every token, so each teacher
  selects the ``k = ceil(ratio * n)`` tokens with the *lowest* ``L_t`` among the ``n`` tokens both
  map (ties to the earlier token), ranked over all examined documents together. The share of the
  ``n`` tokens that exactly one teacher selects is reported, with the Jaccard index of the two
  selections.

Documents only one dataset holds, and examined documents whose text differs, are counted and left out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
from rich.table import Table

from pipeline.method.alignment import align_documents
from pipeline.method.tokenization import encode_batch
from storage_schemas.reader import ScoredDataset

BATCH = 256  # documents tokenized and aligned per call


@dataclass
class TwoTeacherReport:
    first: str
    second: str
    student: str
    how: str
    ratio: float
    documents: dict = field(default_factory=dict)  # shared ids, only in one, examined, text differs
    student_tokens: int = 0
    mapped: dict = field(default_factory=dict)  # both, only_first, only_second, neither
    pearson: float = math.nan
    spearman: float = math.nan
    k: int = 0
    disagree: int = 0  # tokens exactly one teacher selects
    disagree_share: float = math.nan
    selection_jaccard: float = math.nan

    def to_dict(self) -> dict:
        return asdict(self)


def lowest_k(values: np.ndarray, ratio: float) -> tuple[np.ndarray, int]:
    """Boolean mask of the ``ceil(ratio * n)`` lowest values (ties: the earlier position first)."""
    n = values.size
    k = max(1, math.ceil(ratio * n - 1e-6)) if n else 0
    mask = np.zeros(n, bool)
    mask[np.argsort(values, kind="stable")[:k]] = True
    return mask, k


def _ranks(values: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions), for Spearman's correlation."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], values.size]
    ranks = np.empty(values.size, np.float64)
    ranks[order] = np.repeat((starts + ends - 1) / 2.0, ends - starts)
    return ranks


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    if a.size < 2 or a.std() == 0 or b.std() == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def _doc_ids(dataset: ScoredDataset) -> list[str]:
    return dataset.scan().select("doc_id").collect()["doc_id"].to_list()


def _records(dataset: ScoredDataset, wanted: set[str]) -> dict:
    """The stored documents with these ids (one streamed pass; only they are kept)."""
    return {r.doc_id: r for r in dataset.iter_documents() if r.doc_id in wanted}


def two_teachers(first: ScoredDataset, second: ScoredDataset, tokenizer, *, student: str = "", how: str = "max",
                 ratio: float = 0.4, limit_docs: int | None = None) -> TwoTeacherReport:
    """The report of the module docstring; ``limit_docs`` caps the shared documents examined (in
    the first dataset's order). Ids are counted over both datasets, texts compared over the
    examined documents."""
    ids_a, ids_b = _doc_ids(first), _doc_ids(second)
    set_a, set_b = set(ids_a), set(ids_b)
    shared = [d for d in ids_a if d in set_b][:limit_docs]
    a, b = _records(first, set(shared)), _records(second, set(shared))
    matched = [d for d in shared if a[d].text == b[d].text]
    report = TwoTeacherReport(first.name, second.name, student, how, ratio, documents={
        "shared_ids": len(set_a & set_b), "only_first": len(set_a - set_b), "only_second": len(set_b - set_a),
        "examined": len(shared), "text_differs": len(shared) - len(matched)})
    losses_a, losses_b = [], []
    for k in range(0, len(matched), BATCH):
        ids = matched[k : k + BATCH]
        encodings = encode_batch(tokenizer, [a[d].text for d in ids])
        for side, out in ((a, losses_a), (b, losses_b)):
            aligned = align_documents(encodings, [(side[d].starts, side[d].ends, side[d].losses) for d in ids], how)
            out += [x.teacher_loss for x in aligned]
    la = np.concatenate(losses_a) if losses_a else np.zeros(0, np.float32)
    lb = np.concatenate(losses_b) if losses_b else np.zeros(0, np.float32)
    ma, mb = ~np.isnan(la), ~np.isnan(lb)
    both = ma & mb
    report.student_tokens = int(la.size)
    report.mapped = {"both": int(both.sum()), "only_first": int((ma & ~mb).sum()),
                     "only_second": int((~ma & mb).sum()), "neither": int((~ma & ~mb).sum())}
    x, y = la[both].astype(np.float64), lb[both].astype(np.float64)
    report.pearson = _pearson(x, y)
    report.spearman = _pearson(_ranks(x), _ranks(y))
    if x.size:
        sel_a, report.k = lowest_k(x, ratio)
        sel_b, _ = lowest_k(y, ratio)
        report.disagree = int((sel_a ^ sel_b).sum())
        report.disagree_share = report.disagree / x.size
        report.selection_jaccard = float((sel_a & sel_b).sum() / (sel_a | sel_b).sum())
    return report


def renderables(report: TwoTeacherReport) -> list:
    """Rich tables for the terminal."""

    docs = Table(title=f"two teachers through {report.student}: {report.first} vs {report.second}")
    docs.add_column("documents")
    docs.add_column("count", justify="right")
    for key, value in report.documents.items():
        docs.add_row(key.replace("_", " "), f"{value:,}")
    tokens = Table(title=f"student tokens ({report.student_tokens:,}), teacher losses aggregated by {report.how}")
    tokens.add_column("measure")
    tokens.add_column("value", justify="right")
    for key, value in report.mapped.items():
        tokens.add_row(f"mapped by {key.replace('_', ' ')}", f"{value:,}")
    tokens.add_row("Pearson r of the aligned losses (mapped by both)", _fmt(report.pearson))
    tokens.add_row("Spearman rho", _fmt(report.spearman))
    tokens.add_row(f"top-{report.ratio:.0%} selections: k of each", f"{report.k:,}")
    tokens.add_row("tokens exactly one teacher selects", f"{report.disagree:,} ({_fmt(report.disagree_share, pct=True)})")
    tokens.add_row("Jaccard of the two selections", _fmt(report.selection_jaccard))
    return [docs, tokens]


def _fmt(value: float, pct: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{100 * value:.1f}%" if pct else f"{value:.4f}"
