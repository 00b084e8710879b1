"""Where a scored dataset lives and what its folder holds (docs/METHOD.md §1.4, §1.5)::

    <root>/<corpus>/<teacher>/v<SCHEMA_VERSION>/     dataset_dir(root, corpus, teacher)
      manifest.json              the dataset's identity, its shards and their checksums
      shard-000000.parquet       one row per document (storage_schemas.schema)
      shard-000000.done.json     completion marker: written after the shard was renamed into place

On an object store (``s3://``, ``gs://``), where nothing can be renamed, each attempt at a shard
writes its own object, named with a random attempt token, and its own marker::

      shard-000000.<attempt>.parquet     one PUT: the object appears whole or not at all
      shard-000000.<attempt>.done.json   written last: names the object, its size and sha256

A shard's marker is always :func:`marker_of` its file name. A shard without a marker is unfinished
and never listed in the manifest; readers use the shards the manifest lists, and accept both
layouts. :func:`shard_file_problems` is the one check of a shard file against its entry.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from storage_schemas import filesystem as sfs
from storage_schemas.schema import SCHEMA_VERSION, ContractError

MANIFEST_NAME = "manifest.json"
CARD_NAME = "README.md"  # the dataset card (pipeline.folders.dataset_card), derived from the manifest
# shard-NNNNNN.parquet (local) or shard-NNNNNN.<attempt>.parquet (object store)
SHARD_RE = re.compile(r"^shard-(\d{6})(?:\.([0-9a-f]{8,32}))?\.parquet$")
MARKER_SUFFIX = ".done.json"


def dataset_dir(root: str | os.PathLike, corpus: str, teacher: str) -> Path | str:
    """The folder of the dataset of ``corpus`` scored by ``teacher`` under ``root``; the last part
    names the schema version, so data of another version never shares a folder. A local root gives
    a ``Path``, an object-store root (``s3://bucket/scored``) a URI string."""
    if sfs.is_remote(root):
        return sfs.join(os.fspath(root), corpus, teacher, f"v{SCHEMA_VERSION}")
    return Path(root) / corpus / teacher / f"v{SCHEMA_VERSION}"


def shard_name(index: int, attempt: str | None = None) -> str:
    """``shard-000003.parquet``, or with an ``attempt`` token ``shard-000003.<attempt>.parquet``."""
    return f"shard-{index:06d}.parquet" if attempt is None else f"shard-{index:06d}.{attempt}.parquet"


def shard_index(file: str) -> int | None:
    """The shard index a shard file name carries (either layout), ``None`` for any other name."""
    match = SHARD_RE.match(file)
    return int(match.group(1)) if match else None


def marker_name(index: int) -> str:
    return f"shard-{index:06d}{MARKER_SUFFIX}"


def marker_of(shard_file: str) -> str:
    """The marker's name for a shard file name (``shard-000003.parquet`` -> ``shard-000003.done.json``)."""
    return shard_file.removesuffix(".parquet") + MARKER_SUFFIX


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    if sfs.is_remote(path):
        return sfs.sha256(path, chunk)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    path = sfs.child(sfs.location(folder), MANIFEST_NAME)
    if not sfs.is_file(path):
        raise ContractError(f"{folder}: no {MANIFEST_NAME}; not a scored dataset (or scoring never started)")
    try:
        manifest = json.loads(sfs.read_bytes(path))
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


def strict_json(obj: Any) -> Any:
    """``obj`` made strict JSON: NaN and infinities to null, NumPy scalars to Python numbers, keys
    to strings, tuples to lists, anything else unknown to its ``str``."""
    if isinstance(obj, dict):
        return {str(k): strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and not isinstance(obj, (str, bytes)):
        obj = obj.item()  # a NumPy scalar
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON so that readers see the old or the new file, never a part (:func:`write_bytes_atomic`)."""
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write a file so that readers see the old or the new one, never a part: locally under a
    temporary name, fsynced, then renamed; on an object store in one PUT (an object appears whole)."""
    if sfs.is_remote(path):
        sfs.write_bytes(path, data)
        return
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():  # the write failed (a full disk): no half-written file is left
            tmp.unlink()


def complete_shard_files(folder: str | os.PathLike) -> list[Path | str]:
    """The shard files a reader may use: those listed in the manifest, in order (``Path`` for a
    local folder, URI strings for an object store)."""
    manifest = read_manifest(folder)
    return [sfs.child(sfs.location(folder), e["file"]) for e in manifest["shards"]]


def shard_file_problems(path: Path | str, entry: dict, *, checksum: bool, marker: bool = False) -> list[tuple[str, str]]:
    """Every way the file ``path`` disagrees with its manifest ``entry``, as ``(file name, problem)``
    pairs: missing, size, and with ``checksum`` its sha256; with ``marker`` also its completion
    marker, which must equal the entry (but for the seconds it took). The footer, identity and row
    count need the file's metadata: :func:`storage_schemas.reader.shard_problems` adds them."""
    name = sfs.name(path)
    size = sfs.size(path)
    if size is None:
        return [(name, "listed in the manifest but missing from the folder")]
    problems = []
    if size != entry.get("bytes"):
        problems.append((name, f"{size} bytes on disk, manifest says {entry.get('bytes')} (truncated or rewritten)"))
    if checksum:
        digest = file_sha256(path)
        if digest != entry.get("sha256"):
            said = str(entry.get("sha256"))[:16]
            problems.append((name, f"checksum mismatch: sha256 {digest[:16]}..., manifest says {said}..."))
    if marker:
        problems += _marker_problems(path, entry)
    return problems


def _marker_problems(path: Path | str, entry: dict) -> list[tuple[str, str]]:
    index = entry.get("index")
    name = sfs.name(path)
    done = sfs.child(sfs.parent(path), marker_of(name)) if isinstance(index, int) else None
    if done is None or not sfs.is_file(done):
        return [(name, "no completion marker (.done.json) for a listed shard")]
    try:
        on_disk = json.loads(sfs.read_bytes(done))
    except json.JSONDecodeError as exc:
        return [(sfs.name(done), f"unreadable marker ({exc})")]
    differ = sorted(k for k in set(on_disk) | set(entry) if k != "seconds" and on_disk.get(k) != entry.get(k))
    if differ:
        return [(sfs.name(done), f"marker differs from the manifest entry in {', '.join(differ)}")]
    return []
