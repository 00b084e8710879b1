"""The real-text corpus of the real-model studies: human-written mathematics split by document into
a training file, a held-out file and, when asked, a tuning file and a warm-up file
(docs/real-models.md).

Input: Parquet files of documents with ``id``, ``text``, ``source``, ``license`` (and ``url``)
columns, one document per row (the layout of the real-text collection described in
docs/real-models.md). Each document's side is decided by a hash of its *key* and the seed, so it
depends neither on file order nor on the budgets: a held-out document stays held out. The key is
the ``group_by`` column where a document has one (``url``: the answers to one forum question share
their question's text, so they go to one side together), else its id.

* documents named as evaluation sets (``evaluation_only``: GSM8K's test questions) are held out,
  never trained on; for the sources in ``held_out_evaluation_only`` (GSM8K) they are the only
  documents held out, so that the held-out text of such a source is its evaluation set alone;
* of the rest, a ``held_out_share`` of each source (by the hash) is held out, and the next
  ``tune_share`` goes to the tuning file (text that chooses settings, e.g. a learning rate,
  without looking at the held-out text);
* the training file takes each source's remaining documents in hash order while they fit its
  character budget (``train_chars``; one too long for what is left is passed over); the warm-up file
  then takes what the training file left, likewise (``warmup_chars``); the held-out and tuning files
  likewise (``held_out_chars``, ``tune_chars`` per source).

The files keep every column plus ``origin`` (the input file's stem); the training and warm-up files'
rows are in hash order, so a shard of them mixes sources. ``corpus.json`` beside them records the
inputs' sha256, the settings, and per source the documents, characters and licenses of each file.
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
    group_by: str | None = None  # a column whose value, where present, keeps documents together (url)
    held_out_evaluation_only: list[str] = field(default_factory=list)  # sources held out by evaluation ids alone
    tune_share: float = 0.0  # of each source's documents, by hash, after the held-out share
    tune_chars: int = 0  # per source, at most (0: no tuning file)
    warmup_chars: dict[str, int] = field(default_factory=dict)  # file stem -> warm-up budget (absent: none)

    def splits(self) -> tuple[str, ...]:
        """The files this split writes."""
        return ("train", "held_out", *(("tune",) if self.tune_chars else ()), *(("warmup",) if self.warmup_chars else ()))


def _rank(doc_id: str, seed: int) -> float:
    """A fixed uniform number in [0, 1) for a document id."""
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_key(row: dict, group_by: str | None) -> str:
    """What decides a document's side: its ``group_by`` value where it has one, else its id."""
    group = row.get(group_by) if group_by else None
    return f"{group_by}:{group}" if group not in (None, "") else str(row["id"])


def split_documents(table: pa.Table, stem: str, cfg: RealCorpusConfig) -> dict[str, list[dict]]:
    """Each split's rows of one source (``cfg.splits()``), each in hash order, within its budget."""
    missing = [c for c in ("id", "text") if c not in table.column_names]
    if missing:
        raise ConfigError(f"{stem}: no {', '.join(missing)} column (has {', '.join(table.column_names)})")
    rows = table.to_pylist()
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{stem}: document ids repeat; the split needs one id per document")
    out: dict[str, list[dict]] = {name: [] for name in cfg.splits()}
    budget = {"train": cfg.train_chars.get(stem, 0), "held_out": cfg.held_out_chars, "tune": cfg.tune_chars,
              "warmup": cfg.warmup_chars.get(stem, 0)}
    by_evaluation_only = stem in cfg.held_out_evaluation_only
    rest = []
    for row in sorted(rows, key=lambda r: (_rank(split_key(r, cfg.group_by), cfg.seed), _rank(r["id"], cfg.seed))):
        text = row["text"]
        if not isinstance(text, str) or not text.strip():
            continue
        row = {**{c: row.get(c) for c in COLUMNS}, "origin": stem}
        evaluation = any(str(row["id"]).startswith(p) for p in cfg.evaluation_only)
        place = _rank("held-out:" + split_key(row, cfg.group_by), cfg.seed)
        if evaluation or (not by_evaluation_only and place < cfg.held_out_share):
            side = "held_out"
        elif "tune" in out and place < (0.0 if by_evaluation_only else cfg.held_out_share) + cfg.tune_share:
            side = "tune"
        else:
            rest.append(row)
            continue
        if budget[side] >= len(text):
            out[side].append(row)
            budget[side] -= len(text)
    taken: set[str] = set()  # groups with a document in the training text: never in the warm-up text too
    for side in ("train", "warmup"):  # the training text first: a warm-up budget never changes it
        if side not in out:
            continue
        left = []
        for row in rest:
            key = split_key(row, cfg.group_by)
            if side == "warmup" and key in taken:
                continue
            if budget[side] >= len(row["text"]):
                out[side].append(row)
                budget[side] -= len(row["text"])
                if side == "train":
                    taken.add(key)
            else:
                left.append(row)
        rest = left
    return out


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
    splits: dict[str, list[dict]] = {name: [] for name in cfg.splits()}
    for f in cfg.files:
        for name, rows in split_documents(pq.read_table(f), Path(f).stem, cfg).items():
            splits[name] += rows
    for name in ("train", "warmup"):  # shards mix the sources
        if name in splits:
            splits[name].sort(key=lambda r: _rank(r["id"], cfg.seed))
    out.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([(c, pa.string()) for c in (*COLUMNS, "origin")])
    for name, rows in splits.items():
        tmp = out / f".{name}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp, compression="zstd")
        tmp.replace(out / f"{name}.parquet")
    for name, rows in splits.items():
        record[name] = summary(rows)
        record[f"{name}_ids_sha256"] = hashlib.sha256("\n".join(r["id"] for r in rows).encode()).hexdigest()
    write_json_atomic(done, record)
    return record
