"""The one reader of scored datasets (docs/METHOD.md §1.4, §2.4, §2.5): stage 2, inspection and
tests all read through :class:`ScoredDataset`.

:func:`open_scored_dataset` opens one or several scored folders and checks, before anything trains:

* each folder's ``manifest.json`` (readable, schema version, complete unless ``allow_partial``);
* each listed shard (:func:`shard_problems`): the file exists, has the size the manifest recorded,
  a readable Parquet footer with the contract's schema and metadata, the same identity and shard
  index as its entry, the recorded row count, and with ``verify="sha256"`` the recorded checksum
  (a full read of every shard, off by default because it costs as much as the data);
* across folders: one teacher. Folders scored by different teachers (or teacher settings) cannot be
  mixed in one run; the refusal lists the differences. Folders of one teacher are concatenated.

A shard that fails a check is an error naming the file (``on_bad_shard="error"``) or is left out
with a warning and counted (``"skip"``); the skipped shards are part of the dataset's identity, so
a run never resumes on a different selection of shards. :meth:`ScoredDataset.open` opens one folder
as its manifest lists it, checking nothing per shard, for looking into it
(``pipeline.inspection``, whose ``validate`` checks every file).

Rows are read three ways: :class:`ShardReader` (random access with a small row-group cache, for
training), :meth:`ScoredDataset.iter_documents` (in order, one record batch at a time) and
:meth:`ScoredDataset.scan` (a lazy Polars frame; Polars is imported only there).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage_schemas import filesystem as sfs
from storage_schemas.identity import (
    data_identity_differences,  # noqa: F401  (part of this module's interface)
    iter_identity_differences,
    shard_identity_differences,
)
from storage_schemas.layout import (
    MANIFEST_NAME,
    file_sha256,
    marker_of,
    read_manifest,
    shard_file_problems,
)
from storage_schemas.rows import MAX_LOSS, impossible_losses, list_column_values
from storage_schemas.schema import (
    LIST_COLUMNS,
    META_IDENTITY,
    META_SHARD,
    ContractError,
    polars_schema,
    read_shard_metadata,
)

log = logging.getLogger(__name__)

ON_BAD_SHARD = ("error", "skip")
OPEN_THREADS = 16  # shards checked at once when a folder is opened (requests in flight on an object store)
VERIFY = ("size", "sha256")
# The parts of a dataset identity that must agree across folders mixed in one run.
TEACHER_KEYS = ("teacher", "windows")


class BadShardError(ContractError):
    """One or more shards that cannot be read; the message names every file."""


class MixedTeachersError(ContractError):
    """Scored folders produced by different teachers (or teacher settings) in one run."""


@dataclass(frozen=True)
class ShardInfo:
    """One usable shard: where it is (a ``Path``, or a URI string on an object store), which folder
    it belongs to, and its row-group layout."""

    path: Path | str
    folder: int  # index into ScoredDataset.folders
    rows: int
    sha256: str  # as recorded in the manifest
    row_group_rows: tuple[int, ...]

    def row_group_of(self, row: int) -> tuple[int, int]:
        """``(row_group, row_within_group)`` of a row of the shard."""
        bounds = np.cumsum(self.row_group_rows)
        group = int(np.searchsorted(bounds, row, side="right"))
        if not 0 <= row < self.rows or group >= len(bounds):
            raise IndexError(f"{self.path}: row {row} outside 0..{self.rows - 1}")
        return group, row - int(bounds[group] - self.row_group_rows[group])


@dataclass(frozen=True)
class ScoredFolder:
    path: Path | str  # a Path, or a URI string on an object store (storage_schemas.filesystem.location)
    manifest_sha256: str
    identity: dict
    complete: bool
    n_shards_planned: int
    manifest: dict = field(default_factory=dict, repr=False, compare=False)


class DocumentNotFoundError(ValueError):
    """No document with the requested id among the shards the manifest lists."""


@dataclass
class ScoredDocument:
    """One document as a row of the contract holds it: teacher token ids, spans and losses."""

    doc_id: str
    text: str
    ids: np.ndarray  # (M,) int32
    starts: np.ndarray  # (M,) int32
    ends: np.ndarray  # (M,) int32
    losses: np.ndarray  # (M,) float32, NaN where nothing predicted the token


@dataclass
class DocumentRecord(ScoredDocument):
    """A stored document and where it is."""

    file: str = ""  # shard file name
    row: int = -1  # row inside that shard

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class ScoredDataset:
    folders: list[ScoredFolder]
    shards: list[ShardInfo]
    skipped: list[dict] = field(default_factory=list)  # [{"folder", "file", "reason"}], file relative to its folder

    @classmethod
    def open(cls, folder: str | os.PathLike) -> "ScoredDataset":
        """One folder with the shards its manifest lists, complete or not, without per-shard checks
        (reading a damaged shard fails then, naming the file)."""
        opened, entries = _open_folder(sfs.location(folder), allow_partial=True, quiet=True)
        shards = [ShardInfo(path=sfs.child(opened.path, e["file"]), folder=0, rows=int(e.get("rows", 0)),
                            sha256=e.get("sha256", ""), row_group_rows=()) for e in entries]
        return cls(folders=[opened], shards=shards)

    @property
    def teacher(self) -> dict:
        """The parts of the identity that must agree across the folders of one run."""
        return {k: self.folders[0].identity.get(k) for k in TEACHER_KEYS}

    @property
    def n_documents(self) -> int:
        return sum(s.rows for s in self.shards)

    def identity(self) -> dict:
        """What a checkpoint records: enough to prove which scored data a student was trained on.
        Each folder's ``path`` and ``manifest_sha256`` say where it was and which manifest was read,
        for people; :func:`data_identity_differences` leaves them out."""
        return {
            "folders": [
                {"path": str(f.path), "manifest_sha256": f.manifest_sha256, "complete": f.complete,
                 "identity": f.identity}
                for f in self.folders
            ],
            "teacher": self.teacher,
            "shards_used": [{"file": sfs.name(s.path), "folder": s.folder,
                             "sha256": s.sha256, "rows": s.rows} for s in self.shards],
            "shards_skipped": self.skipped,
            "n_documents": self.n_documents,
        }

    # The first folder as its manifest describes it (inspection opens one folder).

    @property
    def folder(self) -> Path | str:
        return self.folders[0].path

    @property
    def manifest(self) -> dict:
        return self.folders[0].manifest

    @property
    def entries(self) -> list[dict]:
        return list(self.manifest.get("shards", []))

    @property
    def shard_paths(self) -> list[Path | str]:
        return [s.path for s in self.shards]

    @property
    def teacher_tokenizer(self) -> str | None:
        return teacher_tokenizer_location(self.manifest)

    @property
    def teacher_model(self) -> str:
        """Where the teacher was (a path or hub id), for titles."""
        location = self.manifest.get("location") or {}
        return str(location.get("teacher_model") or (self.folders[0].identity.get("teacher") or {}).get("model"))

    @property
    def name(self) -> str:
        """``<corpus>/<teacher>`` from the identity, for titles."""
        identity = self.folders[0].identity
        corpus = (identity.get("corpus") or {}).get("name", "?")
        return f"{corpus}/{(identity.get('teacher') or {}).get('name', '?')}"

    def scan(self, with_file: bool = False):
        """Every shard as one ``polars.LazyFrame`` (only the columns a query names are read);
        ``with_file`` adds a ``file`` column (shard file name)."""
        import polars as pl  # the contract needs pyarrow only; Polars where a frame is asked for

        paths = [str(p) for p in self.shard_paths]
        if not paths:
            frame = pl.LazyFrame(schema=polars_schema())
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
        import polars as pl  # the contract needs pyarrow only; Polars where a frame is asked for

        for path in self.shard_paths:
            frame = pl.scan_parquet(str(path)).with_row_index("row")
            if doc_id is None:
                frame = frame.filter(pl.col("token_ids").list.len() >= min_tokens)
            else:
                frame = frame.filter(pl.col("doc_id") == doc_id)
            found = frame.head(1).collect()
            if found.height:
                table = found.to_arrow()
                return next(_records(table, sfs.name(path), int(found["row"][0])))
        wanted = f"document {doc_id!r}" if doc_id is not None else f"a document with >= {min_tokens} tokens"
        raise DocumentNotFoundError(f"{self.folder}: no {wanted} in the shards listed by the manifest")

    def iter_documents(self, limit: int | None = None, batch_rows: int = 256) -> Iterator[DocumentRecord]:
        """Documents in dataset order, at most ``limit``; memory is one record batch at a time."""
        seen = 0
        for path in self.shard_paths:
            row = 0
            with sfs.parquet_file(path) as reader:
                for batch in reader.iter_batches(batch_size=batch_rows):
                    for record in _records(batch, sfs.name(path), row):
                        if limit is not None and seen >= limit:
                            return
                        seen += 1
                        yield record
                    row += batch.num_rows


def _records(batch: pa.RecordBatch | pa.Table, file: str, first_row: int) -> Iterator[DocumentRecord]:
    """The rows of ``batch`` as :class:`DocumentRecord` (lists are views into one flat buffer)."""
    doc_ids = batch.column("doc_id").to_pylist()
    texts = batch.column("text").to_pylist()
    lists = {c: list_column_values(batch, c) for c in LIST_COLUMNS}
    dtypes = {"token_ids": np.int32, "starts": np.int32, "ends": np.int32, "losses": np.float32}
    flat = {c: values.astype(dtypes[c], copy=False) for c, (values, _) in lists.items()}
    for r in range(batch.num_rows):
        parts = [flat[c][lists[c][1][r]: lists[c][1][r + 1]] for c in LIST_COLUMNS]
        yield DocumentRecord(doc_ids[r], texts[r], *parts, file=file, row=first_row + r)


def teacher_tokenizer_location(manifest: dict) -> str | None:
    """Where the scoring job found the teacher's tokenizer (a path or hub id): the manifest's
    ``location``, or, for a manifest of identity format 1, the path its identity recorded."""
    location = (manifest.get("location") or {}).get("teacher_tokenizer")
    return location or ((manifest.get("identity") or {}).get("teacher") or {}).get("tokenizer")


# --------------------------------------------------------------------------------------------
# Opening and validating


def open_scored_dataset(
    folders: Sequence[str | os.PathLike],
    *,
    on_bad_shard: str = "error",
    verify: str = "size",
    allow_partial: bool = False,
) -> ScoredDataset:
    """Open and validate scored folders (module docstring); raises :class:`ContractError` subclasses."""
    if on_bad_shard not in ON_BAD_SHARD:
        raise ValueError(f"on_bad_shard must be one of {ON_BAD_SHARD}, got {on_bad_shard!r}")
    if verify not in VERIFY:
        raise ValueError(f"verify must be one of {VERIFY}, got {verify!r}")
    if not folders:
        raise ContractError("no scored dataset folder given")
    paths = [sfs.location(f) for f in folders]
    if len(set(paths)) != len(paths):
        raise ContractError(f"a scored folder is listed twice: {[str(p) for p in paths]}")

    opened = [_open_folder(p, allow_partial) for p in paths]
    _check_one_teacher(opened)
    shards: list[ShardInfo] = []
    bad: list[dict] = []
    for index, (folder, entries) in enumerate(opened):
        with ThreadPoolExecutor(max_workers=OPEN_THREADS) as pool:  # an object store answers each request late
            checks = pool.map(lambda e: shard_problems(folder.path, e, folder.manifest, checksum=verify == "sha256"),
                              entries)
        for entry, check in zip(entries, checks):
            if check.problems:
                reason = "; ".join(message for _, message in check.problems)
                bad.append({"folder": index, "file": entry.get("file", "?"), "reason": reason})
            else:
                shards.append(ShardInfo(path=sfs.child(folder.path, entry["file"]), folder=index, rows=check.rows,
                                        sha256=entry.get("sha256", ""), row_group_rows=check.row_group_rows))
    if bad and on_bad_shard == "error":
        raise BadShardError(_bad_message(bad, paths))
    for b in bad:
        log.warning("skipping shard %s: %s", sfs.child(paths[b["folder"]], b["file"]), b["reason"])
    if not shards:
        raise ContractError(f"no usable shard in {[str(p) for p in paths]}" + (f"\n{_bad_message(bad, paths)}" if bad else ""))
    return ScoredDataset(folders=[f for f, _ in opened], shards=shards, skipped=bad)


def _bad_message(bad: list[dict], paths: list[Path | str]) -> str:
    lines = "\n  ".join(f"{sfs.child(paths[b['folder']], b['file'])}: {b['reason']}" for b in bad)
    same_size = [marker_of(sfs.name(b["file"])) for b in bad if "checksum mismatch" in b["reason"]
                 and "bytes on disk" not in b["reason"]]
    redo = (f" (a shard of its recorded size is taken for done: delete its marker first, {', '.join(same_size)})"
            if same_size else "")
    return (f"{len(bad)} unreadable shard(s):\n  {lines}\n"
            f"Rescore them (make score-teacher finds and redoes them{redo}), or set data.on_bad_shard=skip.")


def _open_folder(path: Path | str, allow_partial: bool, quiet: bool = False) -> tuple[ScoredFolder, list[dict]]:
    manifest = read_manifest(path)
    planned = int(manifest.get("n_shards_planned", len(manifest["shards"])))
    complete = bool(manifest.get("complete", False))
    if not complete and not allow_partial:
        raise ContractError(
            f"{path}: scoring is incomplete ({len(manifest['shards'])}/{planned} shards); finish it with "
            "make score-teacher, or train on the finished shards with data.allow_partial=true"
        )
    if not complete and not quiet:
        log.warning("%s: incomplete scored dataset, using its %d finished shards of %d",
                    path, len(manifest["shards"]), planned)
    folder = ScoredFolder(
        path=path,
        manifest_sha256=file_sha256(sfs.child(path, MANIFEST_NAME)),
        identity=manifest.get("identity", {}),
        complete=complete,
        n_shards_planned=planned,
        manifest=manifest,
    )
    return folder, list(manifest["shards"])


def _check_one_teacher(opened: list[tuple[ScoredFolder, list[dict]]]) -> None:
    first = opened[0][0]
    for folder, _ in opened[1:]:
        diffs = [
            d for key in TEACHER_KEYS
            for d in iter_identity_differences(first.identity.get(key) or {}, folder.identity.get(key) or {}, f"{key}.")
        ]
        if diffs:
            raise MixedTeachersError(
                f"{folder.path} was scored with a different teacher setup than {first.path}; one run trains "
                "against one teacher:\n  " + "\n  ".join(diffs)
            )


@dataclass
class ShardCheck:
    """What :func:`shard_problems` found: ``(file name, problem)`` pairs, and the shard's metadata
    when its footer could be read."""

    problems: list[tuple[str, str]]
    meta: dict | None = None
    rows: int = 0
    row_group_rows: tuple[int, ...] = ()


def shard_problems(folder: Path | str, entry: dict | None, manifest: Mapping, *, checksum: bool,
                   marker: bool = False, file: str | None = None) -> ShardCheck:
    """Every way one shard breaks the contract at file level: against its manifest ``entry`` (file,
    size, checksum, marker: :func:`storage_schemas.layout.shard_file_problems`), then its footer,
    schema and metadata, its identity against the ``manifest``'s, its shard index and row count.
    Without an entry (a shard the manifest does not list) only the footer is checked."""
    name = entry["file"] if entry is not None else file
    path = sfs.child(folder, name)
    problems = shard_file_problems(path, entry, checksum=checksum, marker=marker) if entry is not None else []
    if (entry is not None and any("missing from the folder" in p for _, p in problems)) or (
            entry is None and not sfs.is_file(path)):
        return ShardCheck(problems or [(name, "missing")])
    try:
        fs, inside = sfs.resolve(path)  # the footer read once, through the cached file system
        with fs.open_input_file(inside) as f:
            try:
                footer = pq.ParquetFile(f)
            except Exception as exc:  # pyarrow raises several types for unreadable files
                if sfs.unavailable(exc):
                    raise  # the store did not answer: nothing is known of the file
                raise ContractError(f"{path}: not a readable Parquet file ({exc})") from exc
            meta = read_shard_metadata(path, footer.schema_arrow)
            parquet_meta = footer.metadata
    except ContractError as exc:
        return ShardCheck(problems + [(name, str(exc).replace(f"{path}: ", ""))])
    except Exception as exc:  # pyarrow's errors on a footer that reads as a schema but not in full
        if sfs.unavailable(exc):
            raise  # the store did not answer: not a bad shard
        return ShardCheck(problems + [(name, f"unreadable footer ({type(exc).__name__}: {exc})")])
    if manifest.get("identity"):
        diffs = shard_identity_differences(meta[META_IDENTITY], manifest)
        if diffs:
            problems.append((name, "identity differs from the manifest: " + "; ".join(diffs)))
    if entry is not None and meta[META_SHARD].get("index") != entry.get("index"):
        index = meta[META_SHARD].get("index")
        problems.append((name, f"metadata shard index {index!r}, manifest entry {entry.get('index')!r}"))
    if entry is not None and parquet_meta.num_rows != entry.get("rows"):
        problems.append((name, f"{parquet_meta.num_rows} rows, manifest says {entry.get('rows')}"))
    groups = tuple(parquet_meta.row_group(i).num_rows for i in range(parquet_meta.num_row_groups))
    return ShardCheck(problems, meta=meta, rows=parquet_meta.num_rows, row_group_rows=groups)


# --------------------------------------------------------------------------------------------
# Reading rows


def read_row_group(shard: ShardInfo, group: int, columns: Sequence[str] | None = None) -> pa.Table:
    """One decoded row group; any decoding problem, a row whose lists disagree in length or a loss
    no teacher gives (:func:`refuse_impossible_losses`) is a :class:`BadShardError` naming the file."""
    try:
        table = sfs.parquet_file(shard.path).read_row_group(group, columns=list(columns) if columns else None)
    except Exception as exc:
        if sfs.unavailable(exc):
            raise  # the store did not answer: not a bad shard (never skipped for it)
        raise BadShardError(f"{shard.path}: row group {group} cannot be read ({type(exc).__name__}: {exc})") from exc
    present = [c for c in LIST_COLUMNS if c in table.column_names]
    if len(present) > 1:
        lengths = [pc.list_value_length(table.column(c)) for c in present]
        for c, n in zip(present[1:], lengths[1:]):
            if not pc.all(pc.equal(n, lengths[0])).as_py():
                raise BadShardError(f"{shard.path}: row group {group}: lengths of {present[0]} and {c} differ")
    table = table.combine_chunks()
    if "losses" in table.column_names:
        refuse_impossible_losses(shard, group, table)
    return table


def refuse_impossible_losses(shard: ShardInfo, group: int, table: pa.Table) -> None:
    """A :class:`BadShardError` in one line naming the file and the document when a loss of the
    decoded row group ``table`` is one no teacher gives (infinite, negative, above ``MAX_LOSS``
    nats): a changed byte that kept the file's size, which only ``verify="sha256"`` would
    otherwise find. One vectorised pass over values already decoded: it costs nothing beside the
    decoding."""
    values, offsets = list_column_values(table, "losses")
    first, last = int(offsets[0]), int(offsets[-1])
    bad = np.flatnonzero(impossible_losses(values[first:last]))
    if not bad.size:
        return
    at = first + int(bad[0])
    row = int(np.searchsorted(offsets, at, side="right")) - 1
    file = sfs.parquet_file(shard.path)  # what names the document: read only now
    doc_ids = table.column("doc_id") if "doc_id" in table.column_names else \
        file.read_row_group(group, columns=["doc_id"]).column("doc_id")
    in_shard = row + sum(file.metadata.row_group(g).num_rows for g in range(group))
    marker = marker_of(sfs.name(str(shard.path)))
    raise BadShardError(
        f"{shard.path}: document {doc_ids[row].as_py()!r} (row {in_shard}) has teacher loss {float(values[at]):.4g} at "
        f"token {at - int(offsets[row])}, which no teacher gives (a loss is -log p: finite, 0 to {MAX_LOSS:g} nats, "
        f"NaN where nothing predicted the token): the shard changed since it was scored. Score it again (delete "
        f"{marker} beside it and run make score-teacher), or leave it out with data.on_bad_shard=skip")


@dataclass(frozen=True)
class ScoredRow:
    """What stage 2 needs of one scored document."""

    text: str
    starts: np.ndarray  # (M,) int32
    ends: np.ndarray  # (M,) int32
    losses: np.ndarray  # (M,) float32


ROW_COLUMNS = ("text", "starts", "ends", "losses")


class ShardReader:
    """Random access to documents by ``(shard, row)``, with a small LRU of decoded row groups.

    One reader per process: data-loader workers each build their own on first use. Documents are
    read in an order that stays inside one shard for long stretches (see
    :mod:`pipeline.student_data.packing`), so a handful of cached row groups serve almost every request.
    A cached row group keeps its list columns as flat NumPy arrays, so a row's lists are slices
    (views) of them.
    """

    def __init__(self, shards: Sequence[ShardInfo], cache_row_groups: int = 4):
        self.shards = list(shards)
        self.cache_row_groups = max(1, cache_row_groups)
        self._cache: OrderedDict[tuple[int, int], _DecodedGroup] = OrderedDict()

    def row(self, shard_index: int, row: int) -> ScoredRow:
        shard = self.shards[shard_index]
        group, within = shard.row_group_of(row)
        decoded = self._group(shard_index, group)
        begin, end = int(decoded.offsets[within]), int(decoded.offsets[within + 1])
        return ScoredRow(
            text=decoded.text[within].as_py(),
            starts=decoded.starts[begin:end],
            ends=decoded.ends[begin:end],
            losses=decoded.losses[begin:end],
        )

    def _group(self, shard_index: int, group: int) -> _DecodedGroup:
        key = (shard_index, group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        decoded = _DecodedGroup.of(read_row_group(self.shards[shard_index], group, ROW_COLUMNS))
        self._cache[key] = decoded
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return decoded


@dataclass(frozen=True)
class _DecodedGroup:
    """One row group as :class:`ShardReader` keeps it: the text column, and the values of the
    starts, ends and losses lists as flat arrays with their shared offsets (:func:`read_row_group`
    checked that the lists of a row have one length)."""

    text: pa.Array
    offsets: np.ndarray  # (rows + 1,)
    starts: np.ndarray  # (tokens,) int32
    ends: np.ndarray  # (tokens,) int32
    losses: np.ndarray  # (tokens,) float32

    @classmethod
    def of(cls, table: pa.Table) -> _DecodedGroup:
        values = {c: list_column_values(table, c) for c in ("starts", "ends", "losses")}
        return cls(text=table.column("text").chunk(0), offsets=values["starts"][1],
                   starts=values["starts"][0].astype(np.int32, copy=False),
                   ends=values["ends"][0].astype(np.int32, copy=False),
                   losses=values["losses"][0].astype(np.float32, copy=False))
