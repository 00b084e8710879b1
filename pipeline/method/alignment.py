"""Token-level lexical alignment between a student and a teacher tokenization (docs/METHOD.md §2.1).

Student token ``i`` (span ``[c_i, d_i)``) maps to the teacher tokens whose spans overlap it,
``A(i) = {j : a_j < d_i and b_j > c_i}``; empty spans never match. Pure numpy, vectorised over a
document, O(N log M); nothing reads files.

The range search (:func:`align_spans`) finds ``A(i)`` as ``[lo_i, hi_i)`` with two searches. That
range is exact when the teacher ends never decrease (true of all four real tokenizers, tested in
``tests/train_student/test_align_real_tokenizers.py``); for arbitrary spans the search runs on the running
maximum of the ends, the range is a hull, and :func:`overlap_pairs` removes the teacher tokens that
do not overlap, so :func:`align_document` is exact for any span set. :func:`align_documents` (what
stage 2 calls) puts a batch of documents on one character line and, for monotone teacher spans,
counts instead of searching; its result is :func:`align_document`'s bit for bit. The chunk-level
and one-to-one alignments of the ablations (§2.3) are here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

AGGREGATIONS = ("max", "mean", "min")
LINE_DOCUMENTS = 64  # documents per shared line in align_documents (chosen with ``make bench``)


# --------------------------------------------------------------------------------------------
# Span search
# --------------------------------------------------------------------------------------------


def _as_int(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


def align_spans(s_starts, s_ends, t_starts, t_ends) -> tuple[np.ndarray, np.ndarray]:
    """For every student token the teacher range ``[lo_i, hi_i)`` around ``A(i)``.

    Returns two int64 arrays of shape (N,). ``lo_i == hi_i`` when the student span is empty or no
    non-empty teacher span overlaps it. ``lo_i`` is the first overlapping teacher token and
    ``hi_i - 1`` the last non-empty teacher token starting before ``d_i``; see the module docstring
    for when the range equals ``A(i)`` exactly. Teacher tokens with empty spans are ignored
    wherever they occur (they may even break the order of starts); non-empty teacher spans must
    have non-decreasing starts (``ValueError`` otherwise).
    """
    c, d = _as_int(s_starts), _as_int(s_ends)  # (N,)
    a, b = _as_int(t_starts), _as_int(t_ends)  # (M,)
    if c.shape != d.shape or a.shape != b.shape:
        raise ValueError("starts and ends must have the same length")

    keep = np.flatnonzero(b > a)  # (K,) teacher tokens that can match, original indices
    a_k, b_k = a[keep], b[keep]
    if np.any(np.diff(a_k) < 0):
        raise ValueError("teacher spans must be sorted by start")
    run_max_end = np.maximum.accumulate(b_k) if keep.size else b_k  # (K,)

    lo_k = np.searchsorted(run_max_end, c, side="right")  # first k with b_k > c_i
    hi_k = np.searchsorted(a_k, d, side="left")  # number of k with a_k < d_i
    empty = (d <= c) | (hi_k <= lo_k)  # (N,)

    # Back to original teacher indices; empty ranges sit at the insertion point.
    keep_ext = np.append(keep, a.size)  # (K+1,) so that index K maps to M
    lo = keep_ext[lo_k]
    hi = np.where(empty, lo, keep_ext[np.maximum(hi_k - 1, 0)] + 1)
    return lo, hi


def _expand_ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All pairs ``(i, j)`` with ``lo_i <= j < hi_i``, grouped by ``i`` in increasing order."""
    lengths = np.maximum(hi - lo, 0)  # (N,)
    owner = np.repeat(np.arange(lo.size), lengths)  # (P,)
    first_of_owner = np.cumsum(lengths) - lengths  # (N,) offset of each group in the pair list
    j = lo[owner] + (np.arange(owner.size) - first_of_owner[owner])  # (P,)
    return owner, j


