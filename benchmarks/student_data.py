"""Student data pipeline: read + tokenize + align + pack against tokenization alone.

On a real scored dataset (stage-1 output; by default the tiny teacher's byte-level BPE scoring of
the sample corpus) with the real student tokenizer (TinyLlama's Llama-2 SentencePiece), all
single-threaded and compared by process CPU time:

* ``tokenize``: :func:`pipeline.method.tokenization.encode_batch` of the same documents, a row group
  (up to 1024 documents) per call: the tokenization the pipeline cannot avoid;
* ``pipeline``: every packed sample of a fresh :class:`pipeline.student_data.dataset.PackedDataset` read
  in order through a ``torch.utils.data.DataLoader`` in batches of ``batch_size`` samples (the
  training micro batch), as the trainer's data loader reads it: reading the rows, tokenizing,
  aligning, packing (the plan, built once by :func:`pipeline.student_data.build.build_student_data`, is
  not timed: the steady state of training);
* ``pipeline_cold``: a first run, everything included: ``build_student_data`` with an empty length
  cache (its length pass tokenizes every document once more before training starts, and it
  fingerprints the tokenizer) and then every sample.

Figure: tokens/s of the pipeline (packed tokens delivered) / tokens/s of tokenization (student
tokens of the same documents), with the warm length cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.inputs import REAL_TOKENIZERS
from benchmarks.measure import interleaved, profile_parts, ratio
from benchmarks.results import figure
from pipeline.runtime.config import check_at_least, check_choice


@dataclass(frozen=True)
class StudentDataBenchConfig:
    max_shards: int = 2
    student: str = "llama-spm"
    seq_len: int = 2048
    repeats: int = 5
    warmup: int = 1
    batch_size: int = 8  # samples per data-loader call: train.micro_batch_size's default
    cold: bool = True
    target: float = 0.9

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("max_shards", "seq_len", "repeats", "batch_size"):
            check_at_least(problems, name, getattr(self, name), 1)
        check_at_least(problems, "warmup", self.warmup, 0)
        check_choice(problems, "student", self.student, REAL_TOKENIZERS)
        return problems


def read_packed(dataset, batch_size: int) -> int:
    """Every sample of a packed dataset through a data loader, as training reads it; the tokens delivered."""
    import torch

    from pipeline.student_data.dataset import collate_packed

    for _ in torch.utils.data.DataLoader(dataset, batch_size=batch_size, collate_fn=collate_packed):
        pass
    return len(dataset) * dataset.plan.seq_len


def run(cfg: StudentDataBenchConfig, work_dir: str | os.PathLike, tokenizer, dataset: str | os.PathLike) -> dict:
    """``dataset``: a complete stage-1 output folder."""
    from pipeline.student_data.build import build_student_data
    from pipeline.student_data.dataset import PackedDataset
    from pipeline.student_data.settings import AlignmentConfig, PackingConfig
    from pipeline.method.tokenization import encode_batch
    from storage_schemas.reader import open_scored_dataset, read_row_group

    scored = open_scored_dataset([str(dataset)])
    scored = replace(scored, shards=scored.shards[: cfg.max_shards])
    groups = [(s, g) for s in scored.shards for g in range(len(s.row_group_rows))]
    texts = [read_row_group(s, g, ["text"]).column("text").to_pylist() for s, g in groups]
    packing = PackingConfig(seq_len=cfg.seq_len)
    alignment = AlignmentConfig()
    work = Path(work_dir) / "student_data"
    warm_cache = work / "length-cache"
    shutil.rmtree(work, ignore_errors=True)
    student_tokens = sum(len(e) for batch in texts for e in encode_batch(tokenizer, batch))
    delivered: dict[str, int] = {}

    def tokenize():
        for batch in texts:
            encode_batch(tokenizer, batch)

    planned = build_student_data(scored, tokenizer, packing, alignment, cache_dir=warm_cache)

    def read_all(dataset, key: str) -> None:
        delivered[key] = read_packed(dataset, cfg.batch_size)

    def pipeline():
        read_all(PackedDataset(planned.scored.shards, planned.plan, tokenizer, planned.alignment), "pipeline")

    def pipeline_cold():
        cache = tempfile.mkdtemp(dir=work)
        try:
            read_all(build_student_data(scored, tokenizer, packing, alignment, cache_dir=cache).dataset, "pipeline_cold")
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    breakdown = profile_parts(pipeline, {
        "tokenize (encode_batch, a request's documents and its read-ahead per call)": ("pipeline/method/tokenization.py", "encode_batch"),
        "  of which the Rust tokenizer": ("~", "<method 'encode_batch' of 'tokenizers.Tokenizer' objects>"),
        "np.asarray, all callers (offset lists, row values)": ("~", "<built-in method numpy.asarray>"),
        "align (align_documents)": ("pipeline/method/alignment.py", "align_documents"),
        "read rows (ShardReader.row)": ("storage_schemas/reader.py", "row"),
        "_encode (read + tokenize + align + per-document arrays)": ("pipeline/student_data/dataset.py", "_encode"),
        "__getitems__ (everything but collation)": ("pipeline/student_data/dataset.py", "__getitems__"),
    })
    sides = {"tokenize": tokenize, "pipeline": pipeline}
    if cfg.cold:
        sides["pipeline_cold"] = pipeline_cold
    samples = interleaved(sides, cfg.repeats, cfg.warmup)
    shutil.rmtree(work, ignore_errors=True)

    def throughput_ratio(name: str, clock: str = "cpu") -> dict:
        # (delivered / t_side) / (student_tokens / t_tokenize) = t_tokenize / t_side * delivered / student_tokens
        scale = delivered[name] / student_tokens
        r = ratio(samples["tokenize"].of(clock), samples[name].of(clock))
        return {**r, **{k: r[k] * scale for k in ("median", "min", "max", "of_medians", "of_minima")},
                "paired": [p * scale for p in r["paired"]], "tokens_scale": scale}

    result = {
        "dataset": str(dataset), "shards": len(scored.shards), "row_groups": len(groups),
        "documents": sum(len(t) for t in texts), "student_tokens": student_tokens, "delivered_tokens": delivered,
        "student": cfg.student, "seq_len": cfg.seq_len,
        "samples": {k: v.to_dict() for k, v in samples.items()},
        "ratios": {name: throughput_ratio(name) for name in sides if name != "tokenize"},
        "ratios_wall": {name: throughput_ratio(name, "wall") for name in sides if name != "tokenize"},
        "pipeline_profile": breakdown,
    }
    main = result["ratios"]["pipeline"]
    note = (f"CPU time, {result['documents']} docs, {student_tokens:,} {cfg.student} tokens, packed to {cfg.seq_len}; "
            f"data-loader work in batches of {cfg.batch_size} samples, plan built beforehand (spread "
            f"{main['min']:.2f}-{main['max']:.2f}, ratio of minima {main['of_minima']:.2f}, "
            f"wall {result['ratios_wall']['pipeline']['median']:.2f})")
    if "pipeline_cold" in result["ratios"]:
        note += (f"; first run including the plan with an empty length cache: "
                 f"{result['ratios']['pipeline_cold']['median']:.2f}")
    parts = breakdown["parts"]
    note += "; where a pipeline pass goes (cProfile shares): " + ", ".join(
        f"{label.strip()} {100 * p['share']:.0f}%" for label, p in parts.items() if p["share"] is not None)
    result["figures"] = [figure("student_data", "student data pipeline (read+tokenize+align+pack / tokenize)",
                                main["median"], cfg.target, ">=", note=note)]
    return result
