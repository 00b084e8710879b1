"""Check every invariant of the scored-dataset contract, over every shard, and list every problem.

Nothing stops at the first problem: :func:`validate_dataset` returns all of them, each naming the
file and, for row problems, the row and the document. Errors break the contract (a reader would
get wrong data or fail); warnings are legal but worth a look (a partial dataset, leftover
temporary files, NaN losses where the method expects a prediction).

The folder and the manifest
    ``manifest.json`` readable, of this schema version, with an identity; entries named after their
    index, no index twice; totals (shards, documents, tokens, bytes, reasons) equal to the sums of
    the entries; ``complete`` consistent with ``n_shards_planned``; every listed shard present with
    its marker ``shard-NNNNNN.done.json`` equal to its entry; no finished or unfinished shard file
    in the folder that the manifest does not list.
Each listed shard
    size and sha256 as in the manifest; a readable Parquet file with the contract's metadata and
    schema; its identity equal to the manifest's (or, for a shard written before the folder's
    identity was migrated, to the one it was adopted from), its shard index equal to its entry's;
    as many rows and tokens as the entry says.
Each row (vectorised with Polars to find the rows, then numpy on those rows for the message)
    ``doc_id`` non-empty and unique in the dataset; the four lists of equal length; every span
    inside the text (``0 <= start <= end <= len(text)``), starts non-decreasing, text slices
    non-empty except for ``special_ids``; token ids in ``[0, vocab_size)`` when the identity gives
    the vocabulary size; losses finite or NaN (never infinite) and not negative.
    Warnings: a NaN loss past the first token (every later token has left context), the first
    token's loss NaN although a BOS preceded it, or finite although none did.

Memory: one shard's flags (a few integers per row) at a time, plus one 64-bit hash per document
for the uniqueness check; checksums are streamed.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import polars as pl

from pipeline.inspection.dataset import ENGINE
from storage_schemas import (
    MANIFEST_NAME,
    META_IDENTITY,
    META_SHARD,
        ContractError,
    file_sha256,
    marker_name,
    read_manifest,
    read_shard_metadata,
    shard_name,
)
from storage_schemas.scored import SHARD_RE, shard_identity_differences

ERROR = "error"
WARNING = "warning"
NEGATIVE_LOSS_TOLERANCE = -1e-4  # -log p >= 0; allow float rounding just below zero


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


def validate_dataset(
    folder: str | os.PathLike, checksums: bool = True, special_ids: Iterable[int] = ()
) -> ValidationReport:
    """Every problem of the dataset in ``folder``; ``checksums=False`` skips the sha256 pass."""
    folder = Path(folder)
    problems: list[Problem] = []
    manifest = _check_manifest(folder, problems)
    entries = _listed_entries(folder, manifest, problems)
    _check_folder_files(folder, entries, problems)
    identity = (manifest or {}).get("identity") or {}
    rules = _RowRules.from_identity(identity, special_ids)
    rows = 0
    hashes: list[pl.DataFrame] = []
    for name, entry in entries.items():
        rows += _check_shard(folder / name, entry, manifest or {}, rules, checksums, problems, hashes)
    _check_unique_ids(folder, hashes, problems)
    return ValidationReport(str(folder), problems, shards_checked=len(entries), rows_checked=rows)


# --------------------------------------------------------------------------------------------
# Manifest and folder
# --------------------------------------------------------------------------------------------


def _check_manifest(folder: Path, problems: list[Problem]) -> dict | None:
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
        if entry.get("file") != (shard_name(index) if isinstance(index, int) else None):
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


def _listed_entries(folder: Path, manifest: dict | None, problems: list[Problem]) -> dict[str, dict | None]:
    """Shard file name -> manifest entry; without a manifest, the shard files found (no entry)."""
    if manifest is not None:
        return {e["file"]: e for e in manifest.get("shards", []) if "file" in e}
    found = sorted(p.name for p in folder.glob("shard-*.parquet") if SHARD_RE.match(p.name))
    if found:
        problems.append(Problem(WARNING, MANIFEST_NAME, f"checking the {len(found)} shard files found without a manifest"))
    return {name: None for name in found}


def _check_folder_files(folder: Path, entries: dict[str, dict | None], problems: list[Problem]) -> None:
    for path in sorted(folder.iterdir()):
        name = path.name
        if SHARD_RE.match(name) and name not in entries:
            marker = folder / name.replace(".parquet", ".done.json")
            state = "finished (it has a marker): rerun score-teacher to rewrite the manifest" if marker.exists() \
                else "unfinished (no marker): a rerun of score-teacher redoes it"
            problems.append(Problem(ERROR, name, f"shard missing from the manifest; {state}"))
        elif name.startswith(".") and ".tmp-" in name:
            problems.append(Problem(WARNING, name, "temporary file left by an interrupted write "
                                                   "(removed by the next score-teacher run)"))
        elif name.endswith(".done.json") and name.replace(".done.json", ".parquet") not in entries:
            if not (folder / name.replace(".done.json", ".parquet")).exists():
                problems.append(Problem(ERROR, name, "marker of a shard file that does not exist"))


# --------------------------------------------------------------------------------------------
# One shard
# --------------------------------------------------------------------------------------------


def _check_shard(
    path: Path, entry: dict | None, manifest: dict, rules: "_RowRules", checksums: bool,
    problems: list[Problem], hashes: list[pl.DataFrame],
) -> int:
    """Check one shard (file, metadata, rows); returns the number of rows read."""
    name = path.name
    if not path.is_file():
        problems.append(Problem(ERROR, name, "listed in the manifest but missing from the folder"))
        return 0
    if entry is not None:
        _check_file_against_entry(path, entry, checksums, problems)
    try:
        meta = read_shard_metadata(path)
    except ContractError as exc:
        problems.append(Problem(ERROR, name, str(exc).replace(f"{path}: ", "")))
        return 0
    if manifest.get("identity"):
        diffs = shard_identity_differences(meta[META_IDENTITY], manifest)
        if diffs:
            problems.append(Problem(ERROR, name, "identity differs from the manifest: " + "; ".join(diffs)))
    if entry is not None and meta[META_SHARD].get("index") != entry.get("index"):
        index = meta[META_SHARD].get("index")
        problems.append(Problem(ERROR, name, f"metadata shard index {index!r}, manifest entry {entry.get('index')!r}"))
    try:
        return _check_rows(path, entry, rules, problems, hashes)
    except pl.exceptions.PolarsError as exc:  # a file whose footer reads but whose pages do not
        problems.append(Problem(ERROR, name, f"rows unreadable: {type(exc).__name__}: {str(exc).splitlines()[0]}"))
        return 0


def _check_file_against_entry(path: Path, entry: dict, checksums: bool, problems: list[Problem]) -> None:
    name = path.name
    size = path.stat().st_size
    if size != entry.get("bytes"):
        problems.append(Problem(ERROR, name, f"{size} bytes on disk, manifest says {entry.get('bytes')} "
                                             "(truncated or rewritten)"))
    if checksums:
        digest = file_sha256(path)
        if digest != entry.get("sha256"):
            said = str(entry.get("sha256"))[:16]
            problems.append(Problem(ERROR, name, f"checksum mismatch: sha256 {digest[:16]}..., manifest says {said}..."))
    marker = path.with_name(marker_name(entry["index"])) if isinstance(entry.get("index"), int) else None
    if marker is None or not marker.is_file():
        problems.append(Problem(ERROR, name, "no completion marker (.done.json) for a listed shard"))
        return
    try:
        on_disk = json.loads(marker.read_text())
    except json.JSONDecodeError as exc:
        problems.append(Problem(ERROR, marker.name, f"unreadable marker ({exc})"))
        return
    differ = sorted(k for k in set(on_disk) | set(entry) if k != "seconds" and on_disk.get(k) != entry.get(k))
    if differ:
        problems.append(Problem(ERROR, marker.name, f"marker differs from the manifest entry in {', '.join(differ)}"))


@dataclass(frozen=True)
class _RowRules:
    vocab_size: int | None
    bos: bool | None  # True: a BOS preceded every document; None: unknown
    special_ids: frozenset[int]

    @classmethod
    def from_identity(cls, identity: dict, special_ids: Iterable[int]) -> "_RowRules":
        teacher = identity.get("teacher") or {}
        vocab = teacher.get("vocab_size")
        bos = (teacher["bos_id"] is not None) if "bos_id" in teacher else None
        return cls(vocab_size=vocab if isinstance(vocab, int) else None, bos=bos, special_ids=frozenset(special_ids))


def _row_facts(path: Path) -> pl.LazyFrame:
    """Per row: what is checked for every row whatever its lists hold."""
    n = pl.col("token_ids").list.len()
    same = (pl.col("starts").list.len() == n) & (pl.col("ends").list.len() == n) & (pl.col("losses").list.len() == n)
    return pl.scan_parquet(str(path)).with_row_index("row").select(
        "row", same_lengths=same, tokens=n.cast(pl.Int64), id_hash=pl.col("doc_id").hash(),
        bad_id=pl.col("doc_id").is_null() | (pl.col("doc_id") == ""), null_text=pl.col("text").is_null(),
    )


def _suspect_rows(path: Path, rules: _RowRules) -> pl.LazyFrame:
    """Rows with equal list lengths that break a span, id or loss rule (a superset, checked again
    one by one in :func:`row_problems` for the message)."""
    n = pl.col("token_ids").list.len()
    same = (pl.col("starts").list.len() == n) & (pl.col("ends").list.len() == n) & (pl.col("losses").list.len() == n)
    width = pl.col("ends") - pl.col("starts")  # list arithmetic: rows with equal lengths only (filter first)
    finite = pl.col("losses").list.eval(pl.element().filter(pl.element().is_finite()))
    suspect = (
        (pl.col("starts").list.min() < 0)
        | (pl.col("ends").list.max() > pl.col("text").str.len_chars())
        | (width.list.min() <= 0)
        | (pl.col("starts").list.diff().list.min() < 0)
        | (pl.col("token_ids").list.min() < 0)
        | pl.col("losses").list.eval(pl.element().is_infinite()).list.any()
        | (finite.list.min() < NEGATIVE_LOSS_TOLERANCE)
        | pl.col("losses").list.slice(1).list.eval(pl.element().is_nan()).list.any()
    )
    if rules.vocab_size is not None:
        suspect = suspect | (pl.col("token_ids").list.max() >= rules.vocab_size)
    if rules.bos is not None:
        first_nan = pl.col("losses").list.first().is_nan()
        suspect = suspect | (first_nan if rules.bos else ~first_nan)
    frame = pl.scan_parquet(str(path)).with_row_index("row").filter(same & pl.col("text").is_not_null())
    return frame.filter(suspect.fill_null(False)).select("row")


def _check_rows(path: Path, entry: dict | None, rules: _RowRules, problems: list[Problem], hashes: list[pl.DataFrame]) -> int:
    name = path.name
    facts, suspects = pl.collect_all([_row_facts(path), _suspect_rows(path, rules)], engine=ENGINE)
    hashes.append(facts.select("id_hash", "row", file=pl.lit(name)))
    if entry is not None and facts.height != entry.get("rows"):
        problems.append(Problem(ERROR, name, f"{facts.height} rows, manifest says {entry.get('rows')}"))
    tokens = int(facts["tokens"].sum())
    if entry is not None and tokens != entry.get("tokens"):
        problems.append(Problem(ERROR, name, f"{tokens} tokens, manifest says {entry.get('tokens')}"))
    for row in facts.filter(pl.col("bad_id"))["row"].to_list():
        problems.append(Problem(ERROR, name, "empty or null doc_id", row=row))
    for row in facts.filter(pl.col("null_text"))["row"].to_list():
        problems.append(Problem(ERROR, name, "null text", row=row))
    rows = sorted(set(suspects["row"].to_list()) | set(facts.filter(~pl.col("same_lengths"))["row"].to_list()))
    if rows:
        detail = pl.scan_parquet(str(path)).with_row_index("row").filter(pl.col("row").is_in(rows)).collect()
        for record in detail.iter_rows(named=True):
            problems.extend(row_problems(record, rules, name))
    return facts.height


def row_problems(record: dict, rules: _RowRules, file: str) -> list[Problem]:
    """Every contract problem of one row (a dict with the row schema's columns and ``row``)."""
    where = dict(file=file, row=record["row"], doc_id=record["doc_id"])
    lists = {c: record[c] for c in ("token_ids", "starts", "ends", "losses")}
    lengths = {c: len(v) for c, v in lists.items()}
    if len(set(lengths.values())) > 1:
        return [Problem(ERROR, message=f"list lengths differ: {lengths}", **where)]
    ids = np.asarray(lists["token_ids"], dtype=np.int64)
    starts = np.asarray(lists["starts"], dtype=np.int64)
    ends = np.asarray(lists["ends"], dtype=np.int64)
    losses = np.asarray(lists["losses"], dtype=np.float64)
    text_len = len(record["text"] or "")
    found: list[tuple[str, str, np.ndarray]] = [
        (ERROR, f"span outside the text of length {text_len}", (starts < 0) | (ends > text_len)),
        (ERROR, "span ends before it starts", ends < starts),
        (ERROR, "starts decrease", np.r_[False, np.diff(starts) < 0]),
        (ERROR, "empty text slice for a non-special token", (ends == starts) & ~np.isin(ids, list(rules.special_ids))),
        (ERROR, "infinite loss (NaN is allowed, inf is not)", np.isinf(losses)),
        (ERROR, "negative loss (-log p cannot be negative)", losses < NEGATIVE_LOSS_TOLERANCE),
        (ERROR, "token id outside the teacher vocabulary", (ids < 0) | (ids >= (rules.vocab_size or np.iinfo(np.int64).max))),
        (WARNING, "NaN loss past the first token (every later token has left context)", np.r_[False, np.isnan(losses[1:])]),
    ]
    if rules.bos is not None and ids.size:
        first = np.zeros(ids.size, dtype=bool)
        first[0] = np.isnan(losses[0]) if rules.bos else not np.isnan(losses[0])
        what = ("NaN although a BOS preceded it" if rules.bos
                else "finite although no BOS preceded it (store NaN, never a made-up value)")
        found.append((WARNING, f"first token's loss {what}", first))
    out = []
    for severity, what, mask in found:
        bad = np.flatnonzero(mask)
        if bad.size:
            k = int(bad[0])
            example = f"token {k}: id {ids[k]}, span ({starts[k]},{ends[k]}), loss {losses[k]:.4g}"
            more = f" ({bad.size} tokens; first: {example})" if bad.size > 1 else f" ({example})"
            out.append(Problem(severity, message=what + more, **where))
    return out


def _check_unique_ids(folder: Path, hashes: list[pl.DataFrame], problems: list[Problem]) -> None:
    """Duplicate ``doc_id``s: equal 64-bit hashes first, then the ids themselves (no false alarm
    on a hash collision)."""
    if not hashes:
        return
    table = pl.concat(hashes)
    candidates = table.filter(pl.col("id_hash").is_duplicated())
    if candidates.height == 0:
        return
    found = []
    for (file,), group in candidates.group_by("file", maintain_order=True):
        rows = group["row"].to_list()
        frame = pl.scan_parquet(str(folder / file)).with_row_index("row").filter(pl.col("row").is_in(rows))
        found.append(frame.select("row", "doc_id", file=pl.lit(file)).collect())
    dupes = pl.concat(found).filter(pl.col("doc_id").is_duplicated())
    for row, doc_id, file in dupes.iter_rows():
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

