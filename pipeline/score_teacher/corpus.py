"""Corpus sources, deterministic shard planning, and reading one shard's documents.

Two ways in, both ending in a list of row ranges over concrete files:

* ``source="files"``: local Parquet or JSONL files by path or glob (sorted by path), e.g. a local
  copy of OpenWebMath's ``data/train-000NN-of-000MM-*.parquet``. Document id: ``<file name>:<row>``.
* ``source="hub"``: ``datasets.load_dataset(hub_id, split=...)`` (downloads once into the HF cache,
  which on a cluster must be on storage every node sees); its Arrow cache files are then read
  directly. Document id: ``<split>:<row of the split>``.

Shards are fixed row ranges of ``rows_per_shard`` rows inside one file, numbered in file order, so
the plan (and every document id) is a pure function of the input and ``rows_per_shard``. Changing
``rows_per_shard`` between relaunches changes the plan; the job refuses to resume then.

Text is decoded per document, so one undecodable row is recorded and skipped, never fatal.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import UserError, check_at_least, check_choice

SOURCES = ("files", "hub")


class CorpusError(UserError, ValueError):
    """A corpus that cannot be read; the message names the file and the problem."""


@dataclass(frozen=True)
class CorpusConfig:
    """Which corpus stage 1 scores and how it is cut into shards (docs/METHOD.md §1.5)."""

    name: str = "corpus"
    source: str = "files"  # files | hub
    files: list[str] = field(default_factory=list)  # paths or globs (source=files)
    hub_id: str | None = None  # source=hub
    hub_config: str | None = None
    split: str = "train"
    revision: str | None = None
    text_column: str = "text"
    rows_per_shard: int = 2000
    limit_docs: int | None = None  # take only the first N documents of the plan

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "source", self.source, SOURCES)
        check_at_least(found, "rows_per_shard", self.rows_per_shard, 1)
        return found


@dataclass(frozen=True)
class SourceFile:
    path: str
    kind: str  # parquet | jsonl | arrow
    rows: int
    label: str  # document ids are f"{label}:{row_offset + row}"
    row_offset: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class ShardSpec:
    index: int
    path: str
    kind: str
    label: str
    start: int  # first row in the file
    stop: int  # one past the last row in the file
    row_offset: int  # added to the row for the document id

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"shard {self.index} ({self.path} rows {self.start}-{self.stop})"


@dataclass
class Document:
    doc_id: str
    text: str | None
    problem: str | None = None  # why the text could not be decoded, if it could not


# ---------------------------------------------------------------------------------------------
# Resolving sources


def resolve_sources(cfg: CorpusConfig) -> list[SourceFile]:
    """The ordered input files with their row counts; raises :class:`CorpusError` naming the file."""
    if cfg.rows_per_shard < 1:
        raise CorpusError(f"rows_per_shard must be >= 1, got {cfg.rows_per_shard}")
    if cfg.source == "files":
        return _local_sources(cfg)
    if cfg.source == "hub":
        return _hub_sources(cfg)
    raise CorpusError(f"unknown corpus source {cfg.source!r}; choose 'files' or 'hub'")


def _local_sources(cfg: CorpusConfig) -> list[SourceFile]:
    if not cfg.files:
        raise CorpusError(f"corpus {cfg.name!r}: source=files needs data.files (a path or glob)")
    paths: list[str] = []
    for pattern in cfg.files:
        expanded = os.path.expanduser(str(pattern))
        matches = sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise CorpusError(f"corpus {cfg.name!r}: no file matches {pattern!r}")
        paths.extend(m for m in matches if m not in paths)
    return [_describe_file(p, cfg.text_column) for p in paths]


def _describe_file(path: str, text_column: str) -> SourceFile:
    name = os.path.basename(path)
    size = os.path.getsize(path)
    if name.endswith(".parquet"):
        try:
            pf = pq.ParquetFile(path)
        except Exception as exc:
            raise CorpusError(f"{path}: not a readable Parquet file ({exc})") from exc
        if text_column not in pf.schema_arrow.names:
            raise CorpusError(f"{path}: no column {text_column!r} (columns: {pf.schema_arrow.names})")
        return SourceFile(path, "parquet", pf.metadata.num_rows, name, bytes=size)
    if name.endswith(".jsonl"):
        with open(path, "rb") as f:
            rows = sum(1 for _ in f)
        return SourceFile(path, "jsonl", rows, name, bytes=size)
    raise CorpusError(f"{path}: unsupported corpus file type; expected .parquet or .jsonl")


def _hub_sources(cfg: CorpusConfig) -> list[SourceFile]:
    if not cfg.hub_id:
        raise CorpusError(f"corpus {cfg.name!r}: source=hub needs data.hub_id")
    import datasets

    data_files = list(cfg.files) or None
    ds = datasets.load_dataset(
        cfg.hub_id, cfg.hub_config, split=cfg.split, revision=cfg.revision, data_files=data_files
    )
    if cfg.text_column not in ds.column_names:
        raise CorpusError(f"{cfg.hub_id}: no column {cfg.text_column!r} (columns: {ds.column_names})")
    sources, offset = [], 0
    for cache_file in ds.cache_files:
        path = cache_file["filename"]
        rows = _open_arrow(path).num_rows
        sources.append(SourceFile(path, "arrow", rows, cfg.split, row_offset=offset, bytes=os.path.getsize(path)))
        offset += rows
    if offset != ds.num_rows:
        raise CorpusError(f"{cfg.hub_id}: cache files hold {offset} rows, the dataset has {ds.num_rows}")
    return sources


def _open_arrow(path: str) -> pa.Table:
    return pa.ipc.open_stream(pa.memory_map(path, "r")).read_all()


# ---------------------------------------------------------------------------------------------
# Planning


def plan_shards(sources: list[SourceFile], rows_per_shard: int, limit_docs: int | None = None) -> list[ShardSpec]:
    shards: list[ShardSpec] = []
    remaining = limit_docs if limit_docs is not None else float("inf")
    for src in sources:
        for start in range(0, src.rows, rows_per_shard):
            if remaining <= 0:
                return shards
            stop = int(min(start + rows_per_shard, src.rows, start + remaining))
            shards.append(ShardSpec(len(shards), src.path, src.kind, src.label, start, stop, src.row_offset))
            remaining -= stop - start
    return shards


def corpus_identity(cfg: CorpusConfig, sources: list[SourceFile], shards: list[ShardSpec]) -> dict:
    """What proves two runs read the same corpus the same way: each file's name (the document ids
    hold it), row count, size and content sha256, and the shard plan; never the files' paths."""
    from pipeline.identity import files_sha256

    digests = files_sha256([s.path for s in sources])
    listing = [[os.path.basename(s.path), s.rows, s.bytes, d] for s, d in zip(sources, digests)]
    return {
        "name": cfg.name,
        "source": cfg.source,
        "hub_id": cfg.hub_id,
        "hub_config": cfg.hub_config,
        "split": cfg.split,
        "revision": cfg.revision,
        "text_column": cfg.text_column,
        "files_sha256": hashlib.sha256(json.dumps(listing).encode()).hexdigest(),
        "n_files": len(sources),
        "rows_per_shard": cfg.rows_per_shard,
        "limit_docs": cfg.limit_docs,
        "n_shards": len(shards),
        "n_docs": sum(s.stop - s.start for s in shards),
    }