def overlap_pairs(s_starts, s_ends, t_starts, t_ends, lo=None, hi=None):
    """The exact mapping as pairs: ``(owner, j)`` int64 arrays, one entry per ``j in A(owner)``.

    Pairs are grouped by student token in increasing order. ``lo``/``hi`` from :func:`align_spans`
    may be passed to avoid a second search. Exact for any span set, including non-monotonic ends.
    """
    c, d = _as_int(s_starts), _as_int(s_ends)
    a, b = _as_int(t_starts), _as_int(t_ends)
    if lo is None or hi is None:
        lo, hi = align_spans(c, d, a, b)
    owner, j = _expand_ranges(_as_int(lo), _as_int(hi))
    overlaps = (a[j] < d[owner]) & (b[j] > c[owner]) & (b[j] > a[j])  # (P,)
    return owner[overlaps], j[overlaps]


# --------------------------------------------------------------------------------------------
# Aggregation of teacher losses
# --------------------------------------------------------------------------------------------


def _grouped_reduce(owner: np.ndarray, values: np.ndarray, n: int, how: str) -> np.ndarray:
    """Reduce ``values`` per group ``owner`` (sorted), ignoring NaN; NaN for empty/all-NaN groups."""
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {how!r}")
    out = np.full(n, np.nan, dtype=np.float64)  # (N,)
    if owner.size == 0:
        return out.astype(np.float32)
    values = values.astype(np.float64)  # (P,)
    if how == "mean":
        finite_count = np.bincount(owner, weights=~np.isnan(values), minlength=n)
        total = np.bincount(owner, weights=np.where(np.isnan(values), 0.0, values), minlength=n)
        with np.errstate(invalid="ignore", divide="ignore"):
            out = np.where(finite_count > 0, total / np.maximum(finite_count, 1), np.nan)
    else:
        group_starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])  # (G,)
        # fmax/fmin ignore NaN unless every value of the group is NaN.
        reducer = np.fmax if how == "max" else np.fmin
        out[owner[group_starts]] = reducer.reduceat(values, group_starts)
    return out.astype(np.float32)


def aggregate_teacher_losses(lo, hi, t_losses, how: str = "max") -> np.ndarray:
    """``agg{ t_losses[j] : lo_i <= j < hi_i }`` per student token, float32 of shape (N,).

    NaN losses are ignored; the result is NaN where the range is empty or all its losses are NaN.
    ``how`` is one of ``"max"`` (default), ``"mean"``, ``"min"``.
    """
    lo, hi = _as_int(lo), _as_int(hi)
    owner, j = _expand_ranges(lo, hi)
    losses = np.asarray(t_losses, dtype=np.float64).reshape(-1)
    return _grouped_reduce(owner, losses[j], lo.size, how)


# --------------------------------------------------------------------------------------------
# Chunk-level alignment (ablation)
# --------------------------------------------------------------------------------------------


def chunk_ids(starts, n_chunks: int, text_len: int) -> np.ndarray:
    """Chunk index of each position: ``floor(start * C / L)``, clipped to ``[0, C-1]``.

    Chunk ``k`` is the character range ``[ceil(k L / C), ceil((k+1) L / C))`` of the text
    ``[0, L)``: C ranges of (nearly) equal length, the same for both tokenizations.
    """
    starts = _as_int(starts)
    if text_len <= 0:
        return np.zeros(starts.shape, dtype=np.int64)
    return np.clip(starts * n_chunks // text_len, 0, n_chunks - 1)


def chunk_align(
    s_starts, s_ends, t_starts, t_ends, t_losses, n_chunks: int, text_len: int | None = None
) -> np.ndarray:
    """Chunk-level alignment of the ablation (docs/METHOD.md §2.3), float32 of shape (N,).

    The text ``[0, L)`` is cut into ``n_chunks`` equal character ranges (:func:`chunk_ids`); each
    token belongs to the chunk containing its start. Every student token gets the NaN-ignoring
    mean of the teacher losses of its chunk; NaN for empty student spans and for chunks with no
    finite teacher loss. Teacher tokens with empty spans are left out. ``L`` defaults to the
    largest end of either tokenization.
    """
    if n_chunks < 1:
        raise ValueError(f"n_chunks must be >= 1, got {n_chunks}")
    c, d = _as_int(s_starts), _as_int(s_ends)
    a, b = _as_int(t_starts), _as_int(t_ends)
    losses = np.asarray(t_losses, dtype=np.float64).reshape(-1)
    if text_len is None:
        text_len = int(max(d.max(initial=0), b.max(initial=0)))

    t_valid = (b > a) & ~np.isnan(losses)  # (M,)
    t_chunk = chunk_ids(a[t_valid], n_chunks, text_len)
    count = np.bincount(t_chunk, minlength=n_chunks)  # (C,)
    total = np.bincount(t_chunk, weights=losses[t_valid], minlength=n_chunks)  # (C,)
    with np.errstate(invalid="ignore", divide="ignore"):
        chunk_mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)  # (C,)

    out = chunk_mean[chunk_ids(c, n_chunks, text_len)]  # (N,)
    return np.where(d > c, out, np.nan).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Alignment quality
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlignmentQuality:
    """IoS and IoU of an alignment (docs/METHOD.md §2.1).

    ``ios``: (N,) float64, per student token the share of its characters covered by its mapped
    teacher tokens; NaN for tokens not counted as mapped. ``ios_mean``: mean over mapped tokens.
    ``iou``: |S ∩ T| / |S ∪ T| of the characters covered by mapped student tokens (S) and by the
    teacher tokens they map to (T). NaN when nothing is mapped.
    """

    ios: np.ndarray
    ios_mean: float
    iou: float
    n_mapped: int


