"""The bill before the run (``make score-teacher ARGS="... plan=true"``): what a stage-1 job will do
and what it will cost, without starting Ray or loading the teacher (its tokenizer only).

* **Shards and documents**: the job's own plan (:func:`pipeline.score_teacher.corpus.plan_shards`,
  from the files' footers), and how many shards an existing output folder already holds.
* **Teacher tokens**: counted when the corpus's text is small (at most ``count_bytes``), else
  estimated from a sample of row groups spread evenly over the files: the sample's teacher tokens
  per byte of the text column (as the footers record it, uncompressed) times the corpus's bytes.
  The error is the ratio estimator's: 1.96 standard errors over the sampled row groups (the row
  groups' own spread, corrected for the share sampled), as a share of the estimate.
* **Bytes on disk**: the sampled documents written as one shard with the job's storage settings
  (:func:`pipeline.score_teacher.writer.write_shard`), their losses from the rehearsal function
  (spread as a teacher's: :mod:`pipeline.score_teacher.backends.rehearsal`), so the bytes per
  teacher token of the chosen encodings, precision and compression, times the tokens.
* **GPU-hours**: the tokens at ``tokens_per_s`` per GPU (given by the user, or what ``make
  gpu-bench`` measured; the front end says which).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.rehearsal import RehearsalScorer
from pipeline.score_teacher.corpus import (
    Document,
    ShardSpec,
    SourceFile,
    open_location,
    plan_shards,
    read_shard,
    resolve_sources,
)
from pipeline.score_teacher.teacher import ShardResult, WindowSettings, score_documents
from pipeline.score_teacher.writer import finished_shards, write_shard
from pipeline.tokenization import bos_token_id, load_tokenizer
from storage_schemas import filesystem as sfs

COUNT_BYTES = 64 * 2**20  # text up to this size is counted whole
SAMPLE_BYTES = 16 * 2**20  # else about this much text is tokenized


@dataclass
class ScorePlan:
    """What :func:`plan_score_job` found; ``tokens_error`` is a share of ``teacher_tokens`` (0 when counted)."""

    files: int
    shards: int
    shards_done: int
    documents: int
    text_bytes: int
    teacher_tokens: int
    counted: bool
    tokens_error: float
    sample_groups: int
    sample_documents: int
    bytes_per_token: float
    bytes_on_disk: int
    tokens_per_s: float | None
    gpu_hours: float | None
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TextGroup:
    """One unit of the sample: a Parquet row group (or a whole JSONL file) and its text bytes."""

    source: SourceFile
    first_row: int
    rows: int
    text_bytes: int


def text_groups(sources: list[SourceFile], text_column: str, limit_docs: int | None) -> list[TextGroup]:
    """Every row group of the planned rows with its text column's uncompressed bytes (footers only);
    a JSONL file is one group whose bytes are the file's."""
    groups: list[TextGroup] = []
    remaining = limit_docs if limit_docs is not None else math.inf
    for src in sources:
        if remaining <= 0:
            break
        if src.kind == "jsonl":
            rows = int(min(src.rows, remaining))
            groups.append(TextGroup(src, 0, rows, int(src.bytes * rows / max(src.rows, 1))))
            remaining -= rows
            continue
        fs, path = open_location(src.path)
        with fs.open_input_file(path) as f:
            meta = pq.ParquetFile(f).metadata
        column = meta.schema.to_arrow_schema().get_field_index(text_column)
        row = 0
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            rows = int(min(group.num_rows, remaining))
            if rows <= 0:
                break
            size = group.column(column).total_uncompressed_size * rows / max(group.num_rows, 1)
            groups.append(TextGroup(src, row, rows, int(size)))
            row += group.num_rows
            remaining -= rows
    return groups


def sample_groups(groups: list[TextGroup], budget_bytes: int) -> list[int]:
    """Indices of groups spread evenly over the corpus, about ``budget_bytes`` of text in all
    (every group when the corpus is no larger)."""
    total = sum(g.text_bytes for g in groups)
    if total <= budget_bytes:
        return list(range(len(groups)))
    k = max(2, min(len(groups), math.ceil(len(groups) * budget_bytes / total)))
    return sorted(set(np.round(np.linspace(0, len(groups) - 1, k)).astype(int).tolist()))


