"""The export (``make export-student``): throughput per core next to tokenization alone, bytes per
student token of each format, and peak memory as the corpus grows.

On a real scored dataset (stage-1 output the bench makes itself: the tiny teacher's scoring of
sample documents, float32 losses) with a real student tokenizer (TinyLlama's Llama-2 SentencePiece), single-threaded:

* ``tokenize``: :func:`pipeline.method.tokenization.encode_batch` of the same documents, a row group per
  call: the student tokenization the export cannot avoid;
* ``export``: :func:`pipeline.export_student.job.run_export` of the first ``max_shards`` shards
  into a fresh folder, every format asked for, with the token counts cached beforehand (as a second
  export of a corpus for one student, or one after ``make train-student``, finds them), everything
  else included: reading, tokenizing, aligning, packing, encoding and writing each format, the
  markers, the manifest and the card.

Figure ``export_throughput``: student tokens per CPU-second of writing the shards (what grows with
the corpus: read, tokenize, align, pack, encode and write every format; ``ExportSummary.write_cpu_seconds``)
over those of tokenization, paired per repetition (both per core: one thread each; the note gives
both in tokens/s, and the whole run with its fixed set-up). Figures
``export_bytes_<format>``: bytes on disk per student token of each format. Figure ``export_memory``:
the export's peak RSS in a child process (the kernel's high-water mark and a sampler over its
process tree, :func:`benchmarks.memory.measure_subprocess`) at ``scale`` times the shards against
a few (``base_shards``: the readers' bounded caches are full there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.inputs import REAL_TOKENIZERS
from benchmarks.measure import interleaved, ratio
from benchmarks.results import figure
from pipeline.runtime.config import check_at_least, check_choice

FORMATS = ("parquet", "megatron", "litdata")


@dataclass(frozen=True)
class ExportBenchConfig:
    max_shards: int = 2
    student: str = "llama-spm"
    seq_len: int = 2048
    rows_per_shard: int = 256
    formats: list[str] = field(default_factory=lambda: list(FORMATS))  # those whose package is installed
    repeats: int = 3
    warmup: int = 1
    base_shards: int = 3  # memory: base_shards scored shards against scale times as many (at most all of them);
    scale: int = 4  # more than one, since the readers' bounded caches hold a few row groups of a few shards
    memory_rows_per_shard: int = 32  # small, so both sizes write several output shards
    interval_s: float = 0.05
    timeout_s: float = 600.0
    target: float = 0.5  # export tokens per CPU-second / tokenization's
    memory_target: float = 1.2

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("max_shards", "seq_len", "rows_per_shard", "memory_rows_per_shard", "repeats", "base_shards"):
            check_at_least(problems, name, getattr(self, name), 1)
        check_at_least(problems, "warmup", self.warmup, 0)
        check_at_least(problems, "scale", self.scale, 2)
        check_choice(problems, "student", self.student, REAL_TOKENIZERS)
        problems += [f"formats: {f!r} is not one of {', '.join(FORMATS)}" for f in self.formats if f not in FORMATS]
        return problems


def installed(formats) -> list[str]:
    """Parquet and the native formats whose package is installed here."""
    from pipeline.export_student.config import FORMAT_PACKAGES

    return ["parquet"] + [f for f in formats if f != "parquet"
                          and importlib.util.find_spec(FORMAT_PACKAGES[f][0].split(".")[0]) is not None]


def subset(dataset: str | os.PathLike, n_shards: int, out: Path) -> Path:
    """A scored folder of the first ``n_shards`` shards of ``dataset`` (its manifest cut to them)."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((Path(dataset) / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:n_shards]
    manifest["n_shards_planned"], manifest["complete"] = len(manifest["shards"]), True
    for entry in manifest["shards"]:
        shutil.copy(Path(dataset) / entry["file"], out / entry["file"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def export_job(tokenizer_dir: str, scored: str, out: str, cache: str, seq_len: int, rows_per_shard: int, formats):
    from pipeline.export_student.config import DataConfig, ExportConfig, ExportJobConfig, StudentConfig

    return ExportJobConfig(
        student=StudentConfig(name="bench", tokenizer=tokenizer_dir, seq_len=seq_len),
        data=DataConfig(folders=[scored], cache_dir=cache),
        export=ExportConfig(rows_per_shard=rows_per_shard, formats=list(formats), progress=False),
        output_dir=out, overwrite=True)


def run(cfg: ExportBenchConfig, work_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, tokenizer,
        dataset: str | os.PathLike) -> dict:
    """``dataset``: a complete stage-1 output folder; ``tokenizer_dir``: the student tokenizer's folder."""
    from pipeline.export_student.job import run_export
    from pipeline.method.tokenization import encode_batch
    from storage_schemas.reader import open_scored_dataset, read_row_group

    work = Path(work_dir) / "export"
    shutil.rmtree(work, ignore_errors=True)
    formats = installed(cfg.formats)
    n_all = len(json.loads((Path(dataset) / "manifest.json").read_text())["shards"])
    scored = subset(dataset, min(cfg.max_shards, n_all), work / "scored")
    shards = open_scored_dataset([str(scored)]).shards
    texts = [read_row_group(s, g, ["text"]).column("text").to_pylist() for s in shards for g in range(len(s.row_group_rows))]
    student_tokens = sum(len(e) for batch in texts for e in encode_batch(tokenizer, batch))
    job = export_job(str(tokenizer_dir), str(scored), str(work / "out"), str(work / "lengths"), cfg.seq_len,
                     cfg.rows_per_shard, formats)
    summaries = []

    def tokenize():
        for batch in texts:
            encode_batch(tokenizer, batch)

    def export():
        shutil.rmtree(job.output_dir, ignore_errors=True)  # a fresh folder: every shard written (a few ms)
        summaries.append(run_export(job))
        assert summaries[-1].shards_written == summaries[-1].shards_planned

    run_export(job)  # fills the length cache: the steady state of exporting for a student already counted
    samples = interleaved({"tokenize": tokenize, "export": export}, cfg.repeats, cfg.warmup)
    last = summaries[-1]
    tokenize_rates = [student_tokens / c for c in samples["tokenize"].cpu]  # tokens per CPU-second, one thread
    write_rates = [s.tokens / s.write_cpu_seconds for s in summaries[-cfg.repeats:]]  # writing the shards
    whole_rates = [last.tokens / c for c in samples["export"].cpu]  # the whole run, set-up included
    paired = [w / t for w, t in zip(write_rates, tokenize_rates)]
    whole = ratio(samples["tokenize"].cpu, samples["export"].cpu)["median"] * last.tokens / student_tokens
    bytes_per_token = {name: size / last.tokens for name, size in last.bytes.items()}
    memory = _memory(cfg, work, str(tokenizer_dir), dataset, n_all, formats)
    shutil.rmtree(work, ignore_errors=True)

    median = statistics.median(paired)
    note = (f"CPU time, one thread, {sum(len(t) for t in texts)} docs, {student_tokens:,} {cfg.student} tokens, "
            f"{last.rows} rows packed to {cfg.seq_len}, formats {', '.join(formats)}, token counts cached beforehand; "
            f"per core: writing the shards {statistics.median(write_rates):,.0f} student tokens/s (read, tokenize, "
            f"align, pack, encode and write every format), tokenization alone {statistics.median(tokenize_rates):,.0f}"
            f" tokens/s; the whole run with its set-up (open, plan, load the tokenizer, manifest, card) "
            f"{statistics.median(whole_rates):,.0f} tokens/s, {whole:.2f} of tokenization at this size; "
            f"spread {min(paired):.2f}-{max(paired):.2f}")
    figures = [figure("export_throughput", "export-student throughput per core / tokenization alone (tokens per CPU-s)",
                      median, cfg.target, ">=", note=note)]
    figures += [figure(f"export_bytes_{name}", f"export-student bytes per student token, {name}", value,
                       unit="B/token", note=f"{last.bytes[name]:,} bytes for {last.tokens:,} row tokens "
                                            f"({last.rows} rows of {cfg.seq_len + 1})")
                for name, value in bytes_per_token.items()]
    figures.append(memory.pop("figure"))
    return {"dataset": str(dataset), "formats": formats, "student_tokens": student_tokens, "rows": last.rows,
            "row_tokens": last.tokens, "samples": {k: v.to_dict() for k, v in samples.items()},
            "paired_ratios": paired, "write_tokens_per_cpu_s": write_rates, "tokenize_tokens_per_cpu_s": tokenize_rates,
            "whole_run_tokens_per_cpu_s": whole_rates, "whole_run_ratio": whole,
            "bytes_per_token": bytes_per_token, "memory": memory, "figures": figures}


def _memory(cfg: ExportBenchConfig, work: Path, tokenizer_dir: str, dataset, n_all: int, formats) -> dict:
    from benchmarks.memory import measure_subprocess

    base = min(cfg.base_shards, max(1, n_all // 2))
    large_n = min(base * cfg.scale, n_all)
    measure = f"memory growth, export-student ({large_n} scored shards / {base}, peak RSS)"
    if large_n <= base:
        return {"figure": figure("export_memory", measure, None, cfg.memory_target, "<=",
                                 note="not measured: the scored dataset has one shard")}
    runs = {}
    for n in (base, large_n):
        scored = subset(dataset, n, work / f"memory-scored-{n}")
        args = {"job": [tokenizer_dir, str(scored), str(work / f"memory-out-{n}"), str(work / f"memory-lengths-{n}"),
                        cfg.seq_len, cfg.memory_rows_per_shard, formats]}
        runs[n] = measure_subprocess("export", args, cfg.interval_s, cfg.timeout_s, module="benchmarks.export")
    small, large = runs[base], runs[large_n]
    if small.get("error") or large.get("error"):
        return {"runs": runs, "figure": figure("export_memory", measure, None, cfg.memory_target, "<=",
                                               note=f"not measured: {small.get('error') or large.get('error')}"[:400])}
    ratios = {k: large[k] / small[k] for k in ("peak_tree_mib", "root_hwm_mib") if small.get(k)}
    worst = max(ratios, key=ratios.get)
    note = (f"{small['workload']['rows']} vs {large['workload']['rows']} rows; peak MiB {base}/{large_n} shards: tree "
            f"{small['peak_tree_mib']:.0f}/{large['peak_tree_mib']:.0f}, root {small['root_hwm_mib']:.0f}/"
            f"{large['root_hwm_mib']:.0f}; figure = the larger ratio ({worst.replace('_mib', '')})")
    return {"runs": runs, "figure": figure("export_memory", measure, ratios[worst], cfg.memory_target, "<=",
                                           note=note, details=ratios)}


def main(argv: list[str]) -> int:
    """The memory workload, in a child process: one export, then its peak RSS."""
    import logging

    from benchmarks.memory import vm_hwm_mib
    from pipeline.export_student.job import run_export

    logging.basicConfig(level=logging.WARNING)
    workload, args = argv[0], json.loads(argv[1])
    assert workload == "export", workload
    summary = run_export(export_job(*args["job"]))
    print("BENCH_RESULT " + json.dumps({"rows": summary.rows, "tokens": summary.tokens, "vm_hwm_mib": vm_hwm_mib()}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
