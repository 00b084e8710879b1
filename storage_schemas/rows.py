"""The row invariants of the contract, checked in one place (docs/METHOD.md §1.4).

:func:`table_problems` checks a table of rows (a shard's row group, or a whole shard) vectorised
with NumPy over the flat list values, so memory stays one table's columns: ``doc_id`` non-empty,
``text`` present, the four lists of equal length, every span inside the text with starts
non-decreasing, text slices non-empty except for special tokens, token ids inside the vocabulary
when it is known, losses finite or NaN, not negative and at most :data:`MAX_LOSS`
(:func:`impossible_losses`, which every reader of rows applies too). Warnings (legal, worth a look): a NaN loss
past the first token, and the first token's loss disagreeing with whether a BOS preceded it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage_schemas.schema import LIST_COLUMNS

ERROR = "error"
WARNING = "warning"
NEGATIVE_LOSS_TOLERANCE = -1e-4  # -log p >= 0; allow float rounding just below zero
# -log p of a float32 probability stops at ~104 nats (the smallest subnormal), of a float64 one at
# ~745: a stored loss above this is damage (a changed byte, a bad write), never a teacher's.
MAX_LOSS = 1e4


def impossible_losses(losses: np.ndarray) -> np.ndarray:
    """Where ``losses`` cannot be a teacher's ``-log p``: infinite, negative (beyond rounding) or
    above :data:`MAX_LOSS` nats. NaN is a loss the contract allows (nothing predicted the token)."""
    with np.errstate(invalid="ignore"):  # NaN compares false; -inf and inf fall outside the range
        return (losses < NEGATIVE_LOSS_TOLERANCE) | (losses > MAX_LOSS)


def list_array(arrays: Sequence[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    """One list column from per-row NumPy arrays (the inverse of :func:`list_column_values`)."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array(values.astype(value_type.to_pandas_dtype(), copy=False), value_type)
    )


@dataclass(frozen=True)
class RowRules:
    """What the checks need to know of the teacher; ``None`` leaves the rule that needs it out."""

    vocab_size: int | None = None
    bos: bool | None = None  # True: a BOS preceded every document
    special_ids: frozenset[int] | None = None  # ids whose empty text slice is legal

    @classmethod
    def from_identity(cls, identity: dict, special_ids: Iterable[int]) -> "RowRules":
        teacher = identity.get("teacher") or {}
        vocab = teacher.get("vocab_size")
        bos = (teacher["bos_id"] is not None) if "bos_id" in teacher else None
        return cls(vocab_size=vocab if isinstance(vocab, int) else None, bos=bos, special_ids=frozenset(special_ids))


@dataclass(frozen=True)
class RowProblem:
    severity: str  # ERROR | WARNING
    row: int
    doc_id: str | None
    message: str