def ratio_estimate(tokens: np.ndarray, sizes: np.ndarray, total_size: float, population: int) -> tuple[float, float]:
    """Total tokens and its relative 95% error from sampled groups' ``tokens`` and ``sizes`` (the
    ratio estimator, with the finite-population correction for ``population`` groups)."""
    n = tokens.size
    ratio = tokens.sum() / sizes.sum()
    estimate = ratio * total_size
    if n < 2 or n >= population:
        return float(estimate), 0.0
    residuals = tokens - ratio * sizes
    variance = (1 - n / population) * residuals.var(ddof=1) / n / sizes.mean() ** 2
    return float(estimate), float(1.96 * math.sqrt(variance) / ratio)


def _group_documents(group: TextGroup, index: int, text_column: str) -> list[Document]:
    spec = ShardSpec(index, group.source.path, group.source.kind, group.source.label, group.first_row,
                     group.first_row + group.rows, group.source.row_offset)
    return read_shard(spec, text_column)


def plan_score_job(cfg, tokens_per_s: float | None = None, count_bytes: int = COUNT_BYTES,
                   sample_bytes: int = SAMPLE_BYTES) -> ScorePlan:
    """The bill of the job ``cfg`` (a :class:`pipeline.score_teacher.job.ScoreJobConfig`; module docstring)."""
    t0 = time.perf_counter()
    sources = resolve_sources(cfg.corpus)
    shards = plan_shards(sources, cfg.corpus.rows_per_shard, cfg.corpus.limit_docs)
    done = finished_shards(cfg.output_dir) if sfs.is_dir(cfg.output_dir) else {}
    tokenizer = load_tokenizer(cfg.teacher.tokenizer or cfg.teacher.model, revision=cfg.teacher.revision,
                               trust_remote_code=cfg.teacher.trust_remote_code)
    groups = text_groups(sources, cfg.corpus.text_column, cfg.corpus.limit_docs)
    total_bytes = sum(g.text_bytes for g in groups)
    counted = total_bytes <= count_bytes
    picked = sample_groups(groups, total_bytes if counted else sample_bytes)
    window = cfg.teacher.window or 4096  # the count does not depend on it: windows only group the tokens
    settings = WindowSettings(window=window, stride=cfg.teacher.stride or window // 2, bos_id=bos_token_id(tokenizer))
    scorer = RehearsalScorer(ScorerConfig(backend="rehearsal", window=window))
    tokens, sizes, documents = [], [], []
    for i in picked:
        result = score_documents(_group_documents(groups[i], i, cfg.corpus.text_column), tokenizer, scorer, settings)
        tokens.append(sum(len(d.ids) for d in result.documents))
        sizes.append(groups[i].text_bytes)
        documents += result.documents
    teacher_tokens, error = (sum(tokens), 0.0) if counted else ratio_estimate(
        np.asarray(tokens, float), np.asarray(sizes, float), total_bytes, len(groups))
    per_token = _bytes_per_token(documents, cfg)
    gpu_hours = teacher_tokens / tokens_per_s / 3600 if tokens_per_s else None
    notes = [] if counted else [f"teacher tokens estimated from {len(picked)} of {len(groups)} row groups "
                                f"({sum(sizes) / 2**20:,.1f} MiB of text)"]
    return ScorePlan(files=len(sources), shards=len(shards), shards_done=len(done),
                     documents=sum(s.stop - s.start for s in shards), text_bytes=total_bytes,
                     teacher_tokens=int(round(teacher_tokens)), counted=counted, tokens_error=error,
                     sample_groups=len(picked), sample_documents=len(documents), bytes_per_token=per_token,
                     bytes_on_disk=int(per_token * teacher_tokens), tokens_per_s=tokens_per_s, gpu_hours=gpu_hours,
                     seconds=time.perf_counter() - t0, notes=notes)


def _bytes_per_token(documents: list, cfg) -> float:
    """Bytes per teacher token of ``documents`` written as one shard with the job's storage settings."""
    tokens = sum(len(d.ids) for d in documents)
    if not tokens:
        return 0.0
    identity = {"teacher": {"name": cfg.teacher.name}, "loss_precision": cfg.storage.loss_precision}
    with tempfile.TemporaryDirectory(prefix="plan-") as scratch:
        entry = write_shard(scratch, 0, ShardResult(documents=documents), identity, {}, "plan", storage=cfg.storage)
        return (entry["bytes"] + os.path.getsize(os.path.join(scratch, "shard-000000.done.json"))) / tokens