def legacy_files_sha256(sources: list[SourceFile]) -> str:
    """``files_sha256`` as identity format 1 computed it (names, row counts, sizes; no content), to
    compare a manifest written before the content digests with this corpus."""
    listing = [[os.path.basename(s.path), s.rows, s.bytes] for s in sources]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Reading


def read_shard(spec: ShardSpec, text_column: str = "text") -> list[Document]:
    """The documents of one shard, in row order; undecodable texts carry a ``problem``."""
    ids = [f"{spec.label}:{spec.row_offset + r}" for r in range(spec.start, spec.stop)]
    if spec.kind == "jsonl":
        return list(_read_jsonl(spec, text_column, ids))
    column = _read_text_column(spec, text_column)
    return [_decode(doc_id, raw) for doc_id, raw in zip(ids, column)]


def _read_text_column(spec: ShardSpec, text_column: str) -> list[bytes | None]:
    try:
        if spec.kind == "parquet":
            table = _read_parquet_rows(spec.path, spec.start, spec.stop, text_column)
        elif spec.kind == "arrow":
            table = _open_arrow(spec.path).select([text_column]).slice(spec.start, spec.stop - spec.start)
        else:
            raise CorpusError(f"{spec.path}: unknown file kind {spec.kind!r}")
        column = table.column(text_column)
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            column = pc.cast(column, pa.large_binary())  # decode per row: one bad row is not fatal
        elif not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
            raise CorpusError(f"{spec.path}: column {text_column!r} has type {column.type}, expected string")
        return column.to_pylist()
    except CorpusError:
        raise
    except Exception as exc:
        raise CorpusError(f"{spec.path}: cannot read rows {spec.start}-{spec.stop} ({exc})") from exc


def _read_parquet_rows(path: str, start: int, stop: int, column: str) -> pa.Table:
    pf = pq.ParquetFile(path)
    groups, first_row, row = [], None, 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row < stop and row + n > start:
            groups.append(g)
            first_row = row if first_row is None else first_row
        row += n
    if not groups:
        return pa.table({column: pa.array([], pa.string())})
    table = pf.read_row_groups(groups, columns=[column])
    return table.slice(start - first_row, stop - start)


def _decode(doc_id: str, raw: bytes | None) -> Document:
    if raw is None:
        return Document(doc_id, None)
    try:
        return Document(doc_id, raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return Document(doc_id, None, problem=f"invalid_utf8: {exc.reason} at byte {exc.start}")


def _read_jsonl(spec: ShardSpec, text_column: str, ids: list[str]) -> Iterator[Document]:
    with open(spec.path, "rb") as f:
        for line_no, line in enumerate(f):
            if line_no < spec.start:
                continue
            if line_no >= spec.stop:
                break
            doc_id = ids[line_no - spec.start]
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield Document(doc_id, None, problem=f"invalid_json: {exc}")
                continue
            if not isinstance(record, dict):
                yield Document(doc_id, None, problem="invalid_json: line is not a JSON object")
                continue
            text = record.get(text_column)
            if text is not None and not isinstance(text, str):
                yield Document(doc_id, None, problem=f"invalid_text: {text_column!r} is {type(text).__name__}")
                continue
            yield Document(doc_id, text)
