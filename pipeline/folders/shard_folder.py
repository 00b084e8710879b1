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
* A folder holding another kind of output, or files that are no output's (a student run, say), is
  refused whatever ``overwrite`` says (:func:`foreign_problem`). One of the same kind made with
  another identity is refused with the list of differences (:func:`folder_problem`), unless
  ``overwrite``: its shards are then set aside and deleted once the new run has finished its first
  shard, or put back if it fails before (:mod:`pipeline.folders.output_folder`). The manifest
  (``manifest.json``) is the folder's truth; readers use the shards it lists; each stage writes its
  own from the markers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from pipeline.runtime.config import UserError
from pipeline.folders.folder_lock import LOCK_NAME
from pipeline.folders.output_folder import SetAside, describe, owned_entries, recover, set_aside
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
        stale = folder / marker_of(_name(index, MAIN_SUFFIX))  # a marker of the files replaced (a shard scored again)
        if stale.exists():
            stale.unlink()  # first: a stop before the new marker leaves the shard to be scored again, never misnamed
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


def prepare_folder(folder: str | os.PathLike, identity: dict, overwrite: bool, kind: FolderKind,
                   hint: str = "") -> tuple[dict[int, dict], SetAside | None]:
    """Make ``folder`` ready for a run with ``identity``; returns the finished shards' entries and,
    when ``overwrite`` replaced an output, what it set aside (the caller commits it once the new
    run has finished a shard, or restores it if the run fails first; None: nothing set aside).

    Puts back what an overwrite killed before its first shard had set aside. Refuses
    (:class:`DatasetMismatchError`) a folder of another kind or with files of no output
    (whatever ``overwrite`` says), and one of another identity or holding shards without a
    manifest unless ``overwrite`` (``hint``: the stage's own advice, first). Leftover temporary
    files are removed, and on an object store every object no winning marker names."""
    remote = sfs.is_remote(folder)
    folder = os.fspath(folder) if remote else Path(folder)
    aside = None
    if not remote and folder.exists() and not folder.is_dir():
        raise DatasetMismatchError(f"{folder}: exists and is not a folder")
    if not remote:
        recover(folder, output_entries(kind))
    if remote or folder.is_dir():
        refuse_mismatch(folder, identity, kind, overwrite, hint)
        if overwrite and folder_problem(folder, identity, kind):
            if remote:
                clear_folder(folder, kind)  # no rename there: deleted once every check has passed
            else:
                aside = set_aside(folder, output_entries(kind))
    if not remote:
        folder.mkdir(parents=True, exist_ok=True)
        for leftover in folder.glob(".*.tmp-*"):
            leftover.unlink()
    done = finished_shards(folder)
    remove_unreferenced(folder, done)
    return done, aside


def refuse_mismatch(folder: Path | str, identity: dict, kind: FolderKind, overwrite: bool, hint: str = "") -> None:
    """Raise :class:`DatasetMismatchError` unless ``folder`` can take this run: never for a folder
    of another kind or holding files of no output; unless ``overwrite`` for another identity.
    The advice names what ``overwrite=true`` deletes (``hint``: the stage's own advice, first)."""
    foreign = foreign_problem(folder, kind)
    if foreign:
        raise DatasetMismatchError(f"{foreign}; whatever overwrite says, {kind.what}s go to a folder of their own: "
                                   "choose another output_dir")
    problem = folder_problem(folder, identity, kind)
    if problem and not overwrite:
        ways = [hint] if hint else []
        ways.append(f"Choose another output folder, or pass overwrite=true to {kind.redo}: {overwrite_deletes(folder, kind)}")
        raise DatasetMismatchError(problem + "\n" + "\n".join(ways))


