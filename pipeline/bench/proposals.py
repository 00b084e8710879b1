"""Candidate implementations the bench measures against the pipeline's own code.

Nothing in ``pipeline`` uses these. Each one is the smallest change that the bench shows would
reach a missed target, written so that the figure next to it is real, and checked against the
pipeline's result wherever it computes the same thing:

* :func:`fast_align_max`: token-level alignment with max aggregation for the spans every real
  tokenizer produces (non-empty teacher spans, starts and ends non-decreasing): two
  ``searchsorted`` on the int32 offsets as they come, no int64 copies, no overlap re-check (the
  range is exact for such spans, :mod:`pipeline.align` docstring), ``fmax.reduceat`` over the
  non-empty ranges only. Returns ``None`` for any other span set, where the caller keeps
  :func:`pipeline.align.align_document`.
* :func:`align_batch_max`: the same for a batch of documents at once (a few dozen: the arrays stay
  in cache): the documents' spans are shifted onto one line (document ``k`` starts after the text
  of documents ``< k`` plus one gap character), and the two range searches become counts: with
  ``ends_le[x] = #{j : b_j <= x}`` and ``starts_le[x] = #{j : a_j <= x}`` (a ``bincount`` and a
  ``cumsum`` over the characters), ``lo_i = ends_le[c_i]`` and ``hi_i = starts_le[d_i - 1]``:
  O(N + M + L) with no binary search and one NumPy call sequence per batch instead of per document.
* :func:`batched_student_stream`: stage-2 data by row group instead of by document: one
  ``encode_batch`` call per row group, the list columns sliced from one NumPy view per row group,
  the fast alignment, and packing by concatenation.

Two earlier proposals measured here were adopted by the pipeline and removed from this module:
the compact Parquet encodings keyed by leaf path (``pipeline.shards.COMPACT_ENCODINGS``) and the
scorer's fused ``F.cross_entropy`` log-softmax (``pipeline.scoring.hf``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def fast_align_max(s_starts: np.ndarray, s_ends: np.ndarray, t_starts: np.ndarray, t_ends: np.ndarray,
                   t_losses: np.ndarray) -> np.ndarray | None:
    """``L_t`` (float32, NaN where unmapped) with max aggregation, or ``None`` when the teacher spans
    are not the monotone, non-empty kind this fast path is exact for."""
    n = s_starts.shape[0]
    out = np.full(n, np.nan, dtype=np.float32)
    if n == 0 or t_starts.shape[0] == 0:
        return out
    if not ((t_ends > t_starts).all() and (t_starts[1:] >= t_starts[:-1]).all() and (t_ends[1:] >= t_ends[:-1]).all()):
        return None
    lo = np.searchsorted(t_ends, s_starts, side="right")  # first teacher token ending after c_i
    hi = np.searchsorted(t_starts, s_ends, side="left")  # teacher tokens starting before d_i
    length = hi - lo
    length[(length < 0) | (s_ends <= s_starts)] = 0
    nonempty = np.flatnonzero(length)  # (K,)
    if nonempty.size == 0:
        return out
    ln = length[nonempty]
    first = np.cumsum(ln) - ln  # (K,) offset of each range in the pair list
    j = np.arange(int(first[-1] + ln[-1])) - np.repeat(first - lo[nonempty], ln)  # (P,) teacher index
    out[nonempty] = np.fmax.reduceat(t_losses[j], first)  # fmax ignores NaN unless all are NaN
    return out


def align_batch_max(s_starts: Sequence[np.ndarray], s_ends: Sequence[np.ndarray], t_starts: np.ndarray,
                    t_ends: np.ndarray, t_losses: np.ndarray, t_offsets: np.ndarray,
                    text_lengths: Sequence[int]) -> list[np.ndarray] | None:
    """Max-aggregated ``L_t`` for a batch of documents, one float32 array per document, or ``None``
    when the spans are not the monotone, non-empty kind the fast path is exact for.

    ``s_starts``/``s_ends``: the student spans per document (int32 arrays, as
    :func:`pipeline.tokenization.encode_batch` gives them). ``t_starts``/``t_ends``/``t_losses``:
    the teacher's spans and losses of all documents concatenated, ``t_offsets`` (D+1,) where each
    document's begin (exactly the values and offsets of the Parquet list columns of a row group).
    ``text_lengths``: ``len(text)`` per document.
    """
    n_s = np.fromiter((x.shape[0] for x in s_starts), np.int64, len(s_starts))  # (D,)
    n_t = np.diff(np.asarray(t_offsets, dtype=np.int64))  # (D,)
    base = np.zeros(len(n_s) + 1, np.int64)  # (D+1,) where each document's characters begin
    np.cumsum(np.asarray(text_lengths, np.int64) + 1, out=base[1:])
    dtype = np.int32 if base[-1] < 2**31 - 1 else np.int64
    base = base.astype(dtype)
    c = np.concatenate(s_starts).astype(dtype, copy=False) + np.repeat(base[:-1], n_s)  # (N,)
    d = np.concatenate(s_ends).astype(dtype, copy=False) + np.repeat(base[:-1], n_s)  # (N,)
    shift = np.repeat(base[:-1], n_t)  # (M,)
    a = t_starts.astype(dtype, copy=False) + shift
    b = t_ends.astype(dtype, copy=False) + shift
    if not ((b > a).all() and (a[1:] >= a[:-1]).all() and (b[1:] >= b[:-1]).all()):
        return None
    out = np.full(c.shape[0], np.nan, dtype=np.float32)  # (N,)
    if a.size and c.size:
        n_chars = int(base[-1]) + 1
        ends_le = np.bincount(b, minlength=n_chars).cumsum()  # (L,) teacher tokens ending at or before x
        starts_le = np.bincount(a, minlength=n_chars).cumsum()  # (L,) teacher tokens starting at or before x
        lo = ends_le[c]  # first teacher token with b_j > c_i
        hi = starts_le[d - 1]  # teacher tokens with a_j < d_i (d - 1 = -1 only where d <= c, masked)
        length = hi - lo
        length[(length < 0) | (d <= c)] = 0
        nonempty = np.flatnonzero(length)
        if nonempty.size:
            ln = length[nonempty]
            first = np.cumsum(ln) - ln
            j = np.arange(int(first[-1] + ln[-1])) - np.repeat(first - lo[nonempty], ln)
            out[nonempty] = np.fmax.reduceat(t_losses[j], first)
    return np.split(out, np.cumsum(n_s)[:-1]) if len(n_s) else []


def list_column_views(table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` NumPy views of a list column of a single-chunk table."""
    array = table.column(column).combine_chunks()
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False)
    return values, offsets