def _coverage(starts: np.ndarray, ends: np.ndarray, length: int) -> np.ndarray:
    """Boolean (length,) mask of the characters covered by at least one span."""
    delta = np.zeros(length + 1, dtype=np.int64)
    np.add.at(delta, starts, 1)
    np.add.at(delta, ends, -1)
    return np.cumsum(delta[:-1]) > 0


def alignment_quality(s_starts, s_ends, t_starts, t_ends, mapped=None) -> AlignmentQuality:
    """IoS per token and IoU of the character sets for the span alignment.

    A student token counts as mapped when ``A(i)`` is non-empty, and additionally ``mapped[i]``
    when a mask (e.g. from :func:`align_document`, which also needs a finite loss) is given. Any
    teacher token covering a character of student token ``i`` overlaps it, so the characters of
    ``i`` covered by ``A(i)`` are those covered by any teacher token: IoS comes from one prefix sum.
    """
    c, d = _as_int(s_starts), _as_int(s_ends)
    a, b = _as_int(t_starts), _as_int(t_ends)
    owner, j = overlap_pairs(c, d, a, b)
    is_mapped = np.zeros(c.size, dtype=bool)
    is_mapped[owner] = True
    if mapped is not None:
        is_mapped &= np.asarray(mapped, dtype=bool).reshape(-1)

    length = int(max(d.max(initial=0), b.max(initial=0)))
    t_cover = _coverage(a[b > a], b[b > a], length)  # (L,)
    covered_before = np.r_[0, np.cumsum(t_cover)]  # (L+1,)
    with np.errstate(invalid="ignore", divide="ignore"):
        ios_all = (covered_before[d] - covered_before[c]) / (d - c)
    ios = np.where(is_mapped, ios_all, np.nan)  # (N,)

    t_used = np.unique(j[is_mapped[owner]])  # teacher tokens mapped to by a counted student token
    s_set = _coverage(c[is_mapped], d[is_mapped], length)
    t_set = _coverage(a[t_used], b[t_used], length)
    union = int(np.count_nonzero(s_set | t_set))
    iou = np.count_nonzero(s_set & t_set) / union if union else float("nan")
    n_mapped = int(is_mapped.sum())
    ios_mean = float(np.mean(ios[is_mapped])) if n_mapped else float("nan")
    return AlignmentQuality(ios=ios, ios_mean=ios_mean, iou=float(iou), n_mapped=n_mapped)


# --------------------------------------------------------------------------------------------
# One document
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DocumentAlignment:
    """Per student token: the aggregated teacher loss ``L_t`` (float32, NaN if unmapped) and the
    mapped flag (non-empty span and at least one non-NaN teacher loss in ``A(i)``)."""

    teacher_loss: np.ndarray  # (N,) float32
    mapped: np.ndarray  # (N,) bool

    def __len__(self) -> int:
        return int(self.teacher_loss.shape[0])


def identical_spans(s_starts, s_ends, t_starts, t_ends) -> bool:
    """True when both tokenizations cut the text into exactly the same spans, token by token."""
    return (
        np.array_equal(_as_int(s_starts), _as_int(t_starts))
        and np.array_equal(_as_int(s_ends), _as_int(t_ends))
    )


