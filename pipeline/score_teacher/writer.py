"""Writing scored shards and keeping the dataset folder consistent across crashes and reruns.

The exactly-once machinery (atomic shard files, markers, attempts on object stores, refusing a
folder of another identity) is shared with the export: :mod:`pipeline.folders.shard_folder`. Here:

* a shard is one Parquet file ``shard-NNNNNN.parquet`` (on an object store
  ``shard-NNNNNN.<attempt>.parquet``) with its marker ``shard-NNNNNN.done.json``;
* ``manifest.json`` is written at the start of a run (identity, no shards yet or the shards already
  done) and rewritten from the markers as shards finish; readers use the shards it lists;
* a folder scored with another identity (teacher, tokenizer, window, corpus, plan) is refused with
  the list of differences, unless ``overwrite`` is set, which sets its shards aside and deletes them
  once the new scoring has finished its first shard (:mod:`pipeline.folders.output_folder`). The identity
  holds no paths (:mod:`storage_schemas.identity`), so a moved or copied folder is the same dataset.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.runtime.config import check_choice, refuse
from pipeline.folders.output_folder import SetAside, storage_error
from pipeline.score_teacher.teacher import ScoredDocument, ShardResult
from pipeline.folders.shard_folder import (  # noqa: F401  (DatasetMismatchError, finished_shards, remove_unreferenced: stage 1's API)
    DatasetMismatchError,
    FolderKind,
    finished_shards,
    manifest_of,
    prepare_folder,
    remove_unreferenced,
    write_marker,
    write_shard_files,
)
from pipeline.folders.shard_folder import refuse_mismatch as refuse_kind_mismatch
from storage_schemas import MANIFEST_NAME, ROW_SCHEMA, SCHEMA_VERSION, schema_with_metadata, write_json_atomic
from storage_schemas import filesystem as sfs
from storage_schemas.rows import list_array

SCORED = FolderKind(what="scored dataset", version_key="schema_version", version=SCHEMA_VERSION, verb="scored",
                    redo="rescore it")


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

    The defaults are compact and bfloat16: 2.7 bytes per teacher token against 10.6 for plain
    float32 (the embedded default's 2.77M tokens), and the rounding moves 0.07% of a top-40%
    selection, a third of what computing the teacher in bfloat16 (as the 7B presets do) moves
    (docs/storage-schema.md, "Storage settings"; bench-results/storage-precision.md).
    """

    compression: str = "zstd"
    compression_level: int | None = None
    encodings: str = "compact"  # compact | default (plain Parquet encodings)
    loss_precision: str = "bfloat16"  # bfloat16 | float16 | float32

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
    (written,) = write_shard_files(folder, index, {".parquet": lambda path: pq.write_table(
        table, path, **_parquet_options(storage))})
    entry = {
        "file": written["file"],
        "index": index,
        "rows": table.num_rows,
        "tokens": int(sum(len(d.ids) for d in result.documents)),
        "bytes": written["bytes"],
        "sha256": written["sha256"],
        "source": shard_source,
        "reasons": dict(sorted(result.reasons.items())),
        "skipped": result.skipped,
    }
    if scored_by is not None:
        entry["scored_by"] = scored_by
    write_marker(folder, entry)
    return entry


# ---------------------------------------------------------------------------------------------
# The dataset folder


def prepare_output(
    folder: str | os.PathLike,
    identity: dict,
    overwrite: bool,
    *,
    location: dict | None = None,
    license: str | None = None,
    rehearsal: str | None = None,
    teacher_origin: dict | None = None,
) -> tuple[dict[int, dict], dict, SetAside | None]:
    """Make ``folder`` ready for a run with ``identity``; returns the finished shards' entries,
    the manifest's extra fields (``location``, ``license``, ``teacher_origin`` and ``rehearsal``'s
    note for a rehearsal's output) for every later :func:`write_manifest` of the run, and what
    ``overwrite`` set aside (commit it once a shard is finished; None: nothing).

    Refuses (``DatasetMismatchError``) a folder scored with another identity or holding shards
    without a manifest, unless ``overwrite`` (:func:`pipeline.folders.shard_folder.prepare_folder`).
    """
    extra: dict = {"location": location, "license": license, "teacher_origin": teacher_origin,
                   **({"rehearsal": rehearsal} if rehearsal else {})}
    done, aside = prepare_folder(folder, identity, overwrite, SCORED, hint=corpus_hint(folder, identity))
    write_manifest(folder, identity, done, n_planned=identity["corpus"]["n_shards"], **extra)
    return done, extra, aside


