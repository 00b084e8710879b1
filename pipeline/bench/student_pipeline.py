"""Student data pipeline: read + tokenize + align + pack against tokenization alone.

On a real scored dataset (stage-1 output; by default the tiny teacher's byte-level BPE scoring of
the sample corpus) with the real student tokenizer (TinyLlama's Llama-2 SentencePiece), all
single-threaded and compared by process CPU time:

* ``tokenize``: :func:`pipeline.tokenization.encode_batch` of the same documents, a row group
  (up to 1024 documents) per call: the tokenization the pipeline cannot avoid;
* ``pipeline``: every packed sample of a fresh :class:`pipeline.student_data.PackedDataset` read
  in order, as a data-loader worker does: reading the rows, tokenizing, aligning, packing (the
  plan, built once by :func:`pipeline.student_data.build_student_data`, is not timed: the steady
  state of training);
* ``pipeline_cold``: a first run, everything included: ``build_student_data`` with an empty length
  cache (its length pass tokenizes every document once more before training starts, and it
  fingerprints the tokenizer) and then every sample;
* ``proposed``: :func:`pipeline.bench.proposals.batched_student_stream` on the same row groups
  (checked equal to the pipeline's samples with ``shuffle=False``).

Figure: tokens/s of the pipeline (packed tokens delivered) / tokens/s of tokenization (student
tokens of the same documents), with the warm length cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pipeline.bench.measure import interleaved, profile_parts, ratio
from pipeline.bench.report import figure


@dataclass(frozen=True)
class StudentDataBenchConfig:
    dataset: str = "outputs/scored/owm-sample/tiny/v1"
    max_shards: int = 2
    student: str = "llama-spm"
    seq_len: int = 2048
    repeats: int = 3
    warmup: int = 1
    batch_docs: int = 64
    cold: bool = True
    target: float = 0.9


def run(cfg: StudentDataBenchConfig, work_dir: str | os.PathLike, tokenizer,
        dataset: str | os.PathLike | None = None) -> dict:
    from pipeline.bench.proposals import batched_student_stream
    from pipeline.scored_dataset import ROW_COLUMNS, open_scored_dataset, read_row_group
    from pipeline.student_data import AlignmentConfig, PackedDataset, PackingConfig, build_student_data
    from pipeline.tokenization import bos_token_id, encode_batch

    scored = open_scored_dataset([str(dataset or cfg.dataset)])
    scored = replace(scored, shards=scored.shards[: cfg.max_shards])
    groups = [(s, g) for s in scored.shards for g in range(len(s.row_group_rows))]
    texts = [read_row_group(s, g, ["text"]).column("text").to_pylist() for s, g in groups]
    packing = PackingConfig(seq_len=cfg.seq_len)
    alignment = AlignmentConfig()
    work = Path(work_dir) / "student_data"
    warm_cache = work / "length-cache"
    shutil.rmtree(work, ignore_errors=True)
    student_tokens = sum(len(e) for batch in texts for e in encode_batch(tokenizer, batch))
    bos = tokenizer.bos_token_id if bos_token_id(tokenizer) is not None else None
    delivered: dict[str, int] = {}

    def tokenize():
        for batch in texts:
            encode_batch(tokenizer, batch)

    planned = build_student_data(scored, tokenizer, packing, alignment, cache_dir=warm_cache)

    def read_all(dataset, key: str) -> None:
        for k in range(len(dataset)):
            dataset[k]
        delivered[key] = len(dataset) * cfg.seq_len

    def pipeline():
        read_all(PackedDataset(planned.scored.shards, planned.plan, tokenizer, planned.alignment), "pipeline")

    def pipeline_cold():
        cache = tempfile.mkdtemp(dir=work)
        try:
            read_all(build_student_data(scored, tokenizer, packing, alignment, cache_dir=cache).dataset, "pipeline_cold")
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def proposed():
        tables = [read_row_group(s, g, ROW_COLUMNS) for s, g in groups]
        out = batched_student_stream(tables, tokenizer, cfg.seq_len, bos, tokenizer.eos_token_id, cfg.batch_docs)
        delivered["proposed"] = out["input_ids"].size

    equal = _proposal_matches(scored, tokenizer, packing, alignment, warm_cache, groups, cfg, bos)
    breakdown = profile_parts(pipeline, {
        "tokenize (encode_batch, one document per call)": ("tokenization.py", "encode_batch"),
        "  of which the Rust tokenizer": ("~", "<method 'encode_batch' of 'tokenizers.Tokenizer' objects>"),
        "np.asarray, all callers (offset lists, int64 copies, row values)": ("~", "<built-in method numpy.asarray>"),
        "align (align_document)": ("align.py", "align_document"),
        "read rows (ShardReader.row)": ("scored_dataset.py", "row"),
        "_encode (tokenize + align + per-document arrays)": ("student_data.py", "_encode"),
        "__getitem__ (everything)": ("student_data.py", "__getitem__"),
    })
    sides = {"tokenize": tokenize, "pipeline": pipeline}
    if cfg.cold:
        sides["pipeline_cold"] = pipeline_cold
    if equal:
        sides["proposed"] = proposed
    samples = interleaved(sides, cfg.repeats, cfg.warmup)
    shutil.rmtree(work, ignore_errors=True)

    def throughput_ratio(name: str, clock: str = "cpu") -> dict:
        # (delivered / t_side) / (student_tokens / t_tokenize) = t_tokenize / t_side * delivered / student_tokens
        scale = delivered[name] / student_tokens
        r = ratio(samples["tokenize"].of(clock), samples[name].of(clock))
        return {**r, **{k: r[k] * scale for k in ("median", "min", "max", "of_medians", "of_minima")},
                "paired": [p * scale for p in r["paired"]], "tokens_scale": scale}

    result = {
        "dataset": str(dataset or cfg.dataset), "shards": len(scored.shards), "row_groups": len(groups),
        "documents": sum(len(t) for t in texts), "student_tokens": student_tokens, "delivered_tokens": delivered,
        "student": cfg.student, "seq_len": cfg.seq_len,
        "samples": {k: v.to_dict() for k, v in samples.items()},
        "ratios": {name: throughput_ratio(name) for name in sides if name != "tokenize"},
        "ratios_wall": {name: throughput_ratio(name, "wall") for name in sides if name != "tokenize"},
        "proposal_matches_pipeline": equal,
        "pipeline_profile": breakdown,
    }
    main = result["ratios"]["pipeline"]
    note = (f"CPU time, {result['documents']} docs, {student_tokens:,} {cfg.student} tokens, packed to {cfg.seq_len}; "
            f"data-loader work, plan built beforehand (spread {main['min']:.2f}-{main['max']:.2f}, ratio of minima "
            f"{main['of_minima']:.2f}, wall {result['ratios_wall']['pipeline']['median']:.2f})")
    if "pipeline_cold" in result["ratios"]:
        note += (f"; first run including the plan with an empty length cache: "
                 f"{result['ratios']['pipeline_cold']['median']:.2f}")
    if "proposed" in result["ratios"]:
        proposal = result["ratios"]["proposed"]
        note += (f"; proposal (row-group batches, batched alignment; same samples): "
                 f"{proposal['median']:.2f} (ratio of minima {proposal['of_minima']:.2f})")
    parts = breakdown["parts"]
    note += "; where a pipeline pass goes (cProfile shares): " + ", ".join(
        f"{label.strip()} {100 * p['share']:.0f}%" for label, p in parts.items() if p["share"] is not None)
    result["figures"] = [figure("student_data", "student data pipeline (read+tokenize+align+pack / tokenize)",
                                main["median"], cfg.target, ">=", note=note)]
    return result


def _proposal_matches(scored, tokenizer, packing, alignment, cache, groups, cfg, bos) -> bool:
    """The proposal's samples equal :class:`PackedDataset`'s in file order (``shuffle=False``)."""
    from pipeline.bench.proposals import batched_student_stream
    from pipeline.scored_dataset import ROW_COLUMNS, read_row_group
    from pipeline.student_data import build_student_data

    data = build_student_data(scored, tokenizer, replace(packing, shuffle=False), alignment, cache_dir=cache)
    if data.alignment.method != "token" or alignment.aggregate != "max":
        return False
    tables = [read_row_group(s, g, ROW_COLUMNS) for s, g in groups]
    out = batched_student_stream(tables, tokenizer, cfg.seq_len, bos, tokenizer.eos_token_id, cfg.batch_docs)
    if out["input_ids"].shape[0] != len(data.dataset):
        return False
    for k in range(len(data.dataset)):
        sample = data.dataset[k]
        if not (np.array_equal(sample["input_ids"].numpy(), out["input_ids"][k])
                and np.array_equal(sample["labels"].numpy(), out["labels"][k])
                and np.array_equal(sample["teacher_loss"].numpy(), out["teacher_loss"][k], equal_nan=True)
                and np.array_equal(sample["mapped"].numpy(), out["mapped"][k])):
            return False
    return True
