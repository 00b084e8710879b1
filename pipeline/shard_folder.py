"""Exactly-once shards in an output folder, for every stage that writes one: stage 1's scored
folders and the export's student-side folders (docs/METHOD.md §1.5).

* A shard is one file ``shard-NNNNNN.parquet`` or several files named after it, its *parts*
  (``shard-NNNNNN.input_ids.bin`` ...). Locally each file is written under a temporary name
  (``.shard-NNNNNN....tmp-<random>``), fsynced and renamed; only then is the shard's marker
  ``shard-NNNNNN.done.json`` written (atomically), naming every file with its size and sha256.
* On an object store (``s3://``, ``gs://``: no rename) each attempt PUTs every file whole under
  its own names ``shard-NNNNNN.<attempt>.parquet``, ``shard-NNNNNN.<attempt>.input_ids.bin`` ...,
  then its marker ``shard-NNNNNN.<attempt>.done.json``. Two finished attempts at one shard hold
  the same rows; the one whose file name sorts first is the shard (:func:`finished_shards`). Objects
  no winning marker names are deleted when a run starts and ends (:func:`remove_unreferenced`).
* A shard without a marker (or whose marked files are missing or of another size) is unfinished
  and is redone whole by the next run.
* A folder holding another kind of output, or the same kind made with another identity, is refused
  with the list of differences (:func:`folder_problem`), unless ``overwrite``, which deletes its
  shards first. The manifest (``manifest.json``) is the folder's truth; readers use the shards it
  lists; each stage writes its own from the markers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from pipeline.config import UserError
from pipeline.folder_lock import LOCK_NAME
from storage_schemas import (
    CARD_NAME,
    MANIFEST_NAME,
    file_sha256,
    iter_identity_differences,
    marker_of,
    shard_index,
    shard_name,
    write_json_atomic,
)
from storage_schemas import filesystem as sfs
from storage_schemas.layout import MARKER_SUFFIX

MAIN_SUFFIX = ".parquet"
MARKER_THREADS = 16  # markers read at once (requests in flight on an object store)
ANY_SHARD_FILE = re.compile(r"^shard-\d{6}\.")  # a shard's file, a part of one, or a marker (either layout)
Part = Callable[..., None]  # writes one or more files of a shard at the (local) paths it is given


class DatasetMismatchError(UserError, RuntimeError):
    """The output folder holds another kind of output, or the same kind made with another identity."""


@dataclass(frozen=True)
class FolderKind:
    """What kind of output a folder holds, as its manifest says (``version_key: version``)."""

    what: str  # "scored dataset" | "student export"
    version_key: str  # the manifest key holding the format version
    version: int
    verb: str  # "scored" | "exported": "<folder> was scored with a different setup"
    redo: str  # what overwrite=true does: "rescore it"
    derived: tuple[str, ...] = (MANIFEST_NAME, CARD_NAME)  # files made from the shards (deleted with them)


# ---------------------------------------------------------------------------------------------
# One shard


def write_shard_files(folder: str | os.PathLike, index: int, parts: Mapping[str | tuple[str, ...], Part]) -> list[dict]:
    """Write every file of shard ``index`` whole (module docstring). ``parts`` maps each file's
    suffix (``.parquet`` first: the shard's main file), or a tuple of suffixes for a writer that
    makes several files at once, to the function writing them (called with one local path per
    suffix). Returns ``{"file", "bytes", "sha256"}`` per file, in the order given; the marker comes
    after (:func:`write_marker`)."""
    jobs = [((key,) if isinstance(key, str) else tuple(key), write) for key, write in parts.items()]
    if sfs.is_remote(folder):
        attempt = uuid.uuid4().hex[:12]
        with tempfile.TemporaryDirectory(prefix="shard-") as scratch:
            return [entry for suffixes, write in jobs
                    for entry in _put(os.fspath(folder), [_name(index, s, attempt) for s in suffixes], write, Path(scratch))]
    folder = Path(folder)
    written: list[tuple[Path, Path]] = []
    try:
        for suffixes, write in jobs:
            pairs = [(folder / f".{final}.tmp-{uuid.uuid4().hex[:12]}", folder / final)
                     for final in (_name(index, s) for s in suffixes)]
            written += pairs
            write(*(tmp for tmp, _ in pairs))
            for tmp, _ in pairs:
                _fsync_file(tmp)
        for tmp, final in written:
            os.replace(tmp, final)
        _fsync_dir(folder)
    finally:
        for tmp, _ in written:
            if tmp.exists():
                tmp.unlink()
    return [{"file": final.name, "bytes": final.stat().st_size, "sha256": file_sha256(final)} for _, final in written]


def write_marker(folder: str | os.PathLike, entry: dict) -> None:
    """The shard's completion marker, written last: ``entry`` names its main file (``file``,
    ``bytes``, ``sha256``) and any other part (``parts``)."""
    write_json_atomic(sfs.child(folder, marker_of(entry["file"])), entry)


def _name(index: int, suffix: str, attempt: str | None = None) -> str:
    return shard_name(index, attempt).removesuffix(MAIN_SUFFIX) + suffix


def _put(folder: str, names: list[str], write: Part, scratch: Path) -> list[dict]:
    """Write files locally, then PUT each under this attempt's own name: the object store makes
    an object visible whole or not at all, and no other attempt writes that name."""
    local = [scratch / name for name in names]
    write(*local)
    entries = []
    for name, path in zip(names, local):
        data = path.read_bytes()
        sfs.write_bytes(sfs.child(folder, name), data)
        entries.append({"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        path.unlink()
    return entries


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
# The folder


def prepare_folder(folder: str | os.PathLike, identity: dict, overwrite: bool, kind: FolderKind) -> dict[int, dict]:
    """Make ``folder`` ready for a run with ``identity``; returns the finished shards' entries.

    Refuses (:class:`DatasetMismatchError`) a folder of another kind or identity, or holding shards
    without a manifest, unless ``overwrite``. Leftover temporary files are removed, and on an
    object store every object no winning marker names."""
    remote = sfs.is_remote(folder)
    folder = os.fspath(folder) if remote else Path(folder)
    if not remote and folder.exists() and not folder.is_dir():
        raise DatasetMismatchError(f"{folder}: exists and is not a folder")
    if remote or folder.is_dir():
        problem = folder_problem(folder, identity, kind)
        if problem and not overwrite:
            raise DatasetMismatchError(f"{problem}\nChoose another output folder, or pass overwrite=true to {kind.redo}.")
        if problem:
            clear_folder(folder, kind)
    if not remote:
        folder.mkdir(parents=True, exist_ok=True)
        for leftover in folder.glob(".*.tmp-*"):
            leftover.unlink()
    done = finished_shards(folder)
    remove_unreferenced(folder, done)
    return done


def folder_problem(folder: Path | str, identity: dict, kind: FolderKind) -> str | None:
    """Why ``folder`` cannot take a run of ``kind`` with ``identity`` (None: it can)."""
    manifest_path = sfs.child(folder, MANIFEST_NAME)
    if sfs.exists(manifest_path):
        try:
            old = json.loads(sfs.read_bytes(manifest_path))
        except json.JSONDecodeError as exc:
            return f"{manifest_path}: unreadable manifest ({exc})"
        if not isinstance(old, dict) or kind.version_key not in old:
            return f"{folder}: holds another kind of output (its {MANIFEST_NAME} is not a {kind.what}'s)"
        if old.get(kind.version_key) != kind.version:
            return (f"{folder}: holds {kind.version_key.replace('_', ' ')} {old.get(kind.version_key)!r}, "
                    f"this code writes {kind.version}")
        diffs = list(iter_identity_differences(old.get("identity", {}), identity))
        if diffs:
            return f"{folder} was {kind.verb} with a different setup:\n  " + "\n  ".join(diffs)
        return None
    if any(shard_index(name) is not None for name in sfs.file_sizes(folder)):
        return f"{folder}: holds shard files but no {MANIFEST_NAME}; its origin is unknown"
    return None


def clear_folder(folder: Path | str, kind: FolderKind) -> None:
    """Delete every shard file, part and marker, the files derived from them and temporary files;
    locally also hidden folders and ``inspect/`` (reports made by ``make inspect`` describe the old
    shards). The lock stays."""
    for name in sfs.file_sizes(folder):
        if name == LOCK_NAME:
            continue
        if ANY_SHARD_FILE.match(name) or name in kind.derived or (name.startswith(".") and ".tmp-" in name):
            sfs.delete(sfs.child(folder, name))
    if isinstance(folder, Path):
        for path in folder.iterdir():
            if path.is_dir() and (path.name.startswith(".") or path.name == "inspect"):
                shutil.rmtree(path)


def parts_of(entry: dict) -> list[dict]:
    """The files a marker names besides the shard's main file (``{"file", "bytes", "sha256"}`` each)."""
    parts = entry.get("parts", [])
    return [p if isinstance(p, dict) else {} for p in parts] if isinstance(parts, list) else [{}]