def list_column_values(table: pa.Table | pa.RecordBatch, column: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` of a list column as NumPy arrays (views where Arrow allows): row ``r``
    holds ``values[offsets[r] : offsets[r + 1]]`` (``values`` is the whole child array, so this
    holds for a sliced column too)."""
    array = table.column(column)
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    return array.values.to_numpy(zero_copy_only=False), array.offsets.to_numpy()


def table_problems(table: pa.Table | pa.RecordBatch, rules: RowRules = RowRules(), first_row: int = 0) -> list[RowProblem]:
    """Every row problem of ``table``, ordered by row; rows are numbered from ``first_row``.
    Memory is a few times the table's list columns: callers pass a record batch of bounded size."""
    n_rows = table.num_rows
    doc_ids = table.column("doc_id").to_pylist()
    text = table.column("text")
    text_null = np.asarray(text.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    text_len = np.asarray(pc.fill_null(pc.utf8_length(text), 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    found: list[tuple[int, int, RowProblem]] = []  # (row, rule order, problem)

    def add(row: int, order: int, severity: str, message: str) -> None:
        found.append((row, order, RowProblem(severity, first_row + row, doc_ids[row], message)))

    for r, doc_id in enumerate(doc_ids):
        if not doc_id:
            add(r, 0, ERROR, "empty or null doc_id")
        if text_null[r]:
            add(r, 1, ERROR, "null text")

    lists = {c: list_column_values(table, c) for c in LIST_COLUMNS}
    lengths = {c: np.diff(offsets) for c, (_, offsets) in lists.items()}
    same = np.all([lengths[c] == lengths["token_ids"] for c in LIST_COLUMNS], axis=0) if n_rows else np.ones(0, bool)
    for r in np.flatnonzero(~same).tolist():
        add(r, 2, ERROR, f"list lengths differ: { {c: int(lengths[c][r]) for c in LIST_COLUMNS} }")

    rows = np.flatnonzero(same & ~text_null)  # rows whose tokens are checked
    counts = lengths["token_ids"][rows]
    total = int(counts.sum())
    row_start = np.cumsum(counts) - counts  # where each checked row begins among the gathered tokens
    pos = np.arange(total) - np.repeat(row_start, counts)  # token position inside its row
    owner = np.repeat(rows, counts)  # row of each gathered token

    def gather(column: str) -> np.ndarray:  # the checked rows' tokens of one list column, in its own dtype
        values, offsets = lists[column]
        return values[np.repeat(offsets[:-1][rows], counts) + pos]

    ids, starts, ends, losses = (gather(c) for c in LIST_COLUMNS)
    limit = np.repeat(text_len[rows], counts)
    first = pos == 0
    later = ~first
    with np.errstate(invalid="ignore"):
        checks: list[tuple[str, str, np.ndarray]] = [
            (ERROR, "span outside the text of length {}", (starts < 0) | (ends > limit)),
            (ERROR, "span ends before it starts", ends < starts),
            (ERROR, "starts decrease", later & (np.r_[False, np.diff(starts) < 0] if total else first)),
            (ERROR, "empty text slice for a non-special token",
             (ends == starts) & ~np.isin(ids, list(rules.special_ids or ())) if rules.special_ids is not None
             else np.zeros(total, bool)),
            (ERROR, "infinite loss (NaN is allowed, inf is not)", np.isinf(losses)),
            (ERROR, "negative loss (-log p cannot be negative)",
             (losses < NEGATIVE_LOSS_TOLERANCE) & np.isfinite(losses)),  # -inf: reported as infinite
            (ERROR, f"loss above {MAX_LOSS:g} nats (no teacher's -log p: a damaged value)",
             (losses > MAX_LOSS) & np.isfinite(losses)),
            (ERROR, "token id outside the teacher vocabulary",
             (ids < 0) | (ids >= (rules.vocab_size or np.iinfo(np.int64).max))),
            (WARNING, "NaN loss past the first token (every later token has left context)", later & np.isnan(losses)),
        ]
    if rules.bos is not None:
        what = ("NaN although a BOS preceded it" if rules.bos
                else "finite although no BOS preceded it (store NaN, never a made-up value)")
        checks.append((WARNING, f"first token's loss {what}", first & (np.isnan(losses) if rules.bos else ~np.isnan(losses))))

    for order, (severity, what, mask) in enumerate(checks, start=3):
        bad = np.flatnonzero(mask)
        if not bad.size:
            continue
        bad_rows, first_bad, per_row = np.unique(owner[bad], return_index=True, return_counts=True)
        for r, i, count in zip(bad_rows.tolist(), first_bad.tolist(), per_row.tolist()):
            k = int(bad[i])
            example = f"token {pos[k]}: id {ids[k]}, span ({starts[k]},{ends[k]}), loss {losses[k]:.4g}"
            more = f" ({count} tokens; first: {example})" if count > 1 else f" ({example})"
            add(r, order, severity, what.format(int(text_len[r])) + more)
    found.sort(key=lambda f: (f[0], f[1]))
    return [p for _, _, p in found]


def check_rows(table: pa.Table, where: str) -> list[str]:
    """The errors of :func:`table_problems` (no teacher knowledge assumed) as lines naming
    ``where``, the row and the document; empty when the table keeps the contract."""
    return [f"{where} row {p.row} doc {p.doc_id!r}: {p.message}" for p in table_problems(table) if p.severity == ERROR]
