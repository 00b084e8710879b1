"""An OpenWebMath-shaped corpus at a fraction of its size, for rehearsals: ``build_corpus``.

What is OpenWebMath's and where it comes from (the dataset card of ``open-web-math/open-web-math``
and its paper, arXiv 2310.06786):

* 6,315,233 documents (``num_examples``), 14.7B tokens: a mean of 2,328 tokens per document;
  56,651,995,057 bytes of Arrow data (``num_bytes``: 8,971 per row, all four columns) and
  16,370,689,925 bytes of Parquet files (``download_size``).
* 114 Parquet files (``data/train-000NN-of-00114``): what ``datasets``' ``push_to_hub`` makes of
  that many bytes, one file per 500 MB (``config.MAX_SHARD_SIZE``; ``int(num_bytes / 500e6) + 1``
  = 114), so 55,397 rows per file; row groups of 1,000 rows (the writer batch size
  ``config.DEFAULT_MAX_BATCH_SIZE`` that ``push_to_hub`` used for text when the corpus was
  uploaded; ``datasets`` now sizes them to 100 MB, about 11,000 such rows); pyarrow's default
  compression, snappy. Columns ``url``, ``text``, ``date``, ``metadata`` (a JSON string), all strings.

Neither gives the distribution of document lengths, so its shape is an assumption: log-normal in
teacher tokens with ``sigma`` :data:`LENGTH_SIGMA` (median 1,130, 99th percentile 18,400 tokens),
the mean the card's, clipped to ``[MIN_TOKENS, MAX_TOKENS]``. Lengths are drawn in tokens and
turned into characters with the pool's own characters per teacher token (measured with the
teacher's tokenizer on a sample of it), so the teacher-token count of a fraction is close to
that fraction of 14.7B; the run reports the real count.

The text reuses pieces: a pool of clean pages of the embedded sample corpus (worked problems,
LaTeX, unicode maths, a little CJK and emoji; :mod:`pipeline.embedded.sample_corpus`) is laid end
to end in a random order per row group and cut into documents of the drawn lengths. Everything is
a pure function of the seed: row group ``g`` of file ``k`` draws from ``default_rng([seed, k, g])``,
so a smaller fraction is a prefix of a larger one, and a build is cached by its settings.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

OWM_DOCUMENTS = 6_315_233
OWM_TOKENS = 14_700_000_000
OWM_FILES = 114
OWM_ROW_BYTES = 56_651_995_057 / OWM_DOCUMENTS  # Arrow bytes per row, all columns (the card's num_bytes)
OWM_PARQUET_BYTES = 16_370_689_925
ROWS_PER_FILE = math.ceil(OWM_DOCUMENTS / OWM_FILES)  # 55,397
ROW_GROUP_ROWS = 1000
MEAN_TOKENS = OWM_TOKENS / OWM_DOCUMENTS  # 2,327.7
LENGTH_SIGMA = 1.2
MIN_TOKENS, MAX_TOKENS = 16, 262_144
STAMP = "_REHEARSAL_CORPUS.json"
GENERATOR_VERSION = 1
SCHEMA = pa.schema([pa.field(name, pa.string()) for name in ("url", "text", "date", "metadata")])


@dataclass(frozen=True)
class CorpusShape:
    """What a rehearsal corpus is: the fraction of OpenWebMath, its seed and the pieces' pool."""

    fraction: float
    seed: int = 0
    pool_pages: int = 20_000  # clean sample pages the documents are cut from
    chars_per_token: float = 0.0  # measured on the pool with the teacher's tokenizer (build_corpus fills it)

    @property
    def documents(self) -> int:
        return max(1, round(self.fraction * OWM_DOCUMENTS))

    def files(self) -> list[tuple[str, int]]:
        """``(file name, rows)`` of each file, the hub's names and sizes, the last one cut short."""
        n, out, k = self.documents, [], 0
        while n > 0:
            rows = min(ROWS_PER_FILE, n)
            out.append((f"train-{k:05d}-of-{OWM_FILES:05d}.parquet", rows))
            n, k = n - rows, k + 1
        return out


def log_normal_mu(mean: float, sigma: float) -> float:
    """``mu`` of the log-normal with this mean and ``sigma``."""
    return math.log(mean) - sigma**2 / 2