def finished_shards(folder: str | os.PathLike) -> dict[int, dict]:
    """Entries of the shards whose marker exists and names files of the recorded sizes.

    Where two attempts at one shard both finished (an object store, where a shard the job retried
    had in fact been written), both hold the same rows and the attempt whose file name sorts first
    is the shard: a fixed rule, so every reader of the markers picks the same one."""
    folder = os.fspath(folder) if sfs.is_remote(folder) else Path(folder)
    sizes = sfs.file_sizes(folder)
    done: dict[int, dict] = {}
    markers = sorted(n for n in sizes if n.startswith("shard-") and n.endswith(MARKER_SUFFIX))
    with ThreadPoolExecutor(max_workers=MARKER_THREADS) as pool:  # an object store answers each request late
        read = list(pool.map(lambda name: _read_marker(folder, name), markers))
    for marker, entry in zip(markers, read):
        file = entry.get("file") if isinstance(entry, dict) else None
        index = shard_index(file) if isinstance(file, str) else None
        if index is None or marker_of(file) != marker or entry.get("index") != index:
            continue
        if sizes.get(file) != entry.get("bytes"):
            continue
        if any(p.get("file") not in sizes or sizes[p["file"]] != p.get("bytes") for p in parts_of(entry)):
            continue
        if index not in done or file < done[index]["file"]:
            done[index] = entry
    return done


