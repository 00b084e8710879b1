"""The export's dataset card: a ``README.md`` beside the shards, derived from the manifest.

Its front matter names the Parquet shards the manifest lists in ``configs`` (never a glob: the
folder also holds Megatron and litdata files), with a digest of their content that keeps
``datasets``' cache from serving rows of an earlier export there
(:func:`pipeline.folders.dataset_card.data_files_configs`), so ``datasets.load_dataset(<folder>)`` reads
exactly them, as they are now; and the corpus's terms where the scored folders record them. Its
body says what made the export (the scored folders and their identities, the student tokenizer,
the alignment and packing settings), how much there is, the teacher-loss statistics of
the student tokens (mean, min and max exact from the markers; quantiles from a histogram of the
shards' ``teacher_loss`` column, :mod:`pipeline.method.loss_histogram`, read a batch at a time and from
evenly spaced shards above :data:`STATS_TOKEN_BUDGET` tokens), the files of each format and the schema.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Sequence

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
from huggingface_hub import DatasetCardData

from pipeline.export_student import rows as rows_module
from pipeline.export_student.formats import LITDATA_INDEX, megatron_prefix
from pipeline.folders.dataset_card import STATS_TOKEN_BUDGET, data_files_configs, stats_sample
from pipeline.method.loss_histogram import DEFAULT_BIN_WIDTH, LossHistogram
from pipeline.folders.rehearsal import NOTE as REHEARSAL_NOTE
from pipeline.folders.rehearsal import is_rehearsal
from storage_schemas import CARD_NAME, MANIFEST_NAME
from storage_schemas import filesystem as sfs

QUANTILES = {"p10": 0.1, "median": 0.5, "p90": 0.9}
TAGS = ["teacher-losses", "token-level", "knowledge-distillation", "vocagno", "student-export"]


def loss_histogram(folder, entries: Sequence[Mapping], token_budget: int = STATS_TOKEN_BUDGET) -> tuple[LossHistogram, int]:
    """The finite teacher losses of the shards ``entries`` lists, counted in :mod:`pipeline.method.loss_histogram`'s
    bins, a record batch at a time; above ``token_budget`` tokens only evenly spaced shards are read.
    Returns the histogram and the number of shards read."""
    chosen = stats_sample(entries, token_budget)
    counts: dict[int, int] = {}
    low, high = math.inf, -math.inf
    for entry in chosen:
        fs, path = sfs.resolve(sfs.join(os.fspath(folder), entry["file"]))
        with fs.open_input_file(path) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=256, columns=["teacher_loss"]):
                values = pc.list_flatten(batch.column(0)).to_numpy(zero_copy_only=False).astype(np.float64)
                values = values[np.isfinite(values)]
                if values.size:
                    low, high = min(low, float(values.min())), max(high, float(values.max()))
                    bins, n = np.unique(np.floor(values / DEFAULT_BIN_WIDTH).astype(np.int64), return_counts=True)
                    for b, c in zip(bins.tolist(), n.tolist()):
                        counts[b] = counts.get(b, 0) + c
    keys = np.asarray(sorted(counts), dtype=np.int64)
    return LossHistogram(bin_width=DEFAULT_BIN_WIDTH, bins=keys, counts=np.asarray([counts[k] for k in keys.tolist()],
                         dtype=np.int64), lowest=low if counts else math.nan, highest=high if counts else math.nan), \
        len(chosen)


def front_matter(manifest: Mapping) -> dict:
    """The hub's metadata: ``configs`` naming the Parquet shards, and the corpus's terms where
    the scored folders' manifests know them (:func:`pipeline.folders.dataset_card.corpus_terms`)."""
    rows = int((manifest.get("totals") or {}).get("rows", 0))
    terms = manifest.get("terms") or {}
    data = DatasetCardData(
        license=terms.get("license"), language=terms.get("language"), source_datasets=terms.get("source_datasets"),
        size_categories=["n<1K" if rows < 1e3 else "1K<n<10K" if rows < 1e4 else "10K<n<100K" if rows < 1e5 else "n>100K"],
        task_categories=["text-generation"], tags=TAGS, pretty_name=title_of(manifest),
        configs=data_files_configs(manifest.get("shards", [])),
    )
    return data.to_dict()


def title_of(manifest: Mapping) -> str:
    identity = manifest.get("identity") or {}
    names = [str(((t.get("teacher") or {}).get("teacher") or {}).get("name", "?")) for t in identity.get("teachers", [])]
    corpora = {str(((f.get("identity") or {}).get("corpus") or {}).get("name", "?"))
               for t in identity.get("teachers", []) for f in t.get("folders", [])}
    return f"{', '.join(sorted(corpora))} scored by {' + '.join(names)}, for a student tokenizer"


