"""Check every invariant of the scored-dataset contract, over every shard, and list every problem.

Nothing stops at the first problem: :func:`validate_dataset` returns all of them, each naming the
file and, for row problems, the row and the document. Errors break the contract (a reader would
get wrong data or fail); warnings are legal but worth a look (a partial dataset, leftover
temporary files, NaN losses where the method expects a prediction).

The folder and the manifest
    ``manifest.json`` readable, of this schema version, with an identity; entries named after their
    index, no index twice; totals (shards, documents, tokens, bytes, reasons) equal to the sums of
    the entries; ``complete`` consistent with ``n_shards_planned``; every listed shard present with
    its marker (``shard-NNNNNN.done.json``, or ``shard-NNNNNN.<attempt>.done.json`` on an object
    store) equal to its entry; no finished or unfinished shard file in the folder that the manifest
    does not list. The folder may be local or on an object store.
Each listed shard
    size and sha256 as in the manifest; a readable Parquet file with the contract's metadata and
    schema; its identity equal to the manifest's (or, for a shard written before the folder's
    identity was migrated, to the one it was adopted from), its shard index equal to its entry's;
    as many rows and tokens as the entry says.
Each row (:func:`storage_schemas.rows.table_problems`, :data:`BATCH_ROWS` rows at a time)
    ``doc_id`` non-empty and unique in the dataset; the four lists of equal length; every span
    inside the text (``0 <= start <= end <= len(text)``), starts non-decreasing, text slices
    non-empty except for ``special_ids``; token ids in ``[0, vocab_size)`` when the identity gives
    the vocabulary size; losses finite or NaN (never infinite) and not negative.
    Warnings: a NaN loss past the first token (every later token has left context), the first
    token's loss NaN although a BOS preceded it, or finite although none did.

The file checks are the reader's (:func:`storage_schemas.reader.shard_problems`) and the row checks
the contract's; this module adds what needs the whole folder. Memory: one batch of rows, plus
one 64-bit hash per document for the uniqueness check; checksums are streamed (docs/METHOD.md §1.4).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from storage_schemas import (
    MANIFEST_NAME,
    SHARD_RE,
    ContractError,
    RowRules,
    marker_of,
    read_manifest,
    shard_index,
    table_problems,
)
from storage_schemas import filesystem as sfs
from storage_schemas.layout import shard_file_problems
from storage_schemas.reader import shard_problems
from storage_schemas.rows import ERROR, WARNING, list_column_values

BATCH_ROWS = 128  # rows checked at a time: memory stays flat whatever the shard's size

@dataclass(frozen=True)
class Problem:
    severity: str  # "error" | "warning"
    file: str  # file name inside the dataset folder
    message: str
    row: int | None = None
    doc_id: str | None = None

    def __str__(self) -> str:
        where = self.file
        if self.row is not None:
            where += f" row {self.row}"
        if self.doc_id is not None:
            where += f" doc {self.doc_id!r}"
        return f"{self.severity}: {where}: {self.message}"


@dataclass(frozen=True)
class ValidationReport:
    folder: str
    problems: list[Problem]
    shards_checked: int
    rows_checked: int

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == WARNING]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {"folder": self.folder, "ok": self.ok, "shards_checked": self.shards_checked,
                "rows_checked": self.rows_checked, "errors": len(self.errors), "warnings": len(self.warnings),
                "problems": [asdict(p) for p in self.problems]}


def validate_markers(folder: str | os.PathLike) -> ValidationReport:
    """The folder-level part of :func:`validate_dataset` alone: the manifest, the files the folder
    holds, and each listed shard's size and marker against its entry; no shard is opened. What a
    folder of many shards costs to check, whatever their size."""
    folder = sfs.location(folder)
    problems: list[Problem] = []
    manifest = _check_manifest(folder, problems)
    entries = _listed_entries(folder, manifest, problems)
    _check_folder_files(folder, entries, problems)
    for name, entry in entries.items():
        if entry is not None:
            problems.extend(Problem(ERROR, file, message) for file, message in
                            shard_file_problems(sfs.child(folder, name), entry, checksum=False, marker=True))
    return ValidationReport(str(folder), problems, shards_checked=len(entries), rows_checked=0)


def validate_dataset(
    folder: str | os.PathLike, checksums: bool = True, special_ids: Iterable[int] = ()
) -> ValidationReport:
    """Every problem of the dataset in ``folder``; ``checksums=False`` skips the sha256 pass."""
    folder = sfs.location(folder)
    problems: list[Problem] = []
    manifest = _check_manifest(folder, problems)
    entries = _listed_entries(folder, manifest, problems)
    _check_folder_files(folder, entries, problems)
    identity = (manifest or {}).get("identity") or {}
    rules = RowRules.from_identity(identity, special_ids)
    rows = 0
    hashes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, entry in entries.items():
        rows += _check_shard(folder, name, entry, manifest or {}, rules, checksums, problems, hashes)
    _check_unique_ids(folder, hashes, problems)
    return ValidationReport(str(folder), problems, shards_checked=len(entries), rows_checked=rows)


# --------------------------------------------------------------------------------------------
# Manifest and folder
# --------------------------------------------------------------------------------------------


def _check_manifest(folder: Path | str, problems: list[Problem]) -> dict | None:
    try:
        manifest = read_manifest(folder)
    except ContractError as exc:
        problems.append(Problem(ERROR, MANIFEST_NAME, str(exc)))
        return None
    if not manifest.get("identity"):
        problems.append(Problem(ERROR, MANIFEST_NAME, "no identity (teacher, windows, corpus)"))
    entries = manifest.get("shards", [])
    seen: set[int] = set()
    for entry in entries:
        index = entry.get("index")
        file = entry.get("file")
        if not isinstance(index, int) or not isinstance(file, str) or shard_index(file) != index:
            problems.append(Problem(ERROR, MANIFEST_NAME, f"entry {entry.get('file')!r} has index {index!r}"))
        if index in seen:
            problems.append(Problem(ERROR, MANIFEST_NAME, f"shard index {index} listed twice"))
        seen.add(index)
    _check_totals(manifest, entries, problems)
    planned = manifest.get("n_shards_planned")
    if manifest.get("complete") != (len(entries) == planned):
        listed = f"{len(entries)} of {planned} planned shards are listed"
        problems.append(Problem(ERROR, MANIFEST_NAME, f"complete={manifest.get('complete')!r} but {listed}"))
    elif not manifest.get("complete"):
        listed = f"{len(entries)} of {planned} planned shards"
        problems.append(Problem(WARNING, MANIFEST_NAME, f"partial dataset: {listed} (scoring unfinished)"))
    return manifest


def _check_totals(manifest: dict, entries: list[dict], problems: list[Problem]) -> None:
    totals = manifest.get("totals") or {}
    reasons: dict[str, int] = {}
    for entry in entries:
        for reason, count in (entry.get("reasons") or {}).items():
            reasons[reason] = reasons.get(reason, 0) + count
    expected = {
        "shards": len(entries),
        "documents": sum(e.get("rows", 0) for e in entries),
        "tokens": sum(e.get("tokens", 0) for e in entries),
        "bytes": sum(e.get("bytes", 0) for e in entries),
        "reasons": dict(sorted(reasons.items())),
    }
    for key, want in expected.items():
        got = totals.get(key)
        if (dict(sorted(got.items())) if isinstance(got, dict) else got) != want:
            problems.append(Problem(ERROR, MANIFEST_NAME, f"totals.{key} is {got!r}, the shard entries sum to {want!r}"))


def _listed_entries(folder: Path | str, manifest: dict | None, problems: list[Problem]) -> dict[str, dict | None]:
    """Shard file name -> manifest entry; without a manifest, the shard files found (no entry)."""
    if manifest is not None:
        return {e["file"]: e for e in manifest.get("shards", []) if "file" in e}
    found = sorted(name for name in sfs.file_sizes(folder) if SHARD_RE.match(name))
    if found:
        problems.append(Problem(WARNING, MANIFEST_NAME, f"checking the {len(found)} shard files found without a manifest"))
    return {name: None for name in found}


def _check_folder_files(folder: Path | str, entries: dict[str, dict | None], problems: list[Problem]) -> None:
    names = sfs.file_sizes(folder)
    for name in sorted(names):
        if SHARD_RE.match(name) and name not in entries:
            state = "finished (it has a marker): rerun score-teacher to rewrite the manifest" if marker_of(name) in names \
                else "unfinished (no marker): a rerun of score-teacher redoes it"
            problems.append(Problem(ERROR, name, f"shard missing from the manifest; {state}"))
        elif name.startswith(".") and ".tmp-" in name:
            problems.append(Problem(WARNING, name, "temporary file left by an interrupted write "
                                                   "(removed by the next score-teacher run)"))
        elif name.endswith(".done.json") and name.replace(".done.json", ".parquet") not in entries:
            if name.replace(".done.json", ".parquet") not in names:
                problems.append(Problem(ERROR, name, "marker of a shard file that does not exist"))


# --------------------------------------------------------------------------------------------
# One shard
# --------------------------------------------------------------------------------------------


def _check_shard(
    folder: Path | str, name: str, entry: dict | None, manifest: dict, rules: RowRules, checksums: bool,
    problems: list[Problem], hashes: dict[str, tuple[np.ndarray, np.ndarray]],
) -> int:
    """Check one shard (file, metadata, rows); returns the number of rows read."""
    check = shard_problems(folder, entry, manifest, checksum=checksums, marker=True, file=name)
    problems.extend(Problem(ERROR, file, message) for file, message in check.problems)
    if check.meta is None:
        return 0
    rows = tokens = 0
    ids_hashed, ids_rows = [], []
    try:
        shard = sfs.parquet_file(sfs.child(folder, name))
        for table in shard.iter_batches(batch_size=BATCH_ROWS, use_threads=False):  # no thread pool per shard
            problems.extend(Problem(p.severity, name, p.message, row=p.row, doc_id=p.doc_id)
                            for p in table_problems(table, rules, first_row=rows))
            doc_ids = table.column("doc_id").to_pylist()
            present = [r for r, d in enumerate(doc_ids) if d]  # empty ids are reported as such
            ids_hashed.append(np.fromiter((hash(doc_ids[r]) for r in present), np.int64, len(present)))
            ids_rows.append(np.asarray(present, np.int64) + rows)
            tokens += int(np.diff(list_column_values(table, "token_ids")[1]).sum())
            rows += table.num_rows
    except Exception as exc:  # a file whose footer reads but whose pages do not
        problems.append(Problem(ERROR, name, f"rows unreadable: {type(exc).__name__}: {str(exc).splitlines()[0]}"))
        return rows
    hashes[name] = (np.concatenate(ids_hashed or [np.zeros(0, np.int64)]), np.concatenate(ids_rows or [np.zeros(0, np.int64)]))
    if entry is not None and tokens != entry.get("tokens"):
        problems.append(Problem(ERROR, name, f"{tokens} tokens, manifest says {entry.get('tokens')}"))
    return rows


def _check_unique_ids(folder: Path | str, hashes: dict[str, tuple[np.ndarray, np.ndarray]], problems: list[Problem]) -> None:
    """Duplicate ``doc_id``s: equal 64-bit hashes first, then the ids themselves (no false alarm
    on a hash collision)."""
    if not hashes:
        return
    every = np.concatenate([h for h, _ in hashes.values()])
    values, counts = np.unique(every, return_counts=True)
    repeated = values[counts > 1]
    if not repeated.size:
        return
    candidates: list[tuple[str, int, str]] = []  # (file, row, doc_id)
    for file, (hashed, rows) in hashes.items():
        picked = rows[np.isin(hashed, repeated)]
        if picked.size:
            table = sfs.parquet_file(sfs.child(folder, file)).read(columns=["doc_id"])
            doc_ids = table.column("doc_id").take(picked).to_pylist()
            candidates += [(file, int(r), d) for r, d in zip(picked.tolist(), doc_ids)]
    seen: dict[str, int] = {}
    for _, _, doc_id in candidates:
        seen[doc_id] = seen.get(doc_id, 0) + 1
    for file, row, doc_id in candidates:
        if seen[doc_id] > 1:
            problems.append(Problem(ERROR, file, "doc_id is not unique in the dataset", row=row, doc_id=doc_id))


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def write_report(report: ValidationReport, out_dir: str | os.PathLike) -> Path:
    """``validation.json`` with every problem, in ``out_dir``; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "validation.json"
    path.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return path

