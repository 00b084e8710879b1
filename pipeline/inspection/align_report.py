"""How a student tokenizer lines up with a scored dataset's teacher tokens, before any training.

Every document (or the first ``limit_docs``) is tokenized with the student's fast tokenizer and
aligned with :mod:`pipeline.method.alignment`, exactly as training will do it. Reported:

* mapped share: student tokens whose ``A(i)`` holds at least one finite teacher loss
  (:func:`pipeline.method.alignment.align_document`), over all student tokens;
* IoS per student token (share of its characters covered by its mapped teacher tokens, from
  :func:`pipeline.method.alignment.alignment_quality`) and IoU per student token,
  ``|chars(i) ∩ chars(A(i))| / |chars(i) ∪ chars(A(i))|``, averaged over mapped tokens; also the
  document-level IoU of docs/METHOD.md §2.1 (character sets of all mapped student tokens and their
  teacher tokens);
* teacher tokens per student token ``|A(i)|`` (and student tokens per teacher token), as counts
  of 0, 1, ..., 7 and 8 or more;
* the same IoS / IoU / mapped share for chunk-level alignment at several chunk counts C
  (:func:`pipeline.method.alignment.chunk_align`: the text cut into C equal character ranges, each token in
  the chunk holding its start, every student token mapped to the teacher tokens with a finite
  loss of its chunk). This is the paper's comparison: chunks cover their student tokens loosely
  (low IoU) when few, and cut through them (IoS below 1) when many.

Optionally the aligned student tokens are written as Parquet, one row per document and one file
per source shard: ``<out>/aligned/<student>/shard-NNNNNN.parquet`` (:data:`ALIGNED_SCHEMA`).
``teacher_lo``/``teacher_hi`` is the teacher range ``[lo, hi)`` of :func:`pipeline.method.alignment.align_spans`
(exactly ``A(i)`` for the project's tokenizers, whose teacher ends never decrease);
``teacher_loss`` is ``agg{l_t(j) : j in A(i)}`` (NaN if unmapped).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from pipeline.method.alignment import (
    align_document,
    align_spans,
    alignment_quality,
    chunk_align,
    chunk_ids,
    overlap_pairs,
)
from pipeline.method.tokenization import Encoding, encode_batch, fingerprint
from storage_schemas.reader import DocumentRecord, ScoredDataset
from storage_schemas.rows import list_array

DEFAULT_CHUNK_COUNTS = (1, 4, 16, 64, 256)
FANOUT_BUCKETS = 8  # counts 0..7, then "8 or more"

ALIGNED_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("starts", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("ends", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("teacher_lo", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("teacher_hi", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("teacher_loss", pa.list_(pa.field("item", pa.float32(), nullable=False)), nullable=False),
        pa.field("mapped", pa.list_(pa.field("item", pa.bool_(), nullable=False)), nullable=False),
    ]
)
META_ALIGNED = "vocagno.aligned"


# --------------------------------------------------------------------------------------------
# One document
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenQuality:
    """Per student token: mapped flag, IoS and IoU (NaN where not mapped)."""

    mapped: np.ndarray  # (N,) bool
    ios: np.ndarray  # (N,) float64
    iou: np.ndarray  # (N,) float64


@dataclass(frozen=True)
class AlignedDocument:
    doc_id: str
    student: Encoding
    teacher_lo: np.ndarray  # (N,) int64
    teacher_hi: np.ndarray  # (N,) int64
    teacher_loss: np.ndarray  # (N,) float32, aggregated over A(i); NaN if unmapped
    token: TokenQuality
    doc_iou: float  # document-level IoU (docs/METHOD.md §2.1) of the character sets
    fanout: np.ndarray  # (N,) |A(i)|
    fanin: np.ndarray  # (M,) student tokens per teacher token
    chunks: dict[int, TokenQuality] = field(default_factory=dict)


def _union_length_by_group(group: np.ndarray, starts: np.ndarray, ends: np.ndarray, n_groups: int) -> np.ndarray:
    """(n_groups,) length of the union of intervals ``[starts, ends)`` per group.

    Intervals must be sorted by group (ascending) and by start inside a group. Offsetting each
    group by ``group * span`` lets one running maximum of the ends serve every group at once.
    """
    if group.size == 0:
        return np.zeros(n_groups, dtype=np.float64)
    span = int(max(ends.max(), starts.max())) + 1
    offset = group.astype(np.int64) * span
    s, e = starts + offset, ends + offset  # (P,)
    covered_until = np.r_[np.iinfo(np.int64).min, np.maximum.accumulate(e)[:-1]]  # (P,)
    contribution = np.maximum(0, e - np.maximum(s, covered_until))
    return np.bincount(group, weights=contribution, minlength=n_groups)


def _group_starts(owner: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]]) if owner.size else owner


def _token_level_iou(c, d, a, b, owner, j, ios) -> np.ndarray:
    """Per student token ``|i ∩ A(i)| / |i ∪ A(i)|``. Every span of ``A(i)`` overlaps ``i``, so
    the union is the hull ``[min(c, min a_j), max(d, max b_j))``; the intersection is IoS x |i|."""
    iou = np.full(c.size, np.nan)
    if owner.size:
        first = _group_starts(owner)
        g = owner[first]
        lo_a = np.minimum.reduceat(a[j], first)
        hi_b = np.maximum.reduceat(b[j], first)
        union = np.maximum(d[g], hi_b) - np.minimum(c[g], lo_a)
        iou[g] = ios[g] * (d[g] - c[g]) / union
    return iou


def chunk_quality(c, d, a, b, losses, owner, j, n_chunks: int, text_len: int) -> TokenQuality:
    """IoS and IoU of chunk-level alignment with ``n_chunks`` chunks, per student token.

    Student token ``i`` in chunk ``k`` maps to ``T_k``, the teacher tokens with a non-empty span
    and a finite loss whose start is in chunk ``k`` (the tokens :func:`chunk_align` averages).
    ``|i ∩ T_k|`` comes from the overlapping pairs of ``T_k``; ``|i ∪ T_k| = |i| + |T_k| - |i ∩ T_k|``.
    """
    mapped = ~np.isnan(chunk_align(c, d, a, b, losses, n_chunks, text_len))  # (N,)
    valid = (b > a) & ~np.isnan(losses)  # (M,)
    t_chunk, s_chunk = chunk_ids(a, n_chunks, text_len), chunk_ids(c, n_chunks, text_len)
    in_chunk = np.flatnonzero(valid)
    cover = _union_length_by_group(t_chunk[in_chunk], a[in_chunk], b[in_chunk], n_chunks)  # (C,)
    keep = valid[j] & (t_chunk[j] == s_chunk[owner])  # pairs whose teacher token is in i's chunk
    o, jj = owner[keep], j[keep]
    inter = _union_length_by_group(o, np.maximum(a[jj], c[o]), np.minimum(b[jj], d[o]), c.size)  # (N,)
    length = (d - c).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        ios = np.where(mapped, inter / length, np.nan)
        iou = np.where(mapped, inter / (length + cover[s_chunk] - inter), np.nan)
    return TokenQuality(mapped=mapped, ios=ios, iou=iou)


def align_record(
    record: DocumentRecord, student: Encoding, how: str = "max", chunk_counts: Iterable[int] = ()
) -> AlignedDocument:
    """Align one stored document with its student encoding; every measure of the report."""
    c, d = student.starts.astype(np.int64), student.ends.astype(np.int64)
    a, b = record.starts.astype(np.int64), record.ends.astype(np.int64)
    losses = record.losses.astype(np.float64)
    owner, j = overlap_pairs(c, d, a, b)
    aligned = align_document(student, a, b, losses, how)
    quality = alignment_quality(c, d, a, b, mapped=aligned.mapped)
    lo, hi = align_spans(c, d, a, b)
    token = TokenQuality(mapped=aligned.mapped, ios=quality.ios, iou=_token_level_iou(c, d, a, b, owner, j, quality.ios))
    text_len = len(record.text)
    return AlignedDocument(
        doc_id=record.doc_id,
        student=student,
        teacher_lo=lo,
        teacher_hi=hi,
        teacher_loss=aligned.teacher_loss,
        token=token,
        doc_iou=quality.iou,
        fanout=np.bincount(owner, minlength=c.size),
        fanin=np.bincount(j, minlength=a.size),
        chunks={n: chunk_quality(c, d, a, b, losses, owner, j, n, text_len) for n in chunk_counts},
    )


def iter_aligned(
    dataset: ScoredDataset, tokenizer, how: str = "max", chunk_counts: Iterable[int] = DEFAULT_CHUNK_COUNTS,
    limit_docs: int | None = None, batch_docs: int = 64,
) -> Iterator[tuple[DocumentRecord, AlignedDocument]]:
    """Stored documents with their alignment, student-tokenized ``batch_docs`` at a time."""
    chunk_counts = tuple(chunk_counts)
    batch: list[DocumentRecord] = []
    for record in dataset.iter_documents(limit=limit_docs):
        batch.append(record)
        if len(batch) == batch_docs:
            yield from _align_batch(batch, tokenizer, how, chunk_counts)
            batch = []
    yield from _align_batch(batch, tokenizer, how, chunk_counts)


def _align_batch(batch, tokenizer, how, chunk_counts):
    for record, encoding in zip(batch, encode_batch(tokenizer, [r.text for r in batch])):
        yield record, align_record(record, encoding, how, chunk_counts)


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass
class QualityTotals:
    """Running sums of one alignment mode over many documents."""

    tokens: int = 0  # student tokens seen (all, empty spans included)
    mapped: int = 0
    ios_sum: float = 0.0
    iou_sum: float = 0.0
    ios_full: int = 0  # mapped tokens whose characters are all covered

    def add(self, q: TokenQuality) -> None:
        self.tokens += int(q.mapped.size)
        self.mapped += int(q.mapped.sum())
        self.ios_sum += float(q.ios[q.mapped].sum())
        self.iou_sum += float(q.iou[q.mapped].sum())
        self.ios_full += int(np.count_nonzero(q.ios[q.mapped] >= 1.0))

    def to_dict(self) -> dict:
        m = self.mapped
        return {"tokens": self.tokens, "mapped": m, "mapped_share": m / self.tokens if self.tokens else float("nan"),
                "ios_mean": self.ios_sum / m if m else float("nan"), "iou_mean": self.iou_sum / m if m else float("nan"),
                "ios_full_share": self.ios_full / m if m else float("nan")}


@dataclass
class AlignReport:
    dataset: str
    student: str
    how: str
    chunk_counts: tuple[int, ...]
    limit_docs: int | None
    documents: int = 0
    teacher_tokens: int = 0
    empty_student_spans: int = 0
    token_level: QualityTotals = field(default_factory=QualityTotals)
    chunk_level: dict[int, QualityTotals] = field(default_factory=dict)
    teacher_per_student: np.ndarray = field(default_factory=lambda: np.zeros(FANOUT_BUCKETS + 1, np.int64))
    student_per_teacher: np.ndarray = field(default_factory=lambda: np.zeros(FANOUT_BUCKETS + 1, np.int64))
    doc_mapped_share: list[float] = field(default_factory=list)  # per document with student tokens
    doc_iou: list[float] = field(default_factory=list)
    fanout_sum: int = 0  # sum of |A(i)| over mapped student tokens

    def add(self, record: DocumentRecord, doc: AlignedDocument) -> None:
        self.documents += 1
        self.teacher_tokens += len(record)
        non_empty = doc.student.ends > doc.student.starts
        self.empty_student_spans += int((~non_empty).sum())
        self.token_level.add(doc.token)
        self.fanout_sum += int(doc.fanout[doc.token.mapped].sum())
        for n, q in doc.chunks.items():
            self.chunk_level.setdefault(n, QualityTotals()).add(q)
        self.teacher_per_student += _bucket_counts(doc.fanout[non_empty])
        self.student_per_teacher += _bucket_counts(doc.fanin[record.ends > record.starts])
        if len(doc.student):
            self.doc_mapped_share.append(float(doc.token.mapped.mean()))
        if not np.isnan(doc.doc_iou):
            self.doc_iou.append(doc.doc_iou)

    @property
    def mean_teacher_per_student(self) -> float:
        """Mean ``|A(i)|`` over mapped student tokens (from the exact pairs)."""
        return self.fanout_sum / self.token_level.mapped if self.token_level.mapped else float("nan")

    def to_dict(self) -> dict:
        return {
            "dataset": self.dataset, "student": self.student, "aggregation": self.how, "limit_docs": self.limit_docs,
            "documents": self.documents, "teacher_tokens": self.teacher_tokens,
            "student_tokens": self.token_level.tokens, "empty_student_spans": self.empty_student_spans,
            "token_level": {**self.token_level.to_dict(), "doc_iou_mean": _mean(self.doc_iou)},
            "chunk_level": {str(n): self.chunk_level[n].to_dict() for n in self.chunk_counts if n in self.chunk_level},
            "teacher_per_student": _bucket_dict(self.teacher_per_student),
            "mean_teacher_per_mapped_student": self.mean_teacher_per_student,
            "student_per_teacher": _bucket_dict(self.student_per_teacher),
            "doc_mapped_share": _quantiles(self.doc_mapped_share),
        }


def _bucket_counts(values: np.ndarray) -> np.ndarray:
    return np.bincount(np.minimum(values, FANOUT_BUCKETS), minlength=FANOUT_BUCKETS + 1)


def _bucket_dict(counts: np.ndarray) -> dict[str, int]:
    return {(str(k) if k < FANOUT_BUCKETS else f"{FANOUT_BUCKETS}+"): int(v) for k, v in enumerate(counts)}


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = np.quantile(np.asarray(values), [0.0, 0.1, 0.5, 0.9, 1.0])
    return {"min": qs[0], "p10": qs[1], "median": qs[2], "p90": qs[3], "max": qs[4], "mean": float(np.mean(values))}


def align_report(
    dataset: ScoredDataset, tokenizer, student: str, how: str = "max",
    chunk_counts: Iterable[int] = DEFAULT_CHUNK_COUNTS, limit_docs: int | None = None,
    write_dir: str | os.PathLike | None = None, progress: bool = False,
) -> AlignReport:
    """The report over the first ``limit_docs`` documents (all if None); with ``write_dir`` the
    aligned student tokens are written there as Parquet, one file per source shard."""
    report = AlignReport(dataset=str(dataset.folder), student=student, how=how,
                         chunk_counts=tuple(chunk_counts), limit_docs=limit_docs)
    writer = AlignedWriter(write_dir, _aligned_metadata(dataset, tokenizer, student, how)) if write_dir else None
    total = (dataset.manifest.get("totals") or {}).get("documents")
    if limit_docs is not None:
        total = min(limit_docs, total) if total is not None else limit_docs
    items = iter_aligned(dataset, tokenizer, how, report.chunk_counts, limit_docs)
    if progress:
        items = tqdm(items, total=total, unit="doc", desc="aligning", dynamic_ncols=True)
    try:
        for record, doc in items:
            report.add(record, doc)
            if writer:
                writer.add(record.file, doc)
    finally:
        if writer:
            writer.close()
    return report


# --------------------------------------------------------------------------------------------
# Writing aligned student tokens
# --------------------------------------------------------------------------------------------


def _aligned_metadata(dataset: ScoredDataset, tokenizer, student: str, how: str) -> dict[bytes, bytes]:
    meta = {"student": student, "student_tokenizer_sha256": fingerprint(tokenizer), "aggregation": how,
            "dataset": str(dataset.folder), "teacher_identity": dataset.folders[0].identity}
    return {META_ALIGNED.encode(): json.dumps(meta, sort_keys=True).encode()}


class AlignedWriter:
    """Writes aligned documents to ``<folder>/<source shard name>``, one file per source shard,
    each under a temporary name and renamed when complete."""

    def __init__(self, folder: str | os.PathLike, metadata: dict[bytes, bytes]):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.schema = ALIGNED_SCHEMA.with_metadata(metadata)
        self.current: str | None = None
        self.rows: list[AlignedDocument] = []
        self.written: list[Path] = []

    def add(self, shard_file: str, doc: AlignedDocument) -> None:
        if shard_file != self.current:
            self.flush()
            self.current = shard_file
        self.rows.append(doc)

    def flush(self) -> None:
        if self.current is None:
            return
        final = self.folder / self.current
        tmp = self.folder / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            pq.write_table(aligned_table(self.rows, self.schema), tmp, compression="zstd")
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                tmp.unlink()
        self.written.append(final)
        self.current, self.rows = None, []

    def close(self) -> None:
        self.flush()


def aligned_table(docs: list[AlignedDocument], schema: pa.Schema = ALIGNED_SCHEMA) -> pa.Table:
    columns = [
        pa.array([d.doc_id for d in docs], pa.string()),
        list_array([d.student.ids.astype(np.int32) for d in docs], pa.int32()),
        list_array([d.student.starts.astype(np.int32) for d in docs], pa.int32()),
        list_array([d.student.ends.astype(np.int32) for d in docs], pa.int32()),
        list_array([d.teacher_lo.astype(np.int32) for d in docs], pa.int32()),
        list_array([d.teacher_hi.astype(np.int32) for d in docs], pa.int32()),
        list_array([d.teacher_loss.astype(np.float32) for d in docs], pa.float32()),
        list_array([d.token.mapped.astype(bool) for d in docs], pa.bool_()),
    ]
    return pa.Table.from_arrays(columns, schema=schema)