def batched_student_stream(row_groups: Sequence, tokenizer, seq_len: int, bos_id: int | None, eos_id: int | None,
                           batch_docs: int = 64) -> dict[str, np.ndarray]:
    """Packed ``(input_ids, labels, teacher_loss, mapped)`` arrays, (S, seq_len) each, from decoded
    row groups (``pyarrow.Table`` with text, starts, ends, losses) in order: one ``encode_batch``
    per row group, :func:`align_batch_max` per ``batch_docs`` documents, packing by concatenation.
    Documents without student tokens are left out; each document is ``[BOS] tokens [EOS]``."""
    from pipeline.align import align_document
    from pipeline.tokenization import encode_batch

    head = np.asarray([bos_id] if bos_id is not None else [], dtype=np.int64)
    tail = np.asarray([eos_id] if eos_id is not None else [], dtype=np.int64)
    nan_head, nan_tail = np.full(head.size, np.nan, np.float32), np.full(tail.size, np.nan, np.float32)
    ids_parts, loss_parts = [], []
    for table in row_groups:
        texts = table.column("text").to_pylist()
        encodings = encode_batch(tokenizer, texts)
        starts, offsets = list_column_views(table, "starts")
        ends, _ = list_column_views(table, "ends")
        losses, _ = list_column_views(table, "losses")
        for k0 in range(0, len(encodings), batch_docs):
            batch = encodings[k0 : k0 + batch_docs]
            a, b = offsets[k0], offsets[k0 + len(batch)]
            aligned = align_batch_max([e.starts for e in batch], [e.ends for e in batch], starts[a:b], ends[a:b],
                                      losses[a:b], offsets[k0 : k0 + len(batch) + 1] - a,
                                      [len(t) for t in texts[k0 : k0 + len(batch)]])
            for k, enc in enumerate(batch):
                if len(enc) == 0:
                    continue
                if aligned is None:  # spans the fast path is not exact for: the pipeline's alignment
                    lo, hi = offsets[k0 + k], offsets[k0 + k + 1]
                    l_t = align_document(enc, starts[lo:hi], ends[lo:hi], losses[lo:hi]).teacher_loss
                else:
                    l_t = aligned[k]
                ids_parts += [head, enc.ids, tail]
                loss_parts += [nan_head, l_t, nan_tail]
    ids = np.concatenate(ids_parts).astype(np.int64) if ids_parts else np.zeros(0, np.int64)
    teacher_loss = np.concatenate(loss_parts) if loss_parts else np.zeros(0, np.float32)
    n_samples = max(0, (ids.size - 1) // seq_len)
    usable = n_samples * seq_len
    return {
        "input_ids": ids[:usable].reshape(n_samples, seq_len),
        "labels": ids[1 : usable + 1].reshape(n_samples, seq_len),
        "teacher_loss": teacher_loss[1 : usable + 1].reshape(n_samples, seq_len),
        "mapped": ~np.isnan(teacher_loss[1 : usable + 1]).reshape(n_samples, seq_len),
    }
