"""The exported rows: what each holds, how they are cut from the student-side stream, and their
Parquet schema (docs/export.md states the same table for users).

=================  ==================  ==========================================================
column             type                meaning
=================  ==================  ==========================================================
``sample_index``   int64               the row's number: packed, stage 2's sample ``k``; documents,
                                       the document's position in the stream
``input_ids``      list<int32>         student token ids. Packed: ``stream[kL : kL + L + 1]``,
                                       inputs ``[:-1]``, targets ``[1:]``; consecutive rows share
                                       one token. Documents: ``[BOS] tokens [EOS]`` of one document
``teacher_loss``   list<float32>       the teacher's loss of each token (``L_t``, docs/METHOD.md
                                       §2.1, combined over teachers §2.6), NaN where unmapped
                                       (BOS, EOS, tokens no teacher token overlaps)
``doc_ids``        list<string>        the stage-1 ``doc_id`` of each document the row holds a part of
``doc_starts``     list<int32>         where each of those parts starts in the row (the first at 0)
``doc_offsets``    list<int32>         where each part starts in its document's tokens (BOS at 0):
                                       non-zero for a document continued from the row before
=================  ==================  ==========================================================

With several teachers each teacher's own ``L_t`` follows, ``teacher_loss_t<i>`` (list<float32>), in
the order of the manifest's teachers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

from pipeline.folders.export_folder import teacher_loss_column
from pipeline.student_data.build import StudentData
from pipeline.student_data.dataset import PackedDataset
from storage_schemas.reader import ShardInfo, read_row_group
from storage_schemas.rows import list_array

BASE_SCHEMA = pa.schema([
    pa.field("sample_index", pa.int64(), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32())),
    pa.field("teacher_loss", pa.list_(pa.float32())),
    pa.field("doc_ids", pa.list_(pa.string())),
    pa.field("doc_starts", pa.list_(pa.int32())),
    pa.field("doc_offsets", pa.list_(pa.int32())),
])


def row_schema(n_teachers: int) -> pa.Schema:
    """The export's Parquet schema; several teachers add one ``teacher_loss_t<i>`` column each."""
    extra = [pa.field(teacher_loss_column(t), pa.list_(pa.float32())) for t in range(n_teachers)] if n_teachers > 1 else []
    return pa.schema([*BASE_SCHEMA, *extra])


@dataclass(frozen=True)
class Row:
    """One exported row (module docstring)."""

    index: int
    input_ids: np.ndarray  # (n,) int32
    teacher_loss: np.ndarray  # (n,) float32
    doc_ids: list[str]
    doc_starts: np.ndarray  # (parts,) int32
    doc_offsets: np.ndarray  # (parts,) int32
    teacher_losses: np.ndarray | None = None  # (n, T) several teachers only


class DocIds:
    """The stage-1 ``doc_id`` of each stream document, read per shard on first use (a few shards kept)."""

    def __init__(self, shards: Sequence[ShardInfo], keep: int = 4):
        self.shards = list(shards)
        self.keep = keep
        self._cache: OrderedDict[int, list[str]] = OrderedDict()

    def of(self, shard: int, row: int) -> str:
        if shard not in self._cache:
            groups = range(len(self.shards[shard].row_group_rows))
            self._cache[shard] = [i for g in groups for i in read_row_group(self.shards[shard], g, ["doc_id"])
                                  .column("doc_id").to_pylist()]
            while len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        self._cache.move_to_end(shard)
        return self._cache[shard][row]


class RowSource:
    """The rows of an export, by number: packed windows or whole documents of the student-side stream."""

    def __init__(self, data: StudentData, layout: str):
        self.data = data
        self.layout = layout
        self.dataset: PackedDataset = data.dataset
        self.plan = data.plan
        self.doc_ids = DocIds(data.scored.shards)

    def __len__(self) -> int:
        return self.plan.n_samples if self.layout == "packed" else int(self.plan.doc_row.size)

    def rows(self, indices: Sequence[int]) -> list[Row]:
        """Rows ``indices`` (consecutive numbers read fastest: read-ahead follows them)."""
        if self.layout == "packed":
            return [self._packed(w) for w in self.dataset.windows(list(indices))]
        docs = self.dataset.documents(list(indices))
        return [Row(index=d, input_ids=docs[d].ids.astype(np.int32), teacher_loss=docs[d].teacher_loss,
                    doc_ids=[self._doc_id(d)], doc_starts=np.zeros(1, np.int32), doc_offsets=np.zeros(1, np.int32),
                    teacher_losses=docs[d].teacher_losses) for d in indices]

    def _packed(self, window) -> Row:
        lengths = np.asarray([stop - start for _, start, stop in window.documents], dtype=np.int32)
        return Row(index=window.index, input_ids=window.ids.astype(np.int32), teacher_loss=window.teacher_loss,
                   doc_ids=[self._doc_id(d) for d, _, _ in window.documents],
                   doc_starts=(np.cumsum(lengths) - lengths).astype(np.int32),
                   doc_offsets=np.asarray([start for _, start, _ in window.documents], dtype=np.int32),
                   teacher_losses=window.teacher_losses)

    def _doc_id(self, d: int) -> str:
        return self.doc_ids.of(int(self.plan.doc_shard[d]), int(self.plan.doc_row[d]))


def rows_table(rows: Sequence[Row], schema: pa.Schema) -> pa.Table:
    """The Parquet table of ``rows`` (:func:`row_schema`)."""
    columns = [
        pa.array([r.index for r in rows], pa.int64()),
        list_array([r.input_ids for r in rows], pa.int32()),
        list_array([r.teacher_loss for r in rows], pa.float32()),
        pa.array([r.doc_ids for r in rows], pa.list_(pa.string())),
        list_array([r.doc_starts for r in rows], pa.int32()),
        list_array([r.doc_offsets for r in rows], pa.int32()),
    ]
    n_teachers = len(schema) - len(BASE_SCHEMA)
    columns += [list_array([r.teacher_losses[:, t] for r in rows], pa.float32()) for t in range(n_teachers)]
    return pa.Table.from_arrays(columns, schema=schema)
