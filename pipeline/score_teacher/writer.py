"""Writing scored shards and keeping the dataset folder consistent across crashes and reruns.

* Locally a shard is written as ``.shard-NNNNNN.parquet.tmp-<random>``, fsynced, renamed to
  ``shard-NNNNNN.parquet``; only then is its marker ``shard-NNNNNN.done.json`` written (atomically).
* On an object store (``s3://``, ``gs://``: no rename) each attempt PUTs its shard whole under its
  own name ``shard-NNNNNN.<attempt>.parquet``, then its marker ``shard-NNNNNN.<attempt>.done.json``
  (one PUT, naming the object, its size and sha256). Two finished attempts at one shard hold the
  same rows; the one whose file name sorts first is the shard (:func:`finished_shards`). Objects no
  winning marker names are deleted when a run starts and ends (:func:`remove_unreferenced`).
* A shard without a marker is unfinished and is redone whole on the next run.
* ``manifest.json`` is written at the start of a run (identity, no shards yet or the shards already
  done) and rewritten from the markers as shards finish; readers use the shards it lists.
* A folder scored with another identity (teacher, tokenizer, window, corpus, plan) is refused with
  the list of differences, unless ``overwrite`` is set, which deletes its shards first. The identity
  holds no paths (:mod:`storage_schemas.identity`), so a moved or copied folder is the same dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import UserError, check_choice, refuse
from pipeline.folder_lock import LOCK_NAME
from pipeline.score_teacher.teacher import ScoredDocument, ShardResult
from storage_schemas import (
    CARD_NAME,
    MANIFEST_NAME,
    ROW_SCHEMA,
    SCHEMA_VERSION,
    SHARD_RE,
    file_sha256,
    iter_identity_differences,
    marker_of,
    schema_with_metadata,
    shard_index,
    shard_name,
    write_json_atomic,
)
from storage_schemas import filesystem as sfs
from storage_schemas.layout import MARKER_SUFFIX
from storage_schemas.rows import list_array


class DatasetMismatchError(UserError, RuntimeError):
    """The output folder holds a dataset scored with another identity."""


# ---------------------------------------------------------------------------------------------
# One shard


@dataclass(frozen=True)
class StorageConfig:
    """How shards are encoded on disk; the schema and the row contents do not change.

    ``encodings="compact"`` uses Parquet's DELTA_BINARY_PACKED for offsets and BYTE_STREAM_SPLIT
    for ids and losses. ``loss_precision`` rounds losses to bfloat16 or float16 precision before
    they are stored as float32: the dropped mantissa bits compress to nearly nothing. Rounding
    changes the stored values, so it is part of the dataset's identity; the encodings are not
    (docs/METHOD.md §1.4). ``make bench`` measures the bytes per token of each setting.
    """

    compression: str = "zstd"
    compression_level: int | None = None
    encodings: str = "default"  # default | compact
    loss_precision: str = "float32"  # float32 | bfloat16 | float16

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "encodings", self.encodings, ENCODINGS)
        check_choice(found, "loss_precision", self.loss_precision, LOSS_PRECISIONS)
        return found

    def __post_init__(self) -> None:
        refuse(self)


ENCODINGS = ("default", "compact")
LOSS_PRECISIONS = ("float32", "bfloat16", "float16")


# Parquet matches column encodings on leaf paths (``starts.list.element``), and pyarrow silently
# ignores names that match no leaf, so the paths are spelled out in full. Offsets grow, so delta
# coding suits them; token ids are not monotone and losses are floats, so their bytes are split.
COMPACT_ENCODINGS = {
    "token_ids.list.element": "BYTE_STREAM_SPLIT",
    "starts.list.element": "DELTA_BINARY_PACKED",
    "ends.list.element": "DELTA_BINARY_PACKED",
    "losses.list.element": "BYTE_STREAM_SPLIT",
}


def round_losses(losses: np.ndarray, precision: str) -> np.ndarray:
    """Round float32 losses to a coarser precision, keeping float32 storage (NaN stays NaN)."""
    if precision == "float32":
        return losses
    if precision == "float16":
        return losses.astype(np.float16).astype(np.float32)
    if precision == "bfloat16":  # round to nearest even on the upper 16 bits
        bits = losses.astype(np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)
        return np.where(np.isnan(losses), losses, rounded.view(np.float32)).astype(np.float32)
    raise ValueError(f"unknown loss precision {precision!r}; choose float32, bfloat16 or float16")


def _parquet_options(storage: StorageConfig) -> dict:
    options = dict(compression=storage.compression, compression_level=storage.compression_level, row_group_size=1024)
    if storage.encodings == "compact":
        options.update(use_dictionary=["doc_id"], column_encoding=COMPACT_ENCODINGS)
        if storage.compression_level is None and storage.compression == "zstd":
            options["compression_level"] = 9  # compact storage trades write time for size
    elif storage.encodings != "default":
        raise ValueError(f"unknown encodings {storage.encodings!r}; choose default or compact")
    return options


def documents_table(docs: Sequence[ScoredDocument], schema: pa.Schema = ROW_SCHEMA) -> pa.Table:
    columns = [
        pa.array([d.doc_id for d in docs], pa.string()),
        pa.array([d.text for d in docs], pa.string()),
        list_array([d.ids for d in docs], pa.int32()),
        list_array([d.starts for d in docs], pa.int32()),
        list_array([d.ends for d in docs], pa.int32()),
        list_array([d.losses for d in docs], pa.float32()),
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def write_shard(
    folder: str | os.PathLike,
    index: int,
    result: ShardResult,
    identity: dict,
    shard_source: dict,
    code_version: str,
    storage: StorageConfig = StorageConfig(),
    scored_by: dict | None = None,
) -> dict:
    """Write one shard whole, then its completion marker (module docstring); returns the marker entry.
    ``scored_by`` (which node scored it, on which try) goes into the marker only, never into the
    shard file, so the file's bytes do not depend on where it was scored."""
    schema = schema_with_metadata(identity, {"index": index, **shard_source}, code_version)
    docs = result.documents
    if storage.loss_precision != "float32":
        docs = [replace(d, losses=round_losses(d.losses, storage.loss_precision)) for d in docs]
    table = documents_table(docs, schema)
    if sfs.is_remote(folder):
        folder = os.fspath(folder)
        file, size, digest = _put_shard(folder, index, table, storage)
    else:
        folder = Path(folder)
        file, size, digest = _write_local_shard(folder, index, table, storage)
    entry = {
        "file": file,
        "index": index,
        "rows": table.num_rows,
        "tokens": int(sum(len(d.ids) for d in result.documents)),
        "bytes": size,
        "sha256": digest,
        "source": shard_source,
        "reasons": dict(sorted(result.reasons.items())),
        "skipped": result.skipped,
    }
    if scored_by is not None:
        entry["scored_by"] = scored_by
    write_json_atomic(sfs.child(folder, marker_of(file)), entry)
    return entry


