"""Candidate implementations the bench measures against the pipeline's own code.

Nothing in ``pipeline`` uses these. Each one is the smallest change that the bench shows would
reach a missed target, written so that the figure next to it is real, and checked against the
pipeline's result wherever it computes the same thing:

* :func:`batched_student_stream`: stage-2 data by row group instead of by document: one
  ``encode_batch`` call per row group, the list columns sliced from one NumPy view per row group,
  :func:`pipeline.align.align_documents` per ``batch_docs`` documents, and packing by
  concatenation.

Earlier proposals measured here were adopted by the pipeline and removed from this module: the
compact Parquet encodings keyed by leaf path (``pipeline.shards.COMPACT_ENCODINGS``), the scorer's
fused ``F.cross_entropy`` log-softmax (``pipeline.scoring.hf``) and the batched alignment with
range counts on a shared character line (:func:`pipeline.align.align_documents`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


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
    per row group, :func:`pipeline.align.align_documents` per ``batch_docs`` documents, packing by concatenation.
    Documents without student tokens are left out; each document is ``[BOS] tokens [EOS]``."""
    from pipeline.align import align_documents
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
            spans = [tuple(x[offsets[k] : offsets[k + 1]] for x in (starts, ends, losses))
                     for k in range(k0, k0 + len(batch))]
            for enc, doc in zip(batch, align_documents(batch, spans)):
                if len(enc) == 0:
                    continue
                ids_parts += [head, enc.ids, tail]
                loss_parts += [nan_head, doc.teacher_loss, nan_tail]
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