def _read_marker(folder, name: str):
    """A marker's entry, or None when it is gone since the listing or torn (cannot happen with whole
    writes: never trust it)."""
    try:
        return json.loads(sfs.read_bytes(sfs.child(folder, name)))
    except (OSError, json.JSONDecodeError):
        return None


def remove_unreferenced(folder: str | os.PathLike, done: dict[int, dict]) -> list[str]:
    """On an object store, delete the shard objects, parts and markers that no entry of ``done``
    names (attempts cut short, attempts that lost to another, stale markers); returns their names.
    A local folder is left as it is: its one set of file names per shard is redone in place."""
    if not sfs.is_remote(folder):
        return []
    folder = os.fspath(folder)
    keep = {name for e in done.values() for name in (e["file"], *(p["file"] for p in parts_of(e)), marker_of(e["file"]))}
    stray = [n for n in sfs.file_sizes(folder) if n not in keep and ANY_SHARD_FILE.match(n)]
    for name in stray:
        try:
            sfs.delete(sfs.child(folder, name))
        except FileNotFoundError:
            pass
    return stray


def manifest_of(kind: FolderKind, identity: dict, done: dict[int, dict], n_planned: int, totals: dict,
                **extra) -> dict:
    """The manifest of a folder of ``kind``: its identity, whether it is complete, its totals and
    its finished shards in order; ``extra`` fields (``location``, ``code_version``, ...) added as given."""
    return {kind.version_key: kind.version, "identity": identity, "complete": len(done) == n_planned,
            "n_shards_planned": n_planned, "totals": totals, "shards": [done[i] for i in sorted(done)], **extra}


class ShardProgress:
    """The driver's bookkeeping as shards finish, in constant time per shard: running totals for
    the progress bar, and ``write()`` (the manifest) called when due: at most every ``every_s``
    seconds and, unless ``every_s`` is 0 (after every shard), at least ``spacing`` times its last
    call's duration after it, so that rewriting a manifest of N shards never takes more than
    1/``spacing`` of the driver's time, whatever N. Shared by stage 1's driver and the export."""

    def __init__(self, write, every_s: float, spacing: float = 50.0, clock=time.monotonic):
        self.write, self.every_s, self.spacing, self.clock = write, every_s, spacing, clock
        self.tokens = self.rows = self.shards = 0
        self.started = self.last = clock()
        self.gap = every_s
        self.writes = 0

    def scored(self, entry: dict) -> None:
        self.tokens += int(entry["tokens"])
        self.rows += int(entry["rows"])
        self.shards += 1
        self.due()

    def due(self) -> None:
        """Call ``write()`` if it is due (class docstring)."""
        if self.clock() - self.last <= self.gap:
            return
        t0 = time.perf_counter()
        self.write()
        self.writes += 1
        self.gap = max(self.every_s, self.spacing * (time.perf_counter() - t0)) if self.every_s > 0 else 0.0
        self.last = self.clock()

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.clock() - self.started, 1e-9)