def document_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` document lengths in teacher tokens (module docstring). ``(n,)`` int64."""
    drawn = rng.lognormal(log_normal_mu(MEAN_TOKENS, LENGTH_SIGMA), LENGTH_SIGMA, size=n)
    return np.clip(np.round(drawn), MIN_TOKENS, MAX_TOKENS).astype(np.int64)


@dataclass
class Pool:
    """The pieces: clean sample pages with their URL, date and metadata, and their lengths."""

    texts: list[str]
    urls: list[str]
    dates: list[str]
    metadata: list[str]
    chars: np.ndarray  # (P,) int64

    @classmethod
    def of(cls, pages: int, seed: int) -> "Pool":
        from pipeline.embedded.sample_corpus import generate_documents

        docs = [d for d in generate_documents(pages, seed=seed, noise_share=0.0)
                if d["text"] and d["text"].strip() and json.loads(d["metadata"] or "{}").get("kind") == "clean"]
        texts = [d["text"] + "\n\n" for d in docs]
        return cls(texts, [d["url"] for d in docs], [d["date"] for d in docs], [d["metadata"] for d in docs],
                   np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts)))

    def chars_per_token(self, tokenizer, sample: int = 1500, seed: int = 0) -> float:
        """Characters per teacher token over ``sample`` pages drawn at random."""
        from pipeline.method.tokenization import encode_batch

        picks = np.random.default_rng([seed, 1 << 20]).choice(len(self.texts), size=min(sample, len(self.texts)),
                                                               replace=False)
        texts = [self.texts[i] for i in picks.tolist()]
        return sum(map(len, texts)) / sum(len(e) for e in encode_batch(tokenizer, texts))


def row_group(pool: Pool, shape: CorpusShape, file_index: int, group: int, rows: int, first_row: int) -> pa.Table:
    """Rows ``[0, rows)`` of row group ``group`` of file ``file_index`` (module docstring)."""
    rng = np.random.default_rng([shape.seed, file_index, group])
    lengths = document_lengths(rng, ROW_GROUP_ROWS)[:rows]
    chars = np.maximum(1, np.round(lengths * shape.chars_per_token)).astype(np.int64)  # (rows,)
    need = int(chars.sum())
    picks = rng.integers(0, len(pool.texts), size=int(need / pool.chars.mean() * 1.2) + 16)
    while int(pool.chars[picks].sum()) < need:  # rarely: a run of short pages
        picks = np.concatenate([picks, rng.integers(0, len(pool.texts), size=picks.size)])
    stream = "".join(pool.texts[i] for i in picks.tolist())
    ends = np.cumsum(chars)
    starts = ends - chars
    texts = [stream[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
    page = np.searchsorted(np.cumsum(pool.chars[picks]), starts, side="right")  # the page each document starts in
    source = picks[page].tolist()
    urls = [f"{pool.urls[i]}?d={file_index}-{first_row + r}" for r, i in enumerate(source)]
    return pa.table([urls, texts, [pool.dates[i] for i in source], [pool.metadata[i] for i in source]], schema=SCHEMA)


def write_file(path: Path, pool: Pool, shape: CorpusShape, file_index: int, rows: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with pq.ParquetWriter(tmp, SCHEMA, compression="snappy") as writer:
        for group, start in enumerate(range(0, rows, ROW_GROUP_ROWS)):
            n = min(ROW_GROUP_ROWS, rows - start)
            writer.write_table(row_group(pool, shape, file_index, group, n, start), row_group_size=ROW_GROUP_ROWS)
    tmp.replace(path)


def build_corpus(out_dir: str | Path, fraction: float, tokenizer, seed: int = 0, pool_pages: int = 20_000) -> dict:
    """The corpus of ``fraction`` of OpenWebMath in ``out_dir/data/`` (cached by its settings);
    returns its description: files, rows, bytes, the shape and the measured characters per token."""
    out = Path(out_dir)
    pool = Pool.of(pool_pages, seed)
    shape = CorpusShape(fraction, seed, pool_pages, round(pool.chars_per_token(tokenizer, seed=seed), 4))
    want = {"version": GENERATOR_VERSION, "shape": asdict(shape)}
    stamp = out / STAMP
    if stamp.is_file():
        found = json.loads(stamp.read_text())
        if found.get("build") == want and all((out / "data" / f["file"]).is_file() for f in found["files"]):
            return found
    shutil.rmtree(out, ignore_errors=True)
    (out / "data").mkdir(parents=True)
    files = []
    for k, (name, rows) in enumerate(shape.files()):
        write_file(out / "data" / name, pool, shape, k, rows)
        files.append({"file": name, "rows": rows, "bytes": (out / "data" / name).stat().st_size})
    described = {"build": want, "files": files, **describe(out / "data", shape)}
    stamp.write_text(json.dumps(described, indent=1))
    return described


def describe(folder: Path, shape: CorpusShape) -> dict:
    """Rows, row groups, bytes on disk and uncompressed, against OpenWebMath's per-row figures."""
    rows = groups = disk = raw = 0
    for path in sorted(folder.glob("*.parquet")):
        meta = pq.ParquetFile(path).metadata
        rows += meta.num_rows
        groups += meta.num_row_groups
        disk += path.stat().st_size
        raw += sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    return {"documents": rows, "row_groups": groups, "parquet_bytes": disk, "uncompressed_bytes": raw,
            "bytes_per_row": raw / max(rows, 1), "owm_bytes_per_row": OWM_ROW_BYTES,
            "compression_ratio": disk / max(raw, 1), "owm_compression_ratio": OWM_PARQUET_BYTES / (OWM_ROW_BYTES * OWM_DOCUMENTS),
            "expected_teacher_tokens": round(shape.documents * MEAN_TOKENS)}