def _write_local_shard(folder: Path, index: int, table: pa.Table, storage: StorageConfig) -> tuple[str, int, str]:
    """Temporary name, fsync, rename: a reader finds the old file, the new one, or none."""
    final = folder / shard_name(index)
    tmp = folder / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        pq.write_table(table, tmp, **_parquet_options(storage))
        _fsync_file(tmp)
        os.replace(tmp, final)
        _fsync_dir(folder)
    finally:
        if tmp.exists():
            tmp.unlink()
    return final.name, final.stat().st_size, file_sha256(final)


def _put_shard(folder: str, index: int, table: pa.Table, storage: StorageConfig) -> tuple[str, int, str]:
    """Encode the shard in memory and PUT it under this attempt's own name; the object store makes
    it visible whole or not at all, and no other attempt writes that name."""
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer, **_parquet_options(storage))
    data = buffer.getvalue()
    name = shard_name(index, attempt=uuid.uuid4().hex[:12])
    sfs.write_bytes(sfs.child(folder, name), data)
    return name, data.size, hashlib.sha256(data).hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# The dataset folder


def prepare_output(
    folder: str | os.PathLike,
    identity: dict,
    overwrite: bool,
    *,
    location: dict | None = None,
) -> tuple[dict[int, dict], dict]:
    """Make ``folder`` ready for a run with ``identity``; returns the finished shards' entries and
    the manifest's extra fields (``location``) for every later :func:`write_manifest` of the run.

    Refuses (``DatasetMismatchError``) a folder scored with another identity or holding shards
    without a manifest, unless ``overwrite``. Leftover temporary files are removed.
    """
    remote = sfs.is_remote(folder)
    folder = os.fspath(folder) if remote else Path(folder)
    if not remote and folder.exists() and not folder.is_dir():
        raise DatasetMismatchError(f"{folder}: exists and is not a folder")
    extra: dict = {"location": location}
    if remote or folder.is_dir():
        problem = folder_problem(folder, identity)
        if problem and not overwrite:
            raise DatasetMismatchError(problem + "\nChoose another output folder, or pass overwrite=true to rescore it.")
        if problem:
            _clear_dataset(folder)
    if not remote:
        folder.mkdir(parents=True, exist_ok=True)
        for leftover in folder.glob(".*.tmp-*"):
            leftover.unlink()
    done = finished_shards(folder)
    remove_unreferenced(folder, done)
    write_manifest(folder, identity, done, n_planned=identity["corpus"]["n_shards"], **extra)
    return done, extra


