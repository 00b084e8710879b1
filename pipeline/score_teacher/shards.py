"""A corpus's shards: the plan, the identity that proves two runs read the same corpus the same
way, and reading one shard's documents.

Shards are fixed row ranges of ``rows_per_shard`` rows inside one file, numbered in file order, so
the plan (and every document id) is a pure function of the input and ``rows_per_shard``. Changing
``rows_per_shard`` between relaunches changes the plan; the job refuses to resume then. With
``limit_docs`` only the files the first ``limit_docs`` rows come from are described and hashed.

Text is decoded per document, so one undecodable row is recorded and skipped, never fatal; a null
or missing text is recorded with its document (docs/RELIABILITY.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.folders.provenance import digest_cache_dir, file_sha256_cached
from pipeline.score_teacher.corpus import (
    HF_SCHEME,
    CorpusConfig,
    CorpusError,
    Document,
    ShardSpec,
    SourceFile,
    is_readable_text,
    is_remote,
    is_text_type,
    one_line,
    open_location,
)
from storage_schemas import write_json_atomic

log = logging.getLogger(__name__)


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
    """What proves two runs read the same corpus the same way: each file's name as the document ids
    hold it (its label: the file name, unless two files share one), row count, size and content
    sha256, and the shard plan; never the files' locations (a local copy, a bucket and a hub mirror
    of the same files have the same identity). A corpus of files records no hub repository, config
    or revision, whatever preset it was named from: it never read one (docs/configuration.md)."""
    digests = source_digests(sources)
    listing = [[s.label, s.rows, s.bytes, d] for s, d in zip(sources, digests)]
    hub = cfg.source == "hub"
    return {
        "name": cfg.name,
        "source": cfg.source,
        "hub_id": cfg.hub_id if hub else None,
        "hub_config": cfg.hub_config if hub else None,
        "split": cfg.split,
        "revision": cfg.revision if hub else None,
        "text_column": cfg.text_column,
        "files_sha256": hashlib.sha256(json.dumps(listing).encode()).hexdigest(),
        "n_files": len(sources),
        "rows_per_shard": cfg.rows_per_shard,
        "limit_docs": cfg.limit_docs,
        "n_shards": len(shards),
        "n_docs": sum(s.stop - s.start for s in shards),
    }


def source_digests(sources: list[SourceFile]) -> list[str]:
    """The content sha256 of each file: as the source records it (the hub), else hashed once and
    cached (local files by their stat, remote objects by URI, size and ETag)."""
    def digest(src: SourceFile) -> str:
        if src.sha256:
            return src.sha256
        if is_remote(src.path):
            return remote_sha256_cached(src.path)

        return file_sha256_cached(src.path)

    if len(sources) <= 1:
        return [digest(s) for s in sources]
    with ThreadPoolExecutor(max_workers=min(4, len(sources))) as pool:
        return list(pool.map(digest, sources))


def remote_sha256_cached(location: str) -> str:
    """The sha256 of a remote object's bytes, streamed once and cached under its URI, size and
    version tag: the ETag (S3; any overwrite gives a new one) or the modification time where the
    store gives no ETag; an ``hf://`` location is pinned to a commit, so its URI and size suffice.
    An object with no such tag is hashed on every call."""

    fs, path = open_location(location)
    try:
        with fs.open_input_file(path) as f:
            size = f.size()
            meta = f.metadata() or {}
    except Exception as exc:
        raise CorpusError(f"{location}: not readable ({one_line(exc)})") from exc
    tag = meta.get("ETag") or meta.get("Last-Modified")
    if tag is None and location.startswith(HF_SCHEME):
        tag = b"pinned"
    key = json.dumps([location, size, tag.decode() if isinstance(tag, bytes) else tag])
    entry = digest_cache_dir() / f"remote-{hashlib.sha256(key.encode()).hexdigest()[:40]}.json"
    if tag is not None:
        try:
            cached = json.loads(entry.read_text())
            if cached.get("key") == key:
                return cached["sha256"]
        except (OSError, ValueError, AttributeError):
            pass  # not cached yet
    h = hashlib.sha256()
    try:
        with fs.open_input_stream(path) as f:
            while block := f.read(1 << 22):
                h.update(block)
    except Exception as exc:
        raise CorpusError(f"{location}: not readable ({one_line(exc)})") from exc
    if tag is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(entry, {"key": key, "sha256": h.hexdigest()})
        except OSError as exc:  # a read-only home: correct, only slower next time
            log.debug("cannot cache the digest of %s: %s", location, exc)
    return h.hexdigest()


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
        if spec.kind != "parquet":
            raise CorpusError(f"{spec.path}: unknown file kind {spec.kind!r}")
        table = _read_parquet_rows(spec.path, spec.start, spec.stop, text_column)
        column = table.column(text_column)
        if is_text_type(column.type):
            column = pc.cast(column, pa.large_binary())  # decode per row: one bad row is not fatal
        elif not is_readable_text(column.type):
            raise CorpusError(f"{spec.path}: column {text_column!r} has type {column.type}, expected string")
        values = column.to_pylist()
    except CorpusError:
        raise
    except Exception as exc:
        raise CorpusError(f"{spec.path}: cannot read rows {spec.start}-{spec.stop} ({one_line(exc)})") from exc
    if len(values) != spec.stop - spec.start:
        raise CorpusError(f"{spec.path}: rows {spec.start}-{spec.stop} planned, {len(values)} found; "
                          "the file changed since the shards were planned")
    return values


def _read_parquet_rows(location: str, start: int, stop: int, column: str) -> pa.Table:
    """Rows ``[start, stop)`` of one column: the footer, then only the row groups that hold them
    (coalesced range reads on object stores)."""
    fs, path = open_location(location)
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f, pre_buffer=True)
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
    for line_no, line in enumerate(_lines(spec.path, spec.stop)):
        if line_no < spec.start:
            continue
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


def _lines(location: str, stop: int) -> Iterator[bytes]:
    """The first ``stop`` lines of a local or remote file, streamed (a remote file from its start)."""
    if not is_remote(location):
        with open(location, "rb") as f:
            for line_no, line in enumerate(f):
                if line_no >= stop:
                    return
                yield line
        return
    fs, path = open_location(location)
    try:
        with fs.open_input_stream(path) as f:
            pending, line_no = b"", 0
            while line_no < stop and (block := f.read(1 << 20)):
                *complete, pending = (pending + block).split(b"\n")
                for line in complete:
                    if line_no >= stop:
                        return
                    yield line + b"\n"
                    line_no += 1
            if pending and line_no < stop:
                yield pending
    except OSError as exc:
        raise CorpusError(f"{location}: cannot read lines up to {stop} ({one_line(exc)})") from exc