def card_text(manifest: Mapping, histogram: LossHistogram, shards_read: int) -> str:
    yaml_text = DatasetCardData(**front_matter(manifest)).to_yaml()
    sections = [_title(manifest), _sources(manifest), _settings(manifest), _counts(manifest),
                _losses(manifest, histogram, shards_read), _files(manifest), _schema(), _loading()]
    return f"---\n{yaml_text}\n---\n\n" + "\n\n".join(s.strip("\n") for s in sections) + "\n"


def _title(manifest: Mapping) -> str:
    totals = manifest.get("totals") or {}
    text = (f"# {title_of(manifest)}\n\n"
            "Student token ids beside the teacher's loss of every student token (NaN where no teacher token "
            "overlaps it), aligned by character offsets: the data of vocabulary-agnostic teacher-guided "
            "language modelling, for any trainer. Train with the guided loss (`pipeline.method.guided_loss.guided_loss`, "
            "recipes in vocagno's docs/export.md). Written by `make export-student`; `manifest.json` beside "
            "this card is the authoritative record (identity, shard files, checksums).")
    teachers = (manifest.get("identity") or {}).get("teachers") or []
    if any(is_rehearsal(t.get("teacher")) for t in teachers):
        text += f"\n\n> **{REHEARSAL_NOTE}.**"
    if not manifest.get("complete"):
        text += (f"\n\n> **Partial export**: {totals.get('shards', 0):,} of {manifest.get('n_shards_planned', 0):,} "
                 "planned shards are written; rerunning the same command writes the rest and rewrites this card.")
    return text


def _sources(manifest: Mapping) -> str:
    identity = manifest.get("identity") or {}
    location = manifest.get("location") or {}
    rows = []
    for i, t in enumerate(identity.get("teachers", [])):
        teacher = (t.get("teacher") or {}).get("teacher") or {}
        windows = (t.get("teacher") or {}).get("windows") or {}
        for f in t.get("folders", []):
            corpus = (f.get("identity") or {}).get("corpus") or {}
            rows.append((f"t{i}", f"`{teacher.get('name')}` (tokenizer sha256 `{str(teacher.get('tokenizer_sha256'))[:16]}`, "
                                  f"window {windows.get('window')}/{windows.get('stride')})",
                         f"`{corpus.get('name')}` ({corpus.get('n_docs', '?')} documents, files sha256 "
                         f"`{str(corpus.get('files_sha256'))[:16]}`)", "complete" if f.get("complete") else "partial"))
        rows.append((f"t{i}", f"{len(t.get('shards_used', []))} shard(s) used", "", ""))
    folders = ", ".join(f"`{'/'.join(str(p).rstrip('/').split('/')[-3:])}`" for p in location.get("scored_folders", []))
    license = (manifest.get("terms") or {}).get("license")
    terms = (f"The corpus's license, `{license}`, applies to this export too." if license else
             "The corpus's license is not recorded (stage 1's `data.license`): set this card's `license` before "
             "publishing; the corpus's terms apply to this export too.")
    return ("## Sources\n\nThe scored folders (stage-1 output) this export was made from, by teacher "
            f"(folders: {folders}; their full identities are in `manifest.json`):\n\n"
            + _table(("teacher", "model", "corpus", "scoring"), rows) + "\n\n" + terms)


def _settings(manifest: Mapping) -> str:
    identity = manifest.get("identity") or {}
    s, p = identity.get("student") or {}, identity.get("packing") or {}
    alignments = ", ".join(f"t{i}: {_alignment(t.get('alignment') or {})}" for i, t in enumerate(identity.get("teachers", [])))
    combine = identity.get("combine")
    layout = (f"packed: rows of {p.get('seq_len', 0) + 1} tokens (`seq_len` {p.get('seq_len')} inputs and as many "
              "targets), consecutive rows sharing one token: the samples `make train-student` trains on"
              if p.get("layout") == "packed" else "documents: one row per document, `[BOS] tokens [EOS]`")
    rows = [
        ("student tokenizer", f"sha256 `{s.get('tokenizer_sha256')}`, {s.get('vocab_size')} tokens, BOS id "
                              f"{s.get('bos_id')}, EOS id {s.get('eos_id')}"),
        ("alignment", alignments + " (docs/METHOD.md §2.1, §2.3)"),
        ("teachers combined", f"{combine.get('how')}" + (f", weights {combine.get('weights')}" if combine.get("weights") else "")
         + f", a document a teacher lacks: {combine.get('missing_documents')}" if combine else "one teacher"),
        ("layout", layout),
        ("order", f"seed {p.get('seed')}, shuffle {p.get('shuffle')}, {p.get('epochs')} pass(es); BOS "
                  f"{'added' if p.get('add_bos') else 'not added'}, EOS {'added' if p.get('add_eos') else 'not added'}"),
    ]
    return "## How it was made\n\n" + _table(("", ""), rows)


def _alignment(a: Mapping) -> str:
    method = a.get("method")
    if method == "token":
        return f"token, {a.get('aggregate')} over the overlapping teacher tokens"
    return f"chunk, mean over {a.get('n_chunks')} chunks" if method == "chunk" else str(method)