def overwrite_deletes(folder: Path | str, kind: FolderKind) -> str:
    """What ``overwrite=true`` deletes in ``folder``, and when, for the refusal's advice."""
    names = sfs.file_sizes(folder)
    shards = sorted({n.split(".", 1)[0] for n in names if ANY_SHARD_FILE.match(n)})
    derived = [n for n in kind.derived if n in names]
    if not sfs.is_remote(folder):  # and the reports of the old shards (inspect/): all it sets aside
        derived += [f"{p.name}/" for p in owned_entries(Path(folder), output_entries(kind))
                    if p.is_dir() and not p.name.startswith(".")]
    what = f"its {len(shards)} shard(s) ({describe(shards, 3)})" if shards else "its shard files (none now)"
    what += f" and {', '.join(derived)}" if derived else ""
    when = ("at once (an object store cannot set them aside)" if sfs.is_remote(folder)
            else "once the new run has finished its first shard (they are put back if it fails before)")
    return f"it deletes {what}, {when}; the folder's other files stay."


def folder_problem(folder: Path | str, identity: dict, kind: FolderKind) -> str | None:
    """Why ``folder`` cannot take a run of ``kind`` with ``identity`` (None: it can) that
    ``overwrite`` may resolve: another identity or version, an unreadable manifest, shards
    without a manifest."""
    manifest_path = sfs.child(folder, MANIFEST_NAME)
    if sfs.exists(manifest_path):
        try:
            old = json.loads(sfs.read_bytes(manifest_path))
        except json.JSONDecodeError as exc:
            return f"{manifest_path}: unreadable manifest ({exc})"
        if not isinstance(old, dict) or kind.version_key not in old:
            return None  # another kind: foreign_problem
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


def foreign_problem(folder: Path | str, kind: FolderKind) -> str | None:
    """Why ``folder`` is no place for a ``kind`` whatever ``overwrite`` says (None: it may be):
    its manifest is another kind's, or it has no manifest and holds entries no output of this
    kind has (a student run's ``run.json`` and checkpoints, a model; hidden files are passed over)."""
    manifest_path = sfs.child(folder, MANIFEST_NAME)
    if sfs.exists(manifest_path):
        try:
            old = json.loads(sfs.read_bytes(manifest_path))
        except json.JSONDecodeError:
            return None  # folder_problem names it
        if not isinstance(old, dict) or kind.version_key not in old:
            return f"{folder}: holds another kind of output (its {MANIFEST_NAME} is not a {kind.what}'s)"
        return None
    if sfs.is_remote(folder):
        other = [n for n in sfs.file_sizes(folder) if n != LOCK_NAME and not is_output_name(n, kind)]
    else:
        owned = output_entries(kind)
        other = [p.name for p in Path(folder).iterdir() if not p.name.startswith(".") and not owned(p)]
    if other:
        return f"{folder}: is not empty and holds no {kind.what} ({describe(other, 4)})"
    return None


def is_output_name(name: str, kind: FolderKind) -> bool:
    """A file of an output of ``kind``: a shard's file, part or marker, a file derived from them,
    or a temporary file."""
    return bool(ANY_SHARD_FILE.match(name)) or name in kind.derived or (name.startswith(".") and ".tmp-" in name)


def output_entries(kind: FolderKind):
    """Which entries of a local folder belong to an output of ``kind`` (what ``overwrite=true``
    replaces): its files (:func:`is_output_name`), hidden folders and the ``inspect/`` reports
    (made by ``make inspect``, they describe the old shards). The lock is never one."""
    def owned(path: Path) -> bool:
        if path.is_dir() and not path.is_symlink():
            return path.name.startswith(".") or path.name == "inspect"
        return is_output_name(path.name, kind)
    return owned


def clear_folder(folder: str, kind: FolderKind) -> None:
    """On an object store: delete every shard object, part and marker and the objects derived
    from them. The lock stays."""
    for name in sfs.file_sizes(folder):
        if name != LOCK_NAME and is_output_name(name, kind):
            sfs.delete(sfs.child(folder, name))


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
    except (OSError, json.JSONDecodeError) as exc:
        if sfs.unavailable(exc):
            raise  # the store did not answer: the marker may well be there
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
