"""The scored-dataset contract between stage 1 (score-teacher) and everything that reads it.

A scored dataset is a folder::

    <dataset>/
      manifest.json              the dataset's identity, its shards and their checksums
      shard-000000.parquet       one row per document (schema below)
      shard-000000.done.json     completion marker: written after the shard was renamed into place
      ...

Row schema (version 1), one row per document:

============  ===============  ==============================================================
column        type             meaning
============  ===============  ==============================================================
doc_id        string           stable id of the document (source file + row), unique
text          string           exactly the text that was scored
token_ids     list<int32>      teacher token ids (no BOS/EOS: only tokens of ``text``)
starts        list<int32>      character (Python ``str``) offset where each token starts
ends          list<int32>      character offset where each token ends (exclusive)
losses        list<float32>    -log p_teacher(token | left context); NaN where no prediction
============  ===============  ==============================================================

Every shard carries Parquet key-value metadata under the keys in :data:`META_KEYS` (all JSON
strings). This module depends on pyarrow and the standard library only.

The dataset identity (``manifest.json``'s ``identity``, and each shard's ``vocagno.identity``) says
what produced the data, never where it sits: the teacher by hub id and revision or by the digests
of its config and weights, its tokenizer by digest, the corpus by file names, row counts, sizes and
content digests (identity format :data:`IDENTITY_FORMAT`). Where the teacher and the corpus were
found is kept apart, in the manifest's ``location``, for people; it is never compared. A manifest
written before this format (no ``format`` key) is adopted with ``migrate_identity=true``: its old
identity is kept as ``adopted_from``, and shards written under it stay valid
(:func:`shard_identity_differences`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1

ROW_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("starts", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("ends", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("losses", pa.list_(pa.field("item", pa.float32(), nullable=False)), nullable=False),
    ]
)
LIST_COLUMNS = ("token_ids", "starts", "ends", "losses")

# Parquet key-value metadata keys (values are JSON).
META_SCHEMA_VERSION = "vocagno.schema_version"
META_IDENTITY = "vocagno.identity"  # teacher, tokenizer, dtype, window/stride, corpus, shard plan
META_SHARD = "vocagno.shard"  # this shard's index and source range
META_CODE_VERSION = "vocagno.code_version"
META_KEYS = (META_SCHEMA_VERSION, META_IDENTITY, META_SHARD, META_CODE_VERSION)

IDENTITY_FORMAT = 2  # the identity holds content digests, no locations (module docstring)
MANIFEST_NAME = "manifest.json"
SHARD_RE = re.compile(r"^shard-(\d{6})\.parquet$")


class ContractError(ValueError):
    """A file or folder that breaks the scored-dataset contract."""


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.parquet"


def marker_name(index: int) -> str:
    return f"shard-{index:06d}.done.json"


def schema_with_metadata(identity: Mapping[str, Any], shard: Mapping[str, Any], code_version: str) -> pa.Schema:
    meta = {
        META_SCHEMA_VERSION: json.dumps(SCHEMA_VERSION),
        META_IDENTITY: json.dumps(identity, sort_keys=True),
        META_SHARD: json.dumps(shard, sort_keys=True),
        META_CODE_VERSION: json.dumps(code_version),
    }
    return ROW_SCHEMA.with_metadata(meta)


def read_shard_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The decoded key-value metadata of one shard; raises :class:`ContractError` if absent."""
    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise ContractError(f"{path}: not a readable Parquet file ({exc})") from exc
    raw = schema.metadata or {}
    missing = [k for k in META_KEYS if k.encode() not in raw]
    if missing:
        raise ContractError(f"{path}: missing shard metadata keys {missing}")
    meta = {k: json.loads(raw[k.encode()]) for k in META_KEYS}
    if meta[META_SCHEMA_VERSION] != SCHEMA_VERSION:
        raise ContractError(
            f"{path}: schema version {meta[META_SCHEMA_VERSION]}, this code reads version {SCHEMA_VERSION}"
        )
    check_schema(schema, where=str(path))
    return meta


def check_schema(schema: pa.Schema, where: str) -> None:
    got = pa.schema([schema.field(n) for n in schema.names]).remove_metadata()
    want = ROW_SCHEMA
    if [f.name for f in got] != [f.name for f in want]:
        raise ContractError(f"{where}: columns {got.names}, expected {want.names}")
    for g, w in zip(got, want):
        if not g.type.equals(w.type):
            raise ContractError(f"{where}: column {g.name!r} has type {g.type}, expected {w.type}")


def check_rows(table: pa.Table, where: str) -> list[str]:
    """Row-level invariants of the contract; returns a list of problems (empty if none)."""
    problems = []
    cols = {c: table.column(c).to_pylist() for c in ("doc_id", "text", *LIST_COLUMNS)}
    for r, doc_id in enumerate(cols["doc_id"]):
        text = cols["text"][r]
        lists = [cols[c][r] for c in LIST_COLUMNS]
        n = len(lists[0])
        if any(len(x) != n for x in lists):
            problems.append(f"{where} row {r} doc {doc_id!r}: list lengths differ {[len(x) for x in lists]}")
            continue
        prev = 0
        for s, e in zip(cols["starts"][r], cols["ends"][r]):
            if not (0 <= s <= e <= len(text)):
                problems.append(f"{where} row {r} doc {doc_id!r}: span ({s},{e}) outside text of length {len(text)}")
                break
            if s < prev:
                problems.append(f"{where} row {r} doc {doc_id!r}: starts decrease at ({s},{e})")
                break
            prev = s
        if any(x in (float("inf"), float("-inf")) for x in cols["losses"][r]):
            problems.append(f"{where} row {r} doc {doc_id!r}: infinite loss (NaN is allowed, inf is not)")
    return problems


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise ContractError(f"{folder}: no {MANIFEST_NAME}; not a scored dataset (or scoring never started)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ContractError(f"{path}: not valid JSON ({exc})") from exc
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ContractError(
            f"{path}: schema version {manifest.get('schema_version')!r}, this code reads version {SCHEMA_VERSION}"
        )
    for entry in manifest.get("shards", []):
        name = entry.get("file", "")
        if not SHARD_RE.match(name):  # plain file names only: nothing can point outside the folder
            raise ContractError(f"{path}: shard entry {name!r} is not a shard file name of this folder")
    return manifest


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON under a temporary name, fsync, then rename: readers see the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_shard_files(folder: str | os.PathLike) -> list[Path]:
    """The shard files a reader may use: those listed in the manifest, in order."""
    manifest = read_manifest(folder)
    return [Path(folder) / e["file"] for e in manifest["shards"]]


def iter_identity_differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    """Human-readable differences between two identity dicts (nested), for clear refusals."""
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        name = f"{prefix}{key}"
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            yield from iter_identity_differences(va, vb, prefix=name + ".")
        elif va != vb:
            yield f"{name}: {va!r} != {vb!r}"


def identity_format(identity: Mapping[str, Any]) -> int:
    """The identity's format: 1 for identities written before the format was recorded."""
    return int(identity.get("format", 1))


def shard_identity_differences(shard_identity: Mapping[str, Any], manifest: Mapping[str, Any]) -> list[str]:
    """How a shard's identity differs from its folder's: none when it equals the manifest's
    identity, or the identity the folder had before it was migrated (``adopted_from``)."""
    adopted = manifest.get("adopted_from")
    if adopted is not None and dict(shard_identity) == adopted:
        return []
    return list(iter_identity_differences(shard_identity, manifest.get("identity") or {}))
