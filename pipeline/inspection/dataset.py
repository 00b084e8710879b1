"""Opening a scored dataset and reading it without ever loading it whole.

Two ways in, both bounded in memory whatever the dataset's size:

* :meth:`ScoredDataset.scan`: one ``polars.LazyFrame`` over every shard the manifest lists
  (``pl.scan_parquet``); queries run with the streaming engine (:data:`ENGINE`), so only the
  columns a query names are read and nothing is materialised but its result;
* :meth:`ScoredDataset.iter_documents`: documents one by one as numpy arrays, read shard by shard
  in record batches (``pyarrow.ParquetFile.iter_batches``), for per-document work such as alignment.

Only shards listed in ``manifest.json`` are read (a shard without a completion marker is
unfinished and never listed); :mod:`pipeline.inspection.validate` checks the folder itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.score_teacher.teacher import ScoredDocument
from storage_schemas import read_manifest

ENGINE = "streaming"  # polars' streaming engine: bounded memory for scans, explodes and group-bys
INSPECT_DIR = "inspect"  # default output folder inside the dataset folder

POLARS_SCHEMA = pl.Schema(
    {
        "doc_id": pl.String,
        "text": pl.String,
        "token_ids": pl.List(pl.Int32),
        "starts": pl.List(pl.Int32),
        "ends": pl.List(pl.Int32),
        "losses": pl.List(pl.Float32),
    }
)


class DocumentNotFoundError(ValueError):
    """No document with the requested id among the shards the manifest lists."""


@dataclass
class DocumentRecord(ScoredDocument):
    """One stored document (teacher token ids, spans and losses as numpy arrays) and where it is."""

    file: str = ""  # shard file name
    row: int = -1  # row inside that shard

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class ScoredDataset:
    """A scored dataset folder and its manifest (read once, when opened)."""

    folder: Path
    manifest: dict

    @classmethod
    def open(cls, folder: str | os.PathLike) -> "ScoredDataset":
        folder = Path(folder)
        return cls(folder=folder, manifest=read_manifest(folder))

    @property
    def entries(self) -> list[dict]:
        return list(self.manifest.get("shards", []))

    @property
    def shard_paths(self) -> list[Path]:
        return [self.folder / e["file"] for e in self.entries]

    @property
    def identity(self) -> dict:
        return self.manifest.get("identity") or {}

    @property
    def teacher(self) -> dict:
        return self.identity.get("teacher") or {}

    @property
    def teacher_tokenizer(self) -> str | None:
        return teacher_tokenizer_location(self.manifest)

    @property
    def teacher_model(self) -> str:
        """Where the teacher was (a path or hub id), for titles."""
        location = self.manifest.get("location") or {}
        return str(location.get("teacher_model") or self.teacher.get("model"))

    @property
    def name(self) -> str:
        """``<corpus>/<teacher>`` from the identity, for titles."""
        corpus = (self.identity.get("corpus") or {}).get("name", "?")
        return f"{corpus}/{self.teacher.get('name', '?')}"

    def scan(self, with_file: bool = False) -> pl.LazyFrame:
        """All listed shards as one lazy frame; ``with_file`` adds a ``file`` column (shard name)."""
        paths = [str(p) for p in self.shard_paths]
        if not paths:
            frame = pl.LazyFrame(schema=POLARS_SCHEMA)
            return frame.with_columns(file=pl.lit(None, pl.String)) if with_file else frame
        frame = pl.scan_parquet(paths, include_file_paths="file" if with_file else None)
        if with_file:
            frame = frame.with_columns(pl.col("file").str.replace(r"^.*[/\\]", ""))
        return frame

    def find_document(self, doc_id: str | None = None, min_tokens: int = 1) -> DocumentRecord:
        """The document ``doc_id``, or (``None``) the first one with at least ``min_tokens`` tokens.

        Shards are searched in order; Parquet statistics let the reader skip row groups that
        cannot hold the id. :class:`DocumentNotFoundError` if there is no such document.
        """
        for path in self.shard_paths:
            frame = pl.scan_parquet(str(path)).with_row_index("row")
            if doc_id is None:
                frame = frame.filter(pl.col("token_ids").list.len() >= min_tokens)
            else:
                frame = frame.filter(pl.col("doc_id") == doc_id)
            found = frame.head(1).collect()
            if found.height:
                return _record_from_row(found.row(0, named=True), path.name)
        wanted = f"document {doc_id!r}" if doc_id is not None else f"a document with >= {min_tokens} tokens"
        raise DocumentNotFoundError(f"{self.folder}: no {wanted} in the shards listed by the manifest")

    def iter_documents(self, limit: int | None = None, batch_rows: int = 256) -> Iterator[DocumentRecord]:
        """Documents in dataset order, at most ``limit``; memory is one record batch at a time."""
        seen = 0
        for path in self.shard_paths:
            row = 0
            with pq.ParquetFile(path) as reader:
                for batch in reader.iter_batches(batch_size=batch_rows):
                    for record in _records_from_batch(batch, path.name, row):
                        if limit is not None and seen >= limit:
                            return
                        seen += 1
                        yield record
                    row += batch.num_rows


def default_out_dir(folder: str | os.PathLike) -> Path:
    """Where inspection outputs go unless told otherwise: ``<dataset>/inspect``."""
    return Path(folder) / INSPECT_DIR


def _record_from_row(row: dict, file: str) -> DocumentRecord:
    return DocumentRecord(
        doc_id=row["doc_id"],
        text=row["text"],
        ids=np.asarray(row["token_ids"], dtype=np.int32),
        starts=np.asarray(row["starts"], dtype=np.int32),
        ends=np.asarray(row["ends"], dtype=np.int32),
        losses=np.asarray(row["losses"], dtype=np.float32),
        file=file,
        row=int(row["row"]),
    )


def _split_list_column(column: pa.ListArray, dtype) -> list[np.ndarray]:
    """A list column as one numpy array per row (views into one flat buffer)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = column.offsets.to_numpy()  # (rows+1,)
    values = column.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return [values[offsets[r] : offsets[r + 1]] for r in range(len(column))]


def _records_from_batch(batch: pa.RecordBatch, file: str, first_row: int) -> Iterator[DocumentRecord]:
    doc_ids = batch.column("doc_id").to_pylist()
    texts = batch.column("text").to_pylist()
    ids = _split_list_column(batch.column("token_ids"), np.int32)
    starts = _split_list_column(batch.column("starts"), np.int32)
    ends = _split_list_column(batch.column("ends"), np.int32)
    losses = _split_list_column(batch.column("losses"), np.float32)
    for r in range(batch.num_rows):
        yield DocumentRecord(doc_ids[r], texts[r], ids[r], starts[r], ends[r], losses[r], file, first_row + r)


def teacher_tokenizer_location(manifest: dict) -> str | None:
    """Where the scoring job found the teacher's tokenizer (a path or hub id): the manifest's
    ``location``, or, for a manifest of identity format 1, the path its identity recorded."""
    location = (manifest.get("location") or {}).get("teacher_tokenizer")
    return location or ((manifest.get("identity") or {}).get("teacher") or {}).get("tokenizer")