def align_document(
    student_encoding,
    teacher_starts,
    teacher_ends,
    teacher_losses,
    how: str = "max",
    *,
    one_to_one: bool = False,
    n_chunks: int | None = None,
    text_len: int | None = None,
) -> DocumentAlignment:
    """Teacher loss per student token for one document.

    ``student_encoding`` is anything with ``starts`` and ``ends`` arrays (an
    :class:`pipeline.method.tokenization.Encoding`). Token-level alignment (default) aggregates the losses
    of ``A(i)`` with ``how`` (exact for any span set, via :func:`overlap_pairs`).

    ``one_to_one=True`` is same-vocabulary Rho-1: teacher and student share the tokenizer, so
    student token ``i`` gets teacher token ``i``'s loss (``ValueError`` if the spans are not
    identical token by token; all unmapped where the teacher stored no token, as stage 1 stores
    whitespace-only texts). Span overlap alone is one-to-one only where spans are not shared:
    byte-fallback pieces of one character share its span (``<0xF0><0x9F><0x99><0x82>`` all
    ``(12, 13)``), and so do Llama's virtual ``▁`` and a following CJK character (``(0, 1)``
    twice), so each such piece would overlap all of them. The flag is explicit rather than
    detected per document so that the same token never switches between the two rules.

    ``n_chunks`` selects the chunk-level ablation (:func:`chunk_align`, always a mean) instead;
    ``how`` is then ignored.
    """
    s_starts, s_ends = student_encoding.starts, student_encoding.ends
    losses = np.asarray(teacher_losses, dtype=np.float64).reshape(-1)
    if losses.size != np.asarray(teacher_starts).size:
        raise ValueError(
            f"{losses.size} teacher losses for {np.asarray(teacher_starts).size} teacher tokens"
        )
    if one_to_one and losses.size == 0:  # stored with zero tokens (whitespace only): nothing to map to
        l_t = np.full(len(s_starts), np.nan, dtype=np.float32)
    elif one_to_one:
        if not identical_spans(s_starts, s_ends, teacher_starts, teacher_ends):
            raise ValueError("one_to_one alignment needs identical student and teacher spans")
        non_empty = np.asarray(s_ends) > np.asarray(s_starts)
        l_t = np.where(non_empty, losses, np.nan).astype(np.float32)
    elif n_chunks is not None:
        l_t = chunk_align(s_starts, s_ends, teacher_starts, teacher_ends, losses, n_chunks, text_len)
    else:
        owner, j = overlap_pairs(s_starts, s_ends, teacher_starts, teacher_ends)
        l_t = _grouped_reduce(owner, losses[j], len(s_starts), how)
    return DocumentAlignment(teacher_loss=l_t, mapped=~np.isnan(l_t))


def align_documents(
    student_encodings,
    teacher_spans,
    how: str = "max",
    *,
    one_to_one: bool = False,
    n_chunks: int | None = None,
    text_lens: Sequence[int] | None = None,
) -> list[DocumentAlignment]:
    """:func:`align_document` for many documents at once: the same result, token for token and bit
    for bit, at a fraction of the cost (measured by ``make bench``).

    ``teacher_spans`` holds one ``(starts, ends, losses)`` per document; ``text_lens`` (the length
    of each text) is only read by the chunk ablation. ``one_to_one`` and ``n_chunks`` go to
    :func:`align_document` one document at a time (cheap already). Token-level alignment puts the
    batch on one character line (:class:`_SharedLine`) and takes the fast path
    (:func:`_align_monotone`) for every document whose teacher starts and ends are non-decreasing,
    as every real tokenizer's are, and the general, exact path (:func:`_align_general`) for any
    other document.
    """
    if len(student_encodings) != len(teacher_spans):
        raise ValueError(f"{len(student_encodings)} student documents for {len(teacher_spans)} teacher documents")
    if one_to_one or n_chunks is not None:
        lens = list(text_lens) if text_lens is not None else [None] * len(student_encodings)
        return [align_document(e, *t, how, one_to_one=one_to_one, n_chunks=n_chunks, text_len=n)
                for e, t, n in zip(student_encodings, teacher_spans, lens)]
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {how!r}")
    for k, (starts, _, losses) in enumerate(teacher_spans):
        if len(losses) != len(starts):
            raise ValueError(f"document {k}: {len(losses)} teacher losses for {len(starts)} teacher tokens")
    if len(student_encodings) > LINE_DOCUMENTS:  # in groups whose arrays stay in the CPU cache
        return [aligned for k in range(0, len(student_encodings), LINE_DOCUMENTS)
                for aligned in align_documents(student_encodings[k : k + LINE_DOCUMENTS],
                                               teacher_spans[k : k + LINE_DOCUMENTS], how)]
    if not student_encodings:
        return []
    line = _SharedLine.of(student_encodings, teacher_spans)
    if line is None:  # negative offsets: no shared line; each document on its own
        return [align_document(e, *t, how) for e, t in zip(student_encodings, teacher_spans)]
    bad = line.non_monotone_documents()
    if bad.size == 0:
        l_t = _align_monotone(line, how)
    elif bad.size == line.n_student.size:
        l_t = _align_general(line, how)
    else:  # a few odd documents must not slow the rest down
        out: list[DocumentAlignment | None] = [None] * len(student_encodings)
        good = np.setdiff1d(np.arange(len(student_encodings)), bad)
        for keys in (good, bad):
            part = align_documents([student_encodings[k] for k in keys], [teacher_spans[k] for k in keys], how)
            for k, aligned in zip(keys.tolist(), part):
                out[k] = aligned
        return out
    mapped = ~np.isnan(l_t)
    bounds = np.r_[0, np.cumsum(line.n_student)].tolist()
    return [DocumentAlignment(teacher_loss=l_t[i:k], mapped=mapped[i:k]) for i, k in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True)