def refuse_mismatch(folder, identity: dict, overwrite: bool = False) -> None:
    """Refuse ``folder`` unless a scoring run with ``identity`` can write it: never one of another
    kind or holding other files; unless ``overwrite``, one scored with another identity. The
    advice says what ``overwrite=true`` deletes, and for another corpus names ``data.name=``."""
    refuse_kind_mismatch(folder, identity, SCORED, overwrite, hint=corpus_hint(folder, identity))


# The corpus's settings besides its limit: equal in both, a differing data.limit_docs is the difference
# (the limit decides which files are hashed, so the files' digest differs with it).
SAME_CORPUS_KEYS = ("name", "source", "hub_id", "hub_config", "split", "revision", "text_column", "rows_per_shard")


def limit_hint(name, old_limit, new_limit) -> str:
    """One line for a folder that holds the same corpus cut at another ``data.limit_docs``."""
    def limit(n):
        return "null (every document)" if n is None else str(n)
    return (f"That folder holds corpus {name!r} scored with data.limit_docs={limit(old_limit)}, this run "
            f"asks for data.limit_docs={limit(new_limit)}: give data.limit_docs={limit(old_limit)} to go on with it, "
            "or overwrite=true (below) to score the new limit there.")


def corpus_hint(folder, identity: dict) -> str:
    """For a folder that holds another corpus: give this one a name (and so a folder) of its own."""
    path = sfs.child(folder, MANIFEST_NAME)
    try:
        old = json.loads(sfs.read_bytes(path)).get("identity", {}).get("corpus", {}) if sfs.exists(path) else {}
    except (json.JSONDecodeError, AttributeError, OSError):
        return ""
    new = identity.get("corpus", {})
    if not isinstance(old, dict) or not old or all(old.get(k) == new.get(k) for k in ("files_sha256", "source", "hub_id")):
        return ""
    if old.get("limit_docs") != new.get("limit_docs") and all(old.get(k) == new.get(k) for k in SAME_CORPUS_KEYS):
        return limit_hint(old.get("name"), old.get("limit_docs"), new.get("limit_docs"))
    return (f"That folder holds another corpus ({old.get('name')!r}): to score yours beside it, give it a name of its "
            "own, data.name=<a name for your corpus> (its folder is named after it).")


def write_manifest(
    folder: str | os.PathLike,
    identity: dict,
    done: dict[int, dict],
    n_planned: int,
    code_version: str | None = None,
    *,
    location: dict | None = None,
    failed: list[dict] | None = None,
    license: str | None = None,
    rehearsal: str | None = None,
    teacher_origin: dict | None = None,
) -> dict:
    """Write ``manifest.json`` from the finished shards' entries. ``location`` (where the teacher
    and corpus were found) is for people and never compared; ``failed`` lists the shards the
    run gave up on (index, error, attempts), which have no marker and are scored by the next run;
    ``license`` is the corpus's as its user gave it (``data.license``), for the card, not compared;
    ``teacher_origin`` the teacher's license, base model and GGUF file
    (:func:`pipeline.folders.model_source.teacher_origin`), for the card, not compared;
    ``rehearsal`` says the losses are a rehearsal's (:mod:`pipeline.folders.rehearsal`)."""
    shards = [done[i] for i in sorted(done)]
    reasons: dict[str, int] = {}
    for entry in shards:
        for reason, count in entry["reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    totals = {
        "shards": len(shards),
        "documents": sum(e["rows"] for e in shards),
        "tokens": sum(e["tokens"] for e in shards),
        "bytes": sum(e["bytes"] for e in shards),
        "reasons": dict(sorted(reasons.items())),
    }
    extra = {"location": location} if location is not None else {}
    if failed is not None:
        extra["failed"] = sorted(failed, key=lambda f: f["index"])
    if license is not None:
        extra["license"] = license
    if teacher_origin:
        extra["teacher_origin"] = teacher_origin
    if rehearsal:
        extra["rehearsal"] = rehearsal
    manifest = manifest_of(SCORED, identity, done, n_planned, totals, code_version=code_version, **extra)
    try:
        write_json_atomic(sfs.child(folder, MANIFEST_NAME), manifest)
    except OSError as exc:  # a full or read-only disk: one clear line, as a shard's write gives it
        storage = storage_error(exc, f"{sfs.child(folder, MANIFEST_NAME)} could not be written")
        if storage is None:
            raise
        raise storage from None
    return manifest
