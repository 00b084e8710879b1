"""The real-text corpus of the real-model study: human-written mathematics split by document into
a training file and a held-out file (docs/real-models.md).

Input: Parquet files of documents with ``id``, ``text``, ``source``, ``license`` (and ``url``)
columns, one document per row (the layout of the real-text collection described in
docs/real-models.md). Each document's side is decided by a hash of its id and the seed, so it
depends neither on file order nor on the budgets: a held-out document stays held out.

* documents named as evaluation sets (``evaluation_only``: GSM8K's test questions) are held out,
  never trained on;
* of the rest, a ``held_out_share`` of each source (by the hash) is held out;
* the training file takes each source's documents in hash order while they fit its character
  budget (``train_chars``; one too long for what is left is passed over); the held-out file
  likewise (``held_out_chars``).

The two files keep every column plus ``origin`` (the input file's stem); the training file's rows are
in hash order, so a shard of it mixes sources. ``corpus.json`` beside them records the inputs'
sha256, the settings, and per source the documents, characters and licenses of each file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.runtime.config import ConfigError
from pipeline.folders.provenance import file_sha256_cached
from storage_schemas import write_json_atomic

COLUMNS = ("id", "text", "source", "license", "url")


@dataclass(frozen=True)
class RealCorpusConfig:
    """Which documents train and which are held out (module docstring); budgets in characters."""

    files: list[str] = field(default_factory=list)  # Parquet files of documents, one source each
    train_chars: dict[str, int] = field(default_factory=dict)  # file stem -> training budget (absent: none)
    held_out_chars: int = 150_000  # per source, at most
    held_out_share: float = 0.1  # of each source's documents, by hash
    evaluation_only: list[str] = field(default_factory=lambda: ["gsm8k-test-"])  # id prefixes never trained on
    seed: int = 0


def _rank(doc_id: str, seed: int) -> float:
    """A fixed uniform number in [0, 1) for a document id."""
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_documents(table: pa.Table, stem: str, cfg: RealCorpusConfig) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of one source, each in hash order, within their budgets."""
    missing = [c for c in ("id", "text") if c not in table.column_names]
    if missing:
        raise ConfigError(f"{stem}: no {', '.join(missing)} column (has {', '.join(table.column_names)})")
    rows = table.to_pylist()
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{stem}: document ids repeat; the split needs one id per document")
    train, held = [], []
    budget_train, budget_held = cfg.train_chars.get(stem, 0), cfg.held_out_chars
    for row in sorted(rows, key=lambda r: _rank(r["id"], cfg.seed)):
        text = row["text"]
        if not isinstance(text, str) or not text.strip():
            continue
        row = {**{c: row.get(c) for c in COLUMNS}, "origin": stem}
        evaluation = any(str(row["id"]).startswith(p) for p in cfg.evaluation_only)
        if evaluation or _rank("held-out:" + row["id"], cfg.seed) < cfg.held_out_share:
            if budget_held >= len(text):
                held.append(row)
                budget_held -= len(text)
        elif budget_train >= len(text):
            train.append(row)
            budget_train -= len(text)
    return train, held


def summary(rows: list[dict]) -> dict:
    by_source: dict[str, dict] = {}
    for r in rows:
        s = by_source.setdefault(r["origin"], {"documents": 0, "characters": 0, "licenses": {}})
        s["documents"] += 1
        s["characters"] += len(r["text"])
        s["licenses"][r["license"]] = s["licenses"].get(r["license"], 0) + 1
    return by_source


def build_real_corpus(cfg: RealCorpusConfig, out_dir: str | Path) -> dict:
    """Write ``train.parquet``, ``held_out.parquet`` and ``corpus.json`` to ``out_dir`` (kept as
    they are when ``corpus.json`` already records the same inputs and settings)."""
    out = Path(out_dir)
    if not cfg.files:
        raise ConfigError("files: no input files for the real-text corpus")
    for f in cfg.files:
        if not Path(f).is_file():
            raise ConfigError(f"{f}: no such file (the real-text collection; docs/real-models.md says where it comes from)")
    inputs = {Path(f).name: file_sha256_cached(f) for f in cfg.files}
    record = {"inputs_sha256": inputs, "settings": asdict(cfg)}
    done = out / "corpus.json"
    if done.is_file():
        old = json.loads(done.read_text())
        if {k: old.get(k) for k in record} == record:
            return old
    train, held = [], []
    for f in cfg.files:
        t, h = split_documents(pq.read_table(f), Path(f).stem, cfg)
        train += t
        held += h
    train.sort(key=lambda r: _rank(r["id"], cfg.seed))  # shards mix the sources
    out.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([(c, pa.string()) for c in (*COLUMNS, "origin")])
    for name, rows in (("train", train), ("held_out", held)):
        tmp = out / f".{name}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp, compression="zstd")
        tmp.replace(out / f"{name}.parquet")
    record.update({"train": summary(train), "held_out": summary(held),
                   "train_ids_sha256": hashlib.sha256("\n".join(r["id"] for r in train).encode()).hexdigest(),
                   "held_out_ids_sha256": hashlib.sha256("\n".join(r["id"] for r in held).encode()).hexdigest()})
    write_json_atomic(done, record)
    return record