class _SharedLine:
    """The spans of a batch of documents shifted onto one character line: document ``k`` starts
    one character after the largest offset of document ``k - 1``, so spans of different documents
    never overlap and their order is kept. Offsets are int32 while the line fits (it does unless a
    batch holds 2**31 characters); losses stay float32 when they come as float32 (as stage 1 stores
    them), else float64."""

    c: np.ndarray  # (N,) student starts
    d: np.ndarray  # (N,) student ends
    a: np.ndarray  # (M,) teacher starts
    b: np.ndarray  # (M,) teacher ends
    losses: np.ndarray  # (M,)
    n_student: np.ndarray  # (D,) tokens per document
    n_teacher: np.ndarray  # (D,)
    length: int  # characters of the line, every offset is below it

    @classmethod
    def of(cls, student_encodings, teacher_spans) -> "_SharedLine | None":
        """The line of a batch (1-D offsets, and as many losses as teacher offsets, per document),
        or ``None`` where an offset is negative (no tokenizer gives one)."""
        n_student = np.fromiter((len(e.starts) for e in student_encodings), np.int64, len(student_encodings))  # (D,)
        n_teacher = np.fromiter((len(t[0]) for t in teacher_spans), np.int64, len(teacher_spans))
        c = np.concatenate([e.starts for e in student_encodings])  # (N,)
        d = np.concatenate([e.ends for e in student_encodings])
        a, b, losses = (np.concatenate([t[i] for t in teacher_spans]) for i in (0, 1, 2))  # (M,)
        if losses.dtype != np.float32:
            losses = losses.astype(np.float64)
        if any(x.size and x.min() < 0 for x in (c, d, a, b)):
            return None
        extent = np.maximum(np.maximum(_segment_max(c, n_student), _segment_max(d, n_student)),
                            np.maximum(_segment_max(a, n_teacher), _segment_max(b, n_teacher)))  # (D,)
        base = np.zeros(extent.size + 1, dtype=np.int64)  # (D+1,) where each document's characters begin
        np.cumsum(extent + 1, out=base[1:])
        dtype = np.int32 if base[-1] < 2**31 - 1 else np.int64
        shift_s = np.repeat(base[:-1].astype(dtype), n_student)  # (N,)
        shift_t = np.repeat(base[:-1].astype(dtype), n_teacher)  # (M,)
        return cls(c=c.astype(dtype, copy=False) + shift_s, d=d.astype(dtype, copy=False) + shift_s,
                   a=a.astype(dtype, copy=False) + shift_t, b=b.astype(dtype, copy=False) + shift_t,
                   losses=losses, n_student=n_student, n_teacher=n_teacher, length=int(base[-1]))

    def non_monotone_documents(self) -> np.ndarray:
        """Indices of the documents whose teacher starts or ends go back somewhere. Across document
        boundaries the line only goes forward, so every step back lies inside one document."""
        back = np.flatnonzero((self.a[1:] < self.a[:-1]) | (self.b[1:] < self.b[:-1]))  # (V,)
        if back.size == 0:
            return back
        return np.unique(np.searchsorted(np.cumsum(self.n_teacher), back + 1, side="right"))


