"""Bench entry point: ``python -m benchmarks [hydra overrides]`` (``make bench``).

Reads as a list of steps: compose and check the config (:mod:`benchmarks.config`; ``quick=true``
merges its ``QUICK_SIZES``), make the scored dataset the storage, student-data, teachers and export
cases read (never one found on disk: each run measures the input it made), run each case (a failed case becomes an ``error`` line, the others still run), write
``latest.json`` and ``latest.md``, print the table.
Usage: ``make bench``, ``make bench ARGS="quick=true"``, ``make bench ARGS="cases=[alignment,storage]"``;
any setting by name, e.g. ``alignment.repeats=3``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import time
from pathlib import Path

from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from benchmarks.config import BenchConfig, bench_config
from benchmarks.export_data import FIRST_RUN as EXPORT_DATA_FIRST_RUN
from benchmarks.export_data import MEASURE as EXPORT_DATA_MEASURE
from benchmarks.served_teacher import MEASURES as SERVED_MEASURES
from benchmarks.vllm_backend import MEASURES as VLLM_MEASURES
from stages.common import entry_point, quiet_libraries

log = logging.getLogger("bench")

# The figures a case produces, for its error lines when it fails: (key, measure, the case setting
# that holds the target, op); each case's typed config holds its targets.
CASE_MEASURES = {
    "alignment": [("alignment_cost", "alignment cost (align / student tokenization)", "target_cost", "<="),
                  ("alignment_vs_dtw", "alignment vs peers' DTW (speed-up)", "target_dtw_speedup", ">=")],
    "stage1": [("stage1_overhead", "stage-1 pipeline overhead (job tokens/s / bare forward tokens/s)", "target", ">=")],
    "storage": [("storage_compact", "storage, compact (best compact setting, default zstd level)", "target", "<="),
                ("object_store_write", "object store vs local disk, write (time ratio)", None, None),
                ("object_store_read", "object store vs local disk, read (time ratio)", None, None)],
    "guided_loss": [("guided_loss_overhead", "guided-loss overhead (guided step / cross-entropy step)", "target", "<=")],
    "student_data": [("student_data", "student data pipeline (read+tokenize+align+pack / tokenize)", "target", ">=")],
    "memory": [("memory", "memory growth (10x/1x peak RSS)", "target", "<=")],
    "teachers": [("two_teachers", "two-teacher data pipeline (two teachers / one, CPU time)", "target", "<=")],
    "served_teacher": [(key, measure, None, None) for key, measure in SERVED_MEASURES.values()],
    "vllm_backend": [(key, measure, None, None) for key, measure in VLLM_MEASURES.values()],
    "export": [("export_throughput", "export-student throughput per core / tokenization alone (tokens per CPU-s)",
                "target", ">="),
               ("export_memory", "memory growth, export-student (peak RSS, more shards / one)", "memory_target", "<=")],
    "export_data": [("export_data_speedup", EXPORT_DATA_MEASURE, "target", ">="),
                    ("export_data_first_run", EXPORT_DATA_FIRST_RUN, None, None)],
    "held_out_eval": [("held_out_eval_speed", "held-out bits per byte / bare forward (tokens/s)", "target", ">="),
                      ("held_out_eval_cost", "evaluation while training / training time (embedded recipe)",
                       "cost_target", "<=")],
    "threads": [("threads_as_is", "tiny-teacher training step, many threads / 1 thread (wall)", None, None),
                ("threads_busy", "the same beside a busy process (wall)", "target_busy", ">=")],
}


class Inputs:
    """Tokenizers and the scored dataset, loaded or made once, on first use."""

    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        self.work = Path(to_absolute_path(cfg.work_dir))
        self.tokenizers_dir = Path(to_absolute_path(cfg.tokenizers_dir))
        self._scored: Path | None = None

    def tokenizer(self, name: str):
        from benchmarks.inputs import real_tokenizer

        return real_tokenizer(name, self.tokenizers_dir, self.work / "tokenizers")

    def tiny_teacher_and_corpus(self) -> tuple[Path, list[str]]:
        """The embedded tiny teacher and the sample corpus it was trained on (built once if missing)."""
        from pipeline.embedded import ensure_sample_corpus, ensure_tiny_teacher

        artifacts = to_absolute_path(self.cfg.artifacts_dir)
        return ensure_tiny_teacher(artifacts), [str(f) for f in ensure_sample_corpus(artifacts)]

    def scored_dataset(self) -> Path:
        """The scored dataset the cases read, made once per bench run (:meth:`_make_scored`)."""
        if self._scored is None:
            self._scored = self._make_scored()
        return self._scored

    def _make_scored(self) -> Path:
        """``scored_docs`` sample documents scored now by the embedded tiny teacher into a fresh
        folder, with compact encodings and float32 losses (no rounding): what the storage case
        rewrites with each setting, and the others read, whatever stage-1 output exists elsewhere."""
        import shutil

        from benchmarks.inputs import sample_corpus
        from pipeline.embedded import ensure_tiny_teacher
        from pipeline.score_teacher.backends.base import ScorerConfig
        from pipeline.score_teacher.corpus import CorpusConfig
        from pipeline.score_teacher.pool import PoolConfig
        from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
        from pipeline.score_teacher.job import run_score_job
        from pipeline.score_teacher.writer import StorageConfig

        n = self.cfg.scored_docs
        teacher = ensure_tiny_teacher(to_absolute_path(self.cfg.artifacts_dir))
        corpus = sample_corpus(self.work / "scored-input", n)
        out = self.work / "scored-input" / f"scored-tiny-n{n}-float32"
        shutil.rmtree(out, ignore_errors=True)
        log.info("scoring %d sample documents with the tiny teacher (float32 losses) for the cases that read scored data", n)
        run_score_job(ScoreJobConfig(
            teacher=TeacherConfig(name="tiny", model=str(teacher), stride=self.cfg.scored_stride),
            corpus=CorpusConfig(name="bench-input", files=[str(f) for f in corpus],
                                rows_per_shard=self.cfg.scored_rows_per_shard),
            scorer=ScorerConfig(), output_dir=str(out), pool=PoolConfig(num_actors=1, num_cpus=2), progress=False,
            storage=StorageConfig(loss_precision="float32"),
        ))
        return out


def run_case(name: str, case_cfg, inputs: Inputs) -> dict:
    """Case ``name`` (its module ``benchmarks.<name>``) with its inputs."""
    case = importlib.import_module(f"benchmarks.{name}")
    work = inputs.work
    if name == "alignment":
        return case.run(case_cfg, inputs.tokenizer(case_cfg.student), inputs.tokenizer(case_cfg.teacher))
    if name == "stage1":  # a model folder of its own brings its tokenizer
        return case.run(case_cfg, work, None if case_cfg.model_dir else inputs.tokenizer(case_cfg.teacher_tokenizer))
    if name == "storage":
        return case.run(case_cfg, work, inputs.scored_dataset())
    if name in ("guided_loss", "threads"):
        return case.run(case_cfg)
    if name in ("student_data", "teachers"):
        return case.run(case_cfg, work, inputs.tokenizer(case_cfg.student), inputs.scored_dataset())
    if name in ("export", "export_data"):
        from benchmarks.inputs import real_tokenizer_folder

        folder = real_tokenizer_folder(case_cfg.student, inputs.tokenizers_dir, work / "tokenizers")
        return case.run(case_cfg, work, folder, inputs.tokenizer(case_cfg.student), inputs.scored_dataset())
    if name == "memory":
        return case.run(case_cfg, work, inputs.tokenizer(case_cfg.teacher_tokenizer),
                        inputs.tokenizer(case_cfg.student_tokenizer))
    if name == "vllm_backend":
        teacher, corpus = inputs.tiny_teacher_and_corpus()
        return case.run(case_cfg, work, to_absolute_path(case_cfg.teacher) if case_cfg.teacher else teacher, corpus)
    if name == "served_teacher":
        from pipeline.embedded import ensure_sample_corpus, ensure_tiny_teacher

        artifacts = to_absolute_path(inputs.cfg.artifacts_dir)
        return case.run(case_cfg, work, ensure_tiny_teacher(artifacts), [str(f) for f in ensure_sample_corpus(artifacts)])
    if name == "held_out_eval":
        return case.run(case_cfg, work, to_absolute_path(inputs.cfg.artifacts_dir), inputs.scored_dataset())
    raise ValueError(f"unknown case {name!r}")


def error_result(name: str, case_cfg, exc: BaseException) -> dict:
    from benchmarks.results import error_figure

    return {"error": f"{type(exc).__name__}: {exc}",
            "figures": [error_figure(key, measure, getattr(case_cfg, target) if target else None, op, exc)
                        for key, measure, target, op in CASE_MEASURES[name]]}


def run_bench(cfg: BenchConfig) -> dict:
    from benchmarks.measure import machine_info

    t0 = time.perf_counter()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # every tokenizer side is single-threaded
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    inputs = Inputs(cfg)
    report = {"mode": "quick" if cfg.quick else "full", "machine": machine_info(),
              "config": dataclasses.asdict(cfg), "cases": {}, "figures": []}
    for name in cfg.cases:
        log.info("bench case %s", name)
        c0 = time.perf_counter()
        try:
            result = run_case(name, cfg.case(name), inputs)
        except Exception as exc:  # one failed case must not lose the others' figures
            log.exception("bench case %s failed", name)
            result = error_result(name, cfg.case(name), exc)
        result["seconds"] = time.perf_counter() - c0
        report["cases"][name] = result
        report["figures"] += result["figures"]
        log.info("bench case %s: %.0f s", name, result["seconds"])
    report["seconds"] = time.perf_counter() - t0
    return report


def print_table(report: dict) -> None:
    from benchmarks.results import markdown_table

    print(markdown_table(report["figures"]))


@entry_point("bench", dataclasses.asdict(BenchConfig()), check=bench_config)
def main(cfg: DictConfig) -> None:
    from benchmarks.results import write_report

    quiet_libraries()
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    bench = bench_config(cfg)
    report = run_bench(bench)
    json_path, md_path = write_report(report, to_absolute_path(bench.out_dir))
    print_table(report)
    print(f"\n{json_path}\n{md_path}")


if __name__ == "__main__":
    sys.exit(main())