def folder_problem(folder: Path | str, identity: dict) -> str | None:
    """Why ``folder`` cannot take a run with ``identity`` (None: it can)."""
    manifest_path = sfs.child(folder, MANIFEST_NAME)
    if sfs.exists(manifest_path):
        try:
            old = json.loads(sfs.read_bytes(manifest_path))
        except json.JSONDecodeError as exc:
            return f"{manifest_path}: unreadable manifest ({exc})"
        if old.get("schema_version") != SCHEMA_VERSION:
            return f"{folder}: holds schema version {old.get('schema_version')!r}, this code writes {SCHEMA_VERSION}"
        diffs = list(iter_identity_differences(old.get("identity", {}), identity))
        if diffs:
            return f"{folder} was scored with a different setup:\n  " + "\n  ".join(diffs)
        return None
    if any(shard_index(name) is not None for name in sfs.file_sizes(folder)):
        return f"{folder}: holds shard files but no {MANIFEST_NAME}; its origin is unknown"
    return None


def _clear_dataset(folder: Path | str) -> None:
    for name in sfs.file_sizes(folder):
        if name == LOCK_NAME:
            continue
        if SHARD_RE.match(name) or name.endswith(MARKER_SUFFIX) or name in (MANIFEST_NAME, CARD_NAME):
            sfs.delete(sfs.child(folder, name))
        elif name.startswith(".") and ".tmp-" in name:
            sfs.delete(sfs.child(folder, name))
    if isinstance(folder, Path):
        for path in folder.iterdir():
            if path.is_dir() and (path.name.startswith(".") or path.name == "inspect"):
                shutil.rmtree(path)  # reports made by `make inspect` describe the old shards


def finished_shards(folder: str | os.PathLike) -> dict[int, dict]:
    """Entries of the shards whose marker exists and names a file of the recorded size.

    Where two attempts at one shard both finished (an object store, where a shard the job retried
    had in fact been written), both hold the same rows and the attempt whose file name sorts first
    is the shard: a fixed rule, so every reader of the markers picks the same one."""
    folder = os.fspath(folder) if sfs.is_remote(folder) else Path(folder)
    sizes = sfs.file_sizes(folder)
    done: dict[int, dict] = {}
    for marker in sorted(n for n in sizes if n.startswith("shard-") and n.endswith(MARKER_SUFFIX)):
        try:
            entry = json.loads(sfs.read_bytes(sfs.child(folder, marker)))
        except (OSError, json.JSONDecodeError):
            continue  # gone since the listing, or torn (cannot happen with whole writes: never trust it)
        file = entry.get("file") if isinstance(entry, dict) else None
        index = shard_index(file) if isinstance(file, str) else None
        if index is None or marker_of(file) != marker or entry.get("index") != index:
            continue
        if sizes.get(file) != entry.get("bytes"):
            continue
        if index not in done or file < done[index]["file"]:
            done[index] = entry
    return done


def remove_unreferenced(folder: str | os.PathLike, done: dict[int, dict]) -> list[str]:
    """On an object store, delete the shard objects and markers that no entry of ``done`` names
    (attempts cut short, attempts that lost to another, stale markers); returns their names.
    A local folder is left as it is: its one file name per shard is redone in place."""
    if not sfs.is_remote(folder):
        return []
    folder = os.fspath(folder)
    keep = {name for e in done.values() for name in (e["file"], marker_of(e["file"]))}
    stray = [n for n in sfs.file_sizes(folder)
             if n not in keep and (SHARD_RE.match(n) or (n.startswith("shard-") and n.endswith(MARKER_SUFFIX)))]
    for name in stray:
        try:
            sfs.delete(sfs.child(folder, name))
        except FileNotFoundError:
            pass
    return stray


def write_manifest(
    folder: str | os.PathLike,
    identity: dict,
    done: dict[int, dict],
    n_planned: int,
    code_version: str | None = None,
    *,
    location: dict | None = None,
    failed: list[dict] | None = None,
) -> dict:
    """Write ``manifest.json`` from the finished shards' entries. ``location`` (where the teacher
    and corpus were found) is for people and never compared; ``failed`` lists the shards the
    run gave up on (index, error, attempts), which have no marker and are scored by the next run."""
    shards = [done[i] for i in sorted(done)]
    reasons: dict[str, int] = {}
    for entry in shards:
        for reason, count in entry["reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "identity": identity,
        "code_version": code_version,
        "complete": len(shards) == n_planned,
        "n_shards_planned": n_planned,
        "totals": {
            "shards": len(shards),
            "documents": sum(e["rows"] for e in shards),
            "tokens": sum(e["tokens"] for e in shards),
            "bytes": sum(e["bytes"] for e in shards),
            "reasons": dict(sorted(reasons.items())),
        },
        "shards": shards,
    }
    if location is not None:
        manifest["location"] = location
    if failed is not None:
        manifest["failed"] = sorted(failed, key=lambda f: f["index"])
    write_json_atomic(sfs.child(folder, MANIFEST_NAME), manifest)
    return manifest