def _segment_max(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The largest value of each consecutive segment of ``counts[k]`` values; 0 for empty ones."""
    out = np.zeros(counts.size, dtype=np.int64)  # (D,)
    nonempty = counts > 0
    if values.size:
        out[nonempty] = np.maximum.reduceat(values, (np.cumsum(counts) - counts)[nonempty])
    return out


def _align_monotone(line: _SharedLine, how: str) -> np.ndarray:
    """``L_t`` (float32, (N,)) for teacher spans with non-decreasing starts and ends.

    Then ``{j : b_j > c_i}`` is a suffix and ``{j : a_j < d_i}`` a prefix, so ``A(i)`` is exactly
    the range ``[lo_i, hi_i)`` up to teacher tokens with empty (or inverted) spans, whose losses
    are made NaN so that they count for nothing. The two range ends are counts on the line instead
    of binary searches: ``lo_i = #{j : b_j <= c_i}`` and ``hi_i = #{j : a_j <= d_i - 1}``, from one
    ``bincount`` + ``cumsum`` each, O(N + M + L). Max and min reduce the losses in their own dtype
    (for float32 losses the float64 reduction of :func:`_grouped_reduce` picks the same value:
    widening is exact, and for float64 losses nothing changes); the mean goes through
    :func:`_grouped_reduce` itself, whose float64 sums then add the same values in the same order
    (the NaN-ed empty spans add zeros and count for nothing), so every aggregation is bit for bit
    :func:`align_document`'s.
    """
    c, d, a, b = line.c, line.d, line.a, line.b
    n = c.size
    out = np.full(n, np.nan, dtype=np.float32)  # (N,)
    if n == 0 or a.size == 0:
        return out
    ends_le = np.bincount(b, minlength=line.length)  # (L,) teacher tokens ending at x ...
    np.cumsum(ends_le, out=ends_le)  # ... and then at or before x (in place: L can be a long text)
    starts_le = np.bincount(a, minlength=line.length)  # (L,) teacher tokens starting at or before x
    np.cumsum(starts_le, out=starts_le)
    lo = ends_le.take(c)  # (N,) first teacher token with b_j > c_i
    hi = starts_le.take(d - 1)  # (N,) teacher tokens with a_j < d_i (d - 1 = -1 only where d <= c, masked next)
    length = hi - lo  # negative only around an inverted teacher span
    length[d <= c] = 0
    nonempty = np.flatnonzero(length > 0)  # (K,) student tokens with a non-empty range
    if nonempty.size == 0:
        return out
    ln, lo_k = length.take(nonempty), lo.take(nonempty)  # (K,)
    ends = np.cumsum(ln)
    first = ends - ln  # (K,) where each range begins in the pair list
    step = np.ones(int(ends[-1]), dtype=np.int64)  # (P,) teacher index j, as differences
    step[0] = lo_k[0]
    step[first[1:]] = lo_k[1:] - (lo_k[:-1] + ln[:-1]) + 1  # jump from the end of one range to the next
    j = np.cumsum(step)  # (P,) the ranges laid end to end
    losses = line.losses if (b > a).all() else np.where(b > a, line.losses, np.nan).astype(line.losses.dtype)
    values = losses.take(j)  # (P,)
    if how == "mean":
        return _grouped_reduce(np.repeat(nonempty, ln), values, n, how)
    reducer = np.fmax if how == "max" else np.fmin  # NaN ignored unless the whole range is NaN
    out[nonempty] = reducer.reduceat(values, first)
    return out


def _align_general(line: _SharedLine, how: str) -> np.ndarray:
    """``L_t`` (float32, (N,)) for any span set: the range search of :func:`align_spans` and the
    exact overlap filter of :func:`overlap_pairs`, once for the whole line."""
    owner, j = overlap_pairs(line.c, line.d, line.a, line.b)
    return _grouped_reduce(owner, line.losses[j], line.c.size, how)
