"""Stage 2's data from an export (``data.export``) against the aligned data of the scored folders.

On a real scored dataset (by default the tiny teacher's scoring of the sample corpus) with the real
student tokenizer (TinyLlama's Llama-2 SentencePiece), exported once beforehand with the same
settings (untimed), all single-threaded and compared by process CPU time:

* ``aligned``: every packed sample of a fresh :class:`pipeline.student_data.dataset.PackedDataset` (plan
  built beforehand: the steady state of training), read in order through a
  ``torch.utils.data.DataLoader`` in batches of ``batch_size`` samples, as the trainer reads it:
  reading the rows, tokenizing, aligning, packing;
* ``export``: every sample of a fresh :class:`pipeline.train_student.from_export.ExportDataset`
  (opened beforehand) through the same data loader: reading the exported rows.

Before timing, both sides are read once and compared batch by batch: the figure compares the same
samples. Figure ``export_data_speedup``: samples per CPU-second of the export side over those of
the aligned side, paired per repetition. A second figure, ``export_data_first_run``, adds what each
side pays before its first sample: counting the student tokens with an empty length cache and
planning (aligned), opening and checking the export (export).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.export import export_job
from benchmarks.inputs import REAL_TOKENIZERS
from benchmarks.measure import interleaved
from benchmarks.results import figure
from benchmarks.student_data import read_packed
from pipeline.runtime.config import check_at_least, check_choice

MEASURE = "stage-2 data from an export / aligned from the scored folders (samples per CPU-s)"
FIRST_RUN = "stage-2 data, first run with its set-up: from an export / aligned (CPU time)"


@dataclass(frozen=True)
class ExportDataBenchConfig:
    max_shards: int = 2
    student: str = "llama-spm"
    seq_len: int = 2048
    rows_per_shard: int = 256  # the export's shards
    batch_size: int = 8  # samples per data-loader call: train.micro_batch_size's default
    repeats: int = 5
    warmup: int = 1
    target: float = 5.0  # the export side at least this many times the aligned side's samples per CPU-second

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("max_shards", "seq_len", "rows_per_shard", "batch_size", "repeats"):
            check_at_least(problems, name, getattr(self, name), 1)
        check_at_least(problems, "warmup", self.warmup, 0)
        check_choice(problems, "student", self.student, REAL_TOKENIZERS)
        return problems


def run(cfg: ExportDataBenchConfig, work_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, tokenizer,
        dataset: str | os.PathLike) -> dict:
    """``dataset``: a complete stage-1 output folder; ``tokenizer_dir``: the student tokenizer's folder."""
    import torch

    from benchmarks.export import subset
    from pipeline.export_student.job import run_export
    from pipeline.student_data.build import build_student_data
    from pipeline.student_data.dataset import PackedDataset, collate_packed
    from pipeline.student_data.settings import AlignmentConfig, PackingConfig
    from pipeline.train_student.from_export import ExportDataset, open_export_data
    from pipeline.train_student.config import DataConfig
    from storage_schemas.reader import open_scored_dataset

    work = Path(work_dir) / "export_data"
    shutil.rmtree(work, ignore_errors=True)
    n_all = len(open_scored_dataset([str(dataset)]).shards)
    scored_dir = subset(dataset, min(cfg.max_shards, n_all), work / "scored")
    scored = open_scored_dataset([str(scored_dir)])
    lengths = work / "lengths"
    job = export_job(str(tokenizer_dir), str(scored_dir), str(work / "export"), str(lengths), cfg.seq_len,
                     cfg.rows_per_shard, ["parquet"])
    run_export(job)
    packing, alignment = PackingConfig(seq_len=cfg.seq_len), AlignmentConfig()
    data = DataConfig(folders=[str(scored_dir)])
    planned = build_student_data(scored, tokenizer, packing, alignment, cache_dir=lengths)
    exported = open_export_data(job.output_dir, tokenizer, cfg.seq_len, data, alignment)

    def aligned_dataset():
        return PackedDataset(planned.scored.shards, planned.plan, tokenizer, planned.alignment)

    def export_dataset():
        return ExportDataset(exported.dataset.shards, exported.plan, exported.dataset.teachers)

    identical = _same_batches(aligned_dataset(), export_dataset(), cfg.batch_size, collate_packed, torch)
    if not identical:
        raise AssertionError("the export's samples differ from the aligned ones: the comparison would be meaningless")
    n_samples = len(planned.dataset)
    first_run: dict[str, list[float]] = {"aligned": [], "export": []}

    def aligned_first():
        cache = tempfile.mkdtemp(dir=work)
        try:
            c0 = time.process_time()
            read_packed(build_student_data(scored, tokenizer, packing, alignment, cache_dir=cache).dataset, cfg.batch_size)
            first_run["aligned"].append(time.process_time() - c0)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def export_first():
        c0 = time.process_time()
        read_packed(open_export_data(job.output_dir, tokenizer, cfg.seq_len, data, alignment).dataset, cfg.batch_size)
        first_run["export"].append(time.process_time() - c0)

    sides = {"aligned": lambda: read_packed(aligned_dataset(), cfg.batch_size),
             "export": lambda: read_packed(export_dataset(), cfg.batch_size),
             "aligned_first_run": aligned_first, "export_first_run": export_first}
    samples = interleaved(sides, cfg.repeats, cfg.warmup)
    shutil.rmtree(work, ignore_errors=True)

    paired = [a / e for a, e in zip(samples["aligned"].cpu, samples["export"].cpu)]  # same samples: time ratio
    first = [a / e for a, e in zip(first_run["aligned"][-cfg.repeats:], first_run["export"][-cfg.repeats:])]
    rate = {side: statistics.median(n_samples / c for c in samples[side].cpu) for side in ("aligned", "export")}
    note = (f"CPU time, one thread, {n_samples} samples of {cfg.seq_len} {cfg.student} tokens from "
            f"{len(scored.shards)} scored shard(s), data-loader batches of {cfg.batch_size}, identical batches checked; "
            f"aligned {rate['aligned']:,.1f} samples/s ({rate['aligned'] * cfg.seq_len:,.0f} tokens/s), export "
            f"{rate['export']:,.1f} samples/s ({rate['export'] * cfg.seq_len:,.0f} tokens/s); spread "
            f"{min(paired):.1f}-{max(paired):.1f}")
    first_note = (f"the aligned side counts the student tokens (empty length cache) and plans before its samples, the "
                  f"export side opens and checks the export; medians {statistics.median(first_run['aligned']):.2f} s "
                  f"and {statistics.median(first_run['export']):.2f} s CPU; spread {min(first):.1f}-{max(first):.1f}")
    return {"dataset": str(dataset), "shards": len(scored.shards), "samples_per_pass": n_samples,
            "identical_batches": identical, "samples": {k: v.to_dict() for k, v in samples.items()},
            "paired_speedups": paired, "first_run_speedups": first, "samples_per_cpu_s": rate,
            "figures": [figure("export_data_speedup", MEASURE, statistics.median(paired), cfg.target, ">=", note=note),
                        figure("export_data_first_run", FIRST_RUN, statistics.median(first), note=first_note)]}


def _same_batches(a, b, batch_size: int, collate, torch) -> bool:
    """Every batch of the two datasets, read as training reads them, equal tensor by tensor (NaN equal to NaN)."""
    if len(a) != len(b):
        return False
    loaders = [torch.utils.data.DataLoader(d, batch_size=batch_size, collate_fn=collate) for d in (a, b)]
    for x, y in zip(*loaders):
        if set(x) != set(y) or not all(torch.equal(x[k], y[k]) if x[k].dtype != torch.float32
                                       else torch.equal(x[k].nan_to_num(-1.0), y[k].nan_to_num(-1.0)) for k in x):
            return False
    return True

