"""Reading scored datasets (stage-1 output, :mod:`storage_schemas.scored`) for stage 2.

:func:`open_scored_dataset` opens one or several scored folders and checks, before anything trains:

* each folder's ``manifest.json`` (readable, schema version, complete unless ``allow_partial``);
* each listed shard: the file exists, has the size the manifest recorded (a truncated copy is
  caught here), a readable Parquet footer with the contract's schema and metadata, the same
  identity as its folder's manifest, the recorded row count, and with ``verify="sha256"`` the
  recorded checksum (a full read of every shard, off by default because it costs as much as the
  data);
* across folders: one teacher. Folders scored by different teachers (or by the same teacher with
  another tokenizer, revision, dtype or window) cannot be mixed in one run; the refusal lists the
  differences. Several folders of one teacher (e.g. corpora scored separately) are concatenated.

A shard that fails a check is an error naming the file (``on_bad_shard="error"``, default) or is
left out with a warning and counted (``"skip"``); the skipped shards are part of the dataset's
identity, so a run never resumes on a different selection of shards.

The dataset's identity (each folder's identity, the shards used and skipped, by file name and
sha256) is what stage 2 records in every checkpoint; :func:`data_identity_differences` compares two
of them without the folders' paths, so a run resumes on a moved or copied dataset. Reading rows goes through :class:`ShardReader`, which
keeps a few decoded row groups per process (data-loader worker) and names the file on any error.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage_schemas import (
    LIST_COLUMNS,
    MANIFEST_NAME,
    META_IDENTITY,
    ContractError,
    file_sha256,
    identity_format,
    read_manifest,
    read_shard_metadata,
    shard_identity_differences,
)
from storage_schemas.scored import iter_identity_differences

log = logging.getLogger(__name__)

ON_BAD_SHARD = ("error", "skip")
VERIFY = ("size", "sha256")
# The parts of a dataset identity that must agree across folders mixed in one run.
TEACHER_KEYS = ("teacher", "windows")


class BadShardError(ContractError):
    """One or more shards that cannot be read; the message names every file."""


class MixedTeachersError(ContractError):
    """Scored folders produced by different teachers (or teacher settings) in one run."""


@dataclass(frozen=True)
class ShardInfo:
    """One usable shard: where it is, which folder it belongs to, and its row-group layout."""

    path: Path
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
    path: Path
    manifest_sha256: str
    identity: dict
    complete: bool
    n_shards_planned: int
    adopted_from: dict | None = None  # the format-1 identity its older shards carry, once migrated


@dataclass
class ScoredDataset:
    folders: list[ScoredFolder]
    shards: list[ShardInfo]
    skipped: list[dict] = field(default_factory=list)  # [{"folder", "file", "reason"}], file relative to its folder

    @property
    def teacher(self) -> dict:
        return {k: self.folders[0].identity.get(k) for k in TEACHER_KEYS}

    @property
    def n_documents(self) -> int:
        return sum(s.rows for s in self.shards)

    def identity(self) -> dict:
        """What a checkpoint records: enough to prove which scored data a student was trained on.
        Each folder's ``path`` and ``manifest_sha256`` say where it was and which manifest was read,
        for people; :func:`data_identity_differences` leaves them out (module docstring)."""
        return {
            "folders": [
                {"path": str(f.path), "manifest_sha256": f.manifest_sha256, "complete": f.complete,
                 "identity": f.identity, "adopted_from": f.adopted_from}
                for f in self.folders
            ],
            "teacher": self.teacher,
            "shards_used": [{"file": str(s.path.relative_to(self.folders[s.folder].path)), "folder": s.folder,
                             "sha256": s.sha256, "rows": s.rows} for s in self.shards],
            "shards_skipped": self.skipped,
            "n_documents": self.n_documents,
        }


def data_identity_differences(recorded: dict, current: dict) -> list[str]:
    """How the data identity ``current`` (:meth:`ScoredDataset.identity`, plus what stage 2 adds)
    differs from ``recorded`` (a checkpoint's), leaving out where things are: each folder's path
    and manifest sha256 (the manifest also holds the location and code version of the last rerun,
    which change when the data does not; the shards' sha256, which cover each shard's footer and
    the identity in it, pin the data) and the paths and wording of skipped shards. A folder
    migrated since the record (``adopted_from``) matches the identity it was adopted from."""
    return list(iter_identity_differences(_comparable(recorded, current), _comparable(current, None)))


def _comparable(identity: dict, current: dict | None) -> dict:
    out = {k: v for k, v in identity.items() if k not in ("folders", "shards_skipped")}
    now = (current or {}).get("folders") or []
    folders = {}  # keyed by position, so that differences are named down to the field
    for i, folder in enumerate(identity.get("folders") or []):
        ident = folder.get("identity")
        adopted = now[i].get("adopted_from") if i < len(now) else None
        if adopted is not None and ident == adopted:
            ident = now[i]["identity"]
            if i == 0:
                out["teacher"] = current.get("teacher")
        folders[str(i)] = {"complete": folder.get("complete"), "identity": ident}
    out["folders"] = folders
    out["shards_skipped"] = [Path(s.get("file", "")).name for s in identity.get("shards_skipped") or []]
    return out


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
    paths = [Path(f).resolve() for f in folders]
    if len(set(paths)) != len(paths):
        raise ContractError(f"a scored folder is listed twice: {[str(p) for p in paths]}")

    opened = [_open_folder(p, allow_partial) for p in paths]
    _check_one_teacher(opened)
    shards: list[ShardInfo] = []
    bad: list[dict] = []
    for index, (folder, entries) in enumerate(opened):
        for entry in entries:
            shard, problem = _check_shard(folder, index, entry, verify)
            if problem:
                bad.append({"folder": index, "file": entry.get("file", "?"), "reason": problem})
            else:
                shards.append(shard)
    if bad and on_bad_shard == "error":
        raise BadShardError(_bad_message(bad, paths))
    for b in bad:
        log.warning("skipping shard %s: %s", paths[b["folder"]] / b["file"], b["reason"])
    if not shards:
        raise ContractError(f"no usable shard in {[str(p) for p in paths]}" + (f"\n{_bad_message(bad, paths)}" if bad else ""))
    return ScoredDataset(folders=[f for f, _ in opened], shards=shards, skipped=bad)


def _bad_message(bad: list[dict], paths: list[Path]) -> str:
    lines = "\n  ".join(f"{paths[b['folder']] / b['file']}: {b['reason']}" for b in bad)
    return (f"{len(bad)} unreadable shard(s):\n  {lines}\n"
            "Rescore them (make score-teacher finds and redoes them), or set data.on_bad_shard=skip.")


def _open_folder(path: Path, allow_partial: bool) -> tuple[ScoredFolder, list[dict]]:
    manifest = read_manifest(path)
    planned = int(manifest.get("n_shards_planned", len(manifest["shards"])))
    complete = bool(manifest.get("complete", False))
    if not complete and not allow_partial:
        raise ContractError(
            f"{path}: scoring is incomplete ({len(manifest['shards'])}/{planned} shards); finish it with "
            "make score-teacher, or train on the finished shards with data.allow_partial=true"
        )
    if not complete:
        log.warning("%s: incomplete scored dataset, using its %d finished shards of %d",
                    path, len(manifest["shards"]), planned)
    folder = ScoredFolder(
        path=path,
        manifest_sha256=file_sha256(path / MANIFEST_NAME),
        identity=manifest.get("identity", {}),
        complete=complete,
        n_shards_planned=planned,
        adopted_from=manifest.get("adopted_from"),
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
            older = [f.path for f in (first, folder) if identity_format(f.identity) == 1]
            hint = "" if not older or len(older) == 2 else (
                f"\n{older[0]} was scored by an older version, which recorded the teacher by its path: run "
                "make score-teacher for it with migrate_identity=true added (nothing is rescored).")
            raise MixedTeachersError(
                f"{folder.path} was scored with a different teacher setup than {first.path}; one run trains "
                "against one teacher:\n  " + "\n  ".join(diffs) + hint
            )


def _check_shard(folder: ScoredFolder, index: int, entry: dict, verify: str) -> tuple[ShardInfo | None, str | None]:
    """A :class:`ShardInfo`, or the reason the shard cannot be used."""
    path = folder.path / entry["file"]
    if not path.is_file():
        return None, "missing"
    size = path.stat().st_size
    if size != entry.get("bytes"):
        return None, f"size {size} bytes, the manifest recorded {entry.get('bytes')} (truncated or replaced)"
    try:
        meta = read_shard_metadata(path)
        parquet_meta = pq.ParquetFile(path).metadata
    except Exception as exc:  # ContractError, or pyarrow's errors on a damaged footer
        return None, f"unreadable footer or schema ({exc})"
    diffs = shard_identity_differences(meta[META_IDENTITY], {"identity": folder.identity,
                                                             "adopted_from": folder.adopted_from})
    if diffs:
        return None, "scored with another identity than its folder's manifest: " + "; ".join(diffs[:5])
    if parquet_meta.num_rows != entry.get("rows"):
        return None, f"{parquet_meta.num_rows} rows, the manifest recorded {entry.get('rows')}"
    if verify == "sha256" and file_sha256(path) != entry.get("sha256"):
        return None, "sha256 differs from the manifest (corrupted)"
    groups = tuple(parquet_meta.row_group(i).num_rows for i in range(parquet_meta.num_row_groups))
    return ShardInfo(path=path, folder=index, rows=parquet_meta.num_rows, sha256=entry.get("sha256", ""),
                     row_group_rows=groups), None


# --------------------------------------------------------------------------------------------
# Reading rows


def read_row_group(shard: ShardInfo, group: int, columns: Sequence[str] | None = None) -> pa.Table:
    """One decoded row group; any decoding problem or a row whose lists disagree in length is a
    :class:`BadShardError` naming the file."""
    try:
        table = pq.ParquetFile(shard.path).read_row_group(group, columns=list(columns) if columns else None)
    except Exception as exc:
        raise BadShardError(f"{shard.path}: row group {group} cannot be read ({type(exc).__name__}: {exc})") from exc
    present = [c for c in LIST_COLUMNS if c in table.column_names]
    if len(present) > 1:
        import pyarrow.compute as pc

        lengths = [pc.list_value_length(table.column(c)) for c in present]
        for c, n in zip(present[1:], lengths[1:]):
            if not pc.all(pc.equal(n, lengths[0])).as_py():
                raise BadShardError(f"{shard.path}: row group {group}: lengths of {present[0]} and {c} differ")
    return table.combine_chunks()


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
    :mod:`pipeline.train_student.data`), so a handful of cached row groups serve almost every request.
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


def list_column_values(table: pa.Table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` of a list column as NumPy arrays (views where Arrow allows): row ``r``
    holds ``values[offsets[r] : offsets[r + 1]]`` (``values`` is the whole child array, so this
    holds for a sliced column too)."""
    array = table.column(column).combine_chunks()
    return array.values.to_numpy(zero_copy_only=False), array.offsets.to_numpy()