def _counts(manifest: Mapping) -> str:
    t = manifest.get("totals") or {}
    tokens, mapped = int(t.get("tokens", 0)), int(t.get("mapped", 0))
    rows = [
        ("shards", f"{t.get('shards', 0):,} of {manifest.get('n_shards_planned', 0):,} planned"),
        ("rows", f"{t.get('rows', 0):,}"),
        ("student tokens", f"{tokens:,}"),
        ("mapped (a teacher loss)", f"{mapped:,} ({mapped / tokens:.2%})" if tokens else "-"),
        ("documents without a student token (left out)", f"{(manifest.get('identity') or {}).get('packing', {}).get('n_empty', 0):,}"),
    ]
    return "## Counts\n\n" + _table(("", ""), rows)


def _losses(manifest: Mapping, histogram: LossHistogram, shards_read: int) -> str:
    t = manifest.get("totals") or {}

    def nats(x) -> str:
        return "-" if x is None or math.isnan(x) else f"{x:.4f}"

    mean = t["loss_sum"] / t["mapped"] if t.get("mapped") else float("nan")
    rows = [("mean", nats(mean)), *((name, nats(histogram.quantile(q))) for name, q in QUANTILES.items()),
            ("min", nats(t.get("loss_min"))), ("max", nats(t.get("loss_max")))]
    shards = len(manifest.get("shards", []))
    scope = f"all {shards:,} shards" if shards_read == shards else f"{shards_read:,} evenly spaced shards of {shards:,}"
    return ("## Teacher loss of the student tokens\n\nOver the mapped student tokens, in nats: mean, min and max of "
            f"every shard; quantiles from {scope}, within {DEFAULT_BIN_WIDTH:.4f} of exact.\n\n"
            + _table(("", "nats"), rows))


def _files(manifest: Mapping) -> str:
    t = manifest.get("totals") or {}
    tokens = int(t.get("tokens", 0))
    shards = manifest.get("shards", [])
    first = shards[0]["file"] if shards else "shard-000000.parquet"
    rows = [(name, f"{size:,}", f"{size / tokens:.2f}" if tokens else "-") for name, size in (t.get("bytes") or {}).items()]
    text = ("## Files\n\n" + _table(("format", "bytes", "bytes per student token"), rows)
            + f"\n\n* Parquet: the files `{MANIFEST_NAME}` lists (`shard-NNNNNN.parquet`), also in this card's `configs`.")
    formats = (manifest.get("identity") or {}).get("formats", [])
    if "megatron" in formats:
        text += (f"\n* Megatron-core indexed datasets: per shard the prefixes `{megatron_prefix(first, 'input_ids')}` "
                 f"(int32) and `{megatron_prefix(first, 'teacher_loss')}` (float32), one sequence per row.")
    if "litdata" in formats:
        text += (f"\n* litdata: `{LITDATA_INDEX}` over one chunk per shard (`shard-NNNNNN.litdata.bin`): "
                 "`litdata.StreamingDataset(<folder>)`" + ("" if manifest.get("complete") else
                                                           " (written when the export is complete)") + ".")
    return text


def _schema() -> str:
    return "## Schema\n\nOne row per packed sample or per document.\n\n" + _column_table()


def _column_table() -> str:
    """The column table of :mod:`pipeline.export_student.rows`' docstring (the one statement of it)."""
    lines = (rows_module.__doc__ or "").splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith("====")]
    if len(marks) < 3:
        return ""
    body: list[list[str]] = []
    for line in lines[marks[1] + 1:marks[2]]:
        name, kind, meaning = line[:19].strip(), line[19:39].strip(), line[39:].strip()
        if name:
            body.append([name.replace("``", "`"), f"`{kind}`", meaning])
        elif body:
            body[-1][2] += " " + meaning
    return _table(("column", "type", "meaning"), body)


def _loading() -> str:
    return """## Loading

```python
from datasets import load_dataset
rows = load_dataset("path/to/export", split="train")      # this card's configs: the manifest's shards

import polars as pl, json
files = [f"path/to/export/{s['file']}" for s in json.load(open("path/to/export/manifest.json"))["shards"]]
frame = pl.scan_parquet(files)
```

Packed rows: inputs `input_ids[:-1]`, targets `input_ids[1:]`, the targets' teacher losses
`teacher_loss[1:]`. Recipes for the Hugging Face Trainer, a plain PyTorch loop and Megatron-LM are in
vocagno's docs/export.md."""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_card(folder: str | os.PathLike, manifest: Mapping) -> None:
    """``<folder>/README.md`` (one PUT on an object store, an atomic replace locally)."""
    data = card_text(manifest, *loss_histogram(folder, manifest.get("shards", []))).encode("utf-8")
    location = sfs.child(folder, CARD_NAME)
    if sfs.is_remote(location):
        sfs.write_bytes(location, data)
        return
    tmp = location.with_name(f".{CARD_NAME}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, location)
