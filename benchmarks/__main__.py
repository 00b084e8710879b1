"""Bench entry point: ``python -m benchmarks [hydra overrides]`` (``make bench``).

Reads as a list of steps: compose and check the config (``quick=true`` merges ``quick_sizes``),
find or make the scored dataset the storage and student-data cases read, run each case (a failed
case becomes an ``error`` line, the others still run), write ``latest.json`` and ``latest.md``,
print the table.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import typing
from pathlib import Path

import hydra
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

from stages.common import ConfigError, plain, quiet_libraries, raise_if

log = logging.getLogger("bench")

CASE_MEASURES = {  # the figures a case produces, for its error lines when it fails
    "alignment": [("alignment_cost", "alignment cost (align / student tokenization)", 0.05, "<="),
                  ("alignment_vs_dtw", "alignment vs peers' DTW (speed-up)", 100.0, ">=")],
    "stage1": [("stage1_overhead", "stage-1 pipeline overhead (job tokens/s / bare forward tokens/s)", 0.95, ">=")],
    "storage": [("storage_compact", "storage, compact (best compact setting, default zstd level)", 3.0, "<="),
                ("object_store_write", "object store vs local disk, write (time ratio)", None, None),
                ("object_store_read", "object store vs local disk, read (time ratio)", None, None)],
    "guided_loss": [("guided_loss_overhead", "guided-loss overhead (guided step / cross-entropy step)", 1.02, "<=")],
    "student_data": [("student_data", "student data pipeline (read+tokenize+align+pack / tokenize)", 0.9, ">=")],
    "memory": [("memory", "memory growth (10x/1x peak RSS)", 1.2, "<=")],
    "teachers": [("two_teachers", "two-teacher data pipeline (two teachers / one, CPU time)", 1.3, "<=")],
}


def typed_nested(cls, values: dict, where: str, problems: list[str]):
    """Dataclass ``cls`` from ``values``: unknown and missing keys are problems; nested dataclasses
    and tuples are converted."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    problems += [f"{where}.{k}: unknown key (known: {', '.join(sorted(fields))})" for k in unknown]
    if unknown:
        return None
    out = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = typed_nested(hint, value, f"{where}.{name}", problems)
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        out[name] = value
    try:
        return cls(**out)
    except TypeError as exc:
        problems.append(f"{where}: {exc}")
        return None


def case_configs(cfg: DictConfig) -> dict:
    """The typed configuration of every case; every problem in the config is reported at once."""
    from benchmarks import CASES
    from benchmarks.alignment import AlignmentBenchConfig
    from benchmarks.guided import GuidedLossBenchConfig
    from benchmarks.memory import WORKLOADS, MemoryBenchConfig
    from benchmarks.stage1 import Stage1BenchConfig
    from benchmarks.storage import StorageBenchConfig
    from benchmarks.student_pipeline import StudentDataBenchConfig
    from benchmarks.two_teacher_pipeline import TeachersBenchConfig

    classes = {"alignment": AlignmentBenchConfig, "stage1": Stage1BenchConfig, "storage": StorageBenchConfig,
               "guided_loss": GuidedLossBenchConfig, "student_data": StudentDataBenchConfig, "memory": MemoryBenchConfig,
               "teachers": TeachersBenchConfig}
    problems: list[str] = []
    unknown = [c for c in cfg.cases if c not in CASES]
    problems += [f"cases: {c!r} is not one of {', '.join(CASES)}" for c in unknown]
    typed = {name: typed_nested(cls, plain(cfg, name), name, problems) for name, cls in classes.items()}
    if typed["memory"]:
        problems += [f"memory.workloads: {w!r} is not one of {', '.join(WORKLOADS)}"
                     for w in typed["memory"].workloads if w not in WORKLOADS]
    raise_if(problems)
    return typed


def effective_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``quick_sizes`` merged over it when ``quick=true``."""
    if cfg.quick:
        cfg = OmegaConf.merge(cfg, cfg.quick_sizes)
    return cfg


class Inputs:
    """Tokenizers and the scored dataset, loaded or made once, on first use."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.work = Path(to_absolute_path(cfg.work_dir))
        self.tokenizers_dir = Path(to_absolute_path(cfg.tokenizers_dir))
        self._scored: Path | None = None

    def tokenizer(self, name: str):
        from benchmarks.inputs import real_tokenizer

        return real_tokenizer(name, self.tokenizers_dir, self.work / "tokenizers")

    def scored_dataset(self) -> Path:
        """The configured scored dataset if complete; else one made now with the tiny teacher."""
        if self._scored is None:
            self._scored = self._find_or_make_scored()
        return self._scored

    def _find_or_make_scored(self) -> Path:
        import json

        folder = Path(to_absolute_path(self.cfg.scored_dataset))
        manifest = folder / "manifest.json"
        if manifest.is_file() and json.loads(manifest.read_text()).get("complete"):
            return folder
        from benchmarks.inputs import sample_corpus
        from pipeline.score_teacher.corpus import CorpusConfig
        from pipeline.embedded import ensure_tiny_teacher
        from pipeline.score_teacher.job import PoolConfig, ScoreJobConfig, TeacherConfig, run_score_job
        from pipeline.score_teacher.backends.base import ScorerConfig

        n = int(self.cfg.fallback_docs)
        log.warning("%s is not a complete scored dataset; scoring %d sample documents with the tiny teacher", folder, n)
        teacher = ensure_tiny_teacher(to_absolute_path(self.cfg.artifacts_dir))
        corpus = sample_corpus(self.work / "fallback", n)
        out = self.work / "fallback" / f"scored-tiny-n{n}"
        run_score_job(ScoreJobConfig(
            teacher=TeacherConfig(name="tiny", model=str(teacher), stride=384),
            corpus=CorpusConfig(name="bench-fallback", files=[str(f) for f in corpus], rows_per_shard=250),
            scorer=ScorerConfig(), output_dir=str(out), pool=PoolConfig(num_actors=1, num_cpus=2), progress=False,
        ))
        return out


def run_case(name: str, case_cfg, inputs: Inputs) -> dict:
    from benchmarks import alignment, guided, memory, stage1, storage, student_pipeline, two_teacher_pipeline

    work = inputs.work
    if name == "alignment":
        return alignment.run(case_cfg, inputs.tokenizer(case_cfg.student), inputs.tokenizer(case_cfg.teacher))
    if name == "stage1":
        return stage1.run(case_cfg, work, inputs.tokenizer(case_cfg.teacher_tokenizer))
    if name == "storage":
        return storage.run(case_cfg, work, inputs.scored_dataset())
    if name == "guided_loss":
        return guided.run(case_cfg)
    if name == "student_data":
        return student_pipeline.run(case_cfg, work, inputs.tokenizer(case_cfg.student), inputs.scored_dataset())
    if name == "teachers":
        return two_teacher_pipeline.run(case_cfg, work, inputs.tokenizer(case_cfg.student), inputs.scored_dataset())
    if name == "memory":
        return memory.run(case_cfg, work, inputs.tokenizer(case_cfg.teacher_tokenizer),
                          inputs.tokenizer(case_cfg.student_tokenizer))
    raise ConfigError(f"unknown case {name!r}")


def error_result(name: str, exc: BaseException) -> dict:
    from benchmarks.results import error_figure

    return {"error": f"{type(exc).__name__}: {exc}",
            "figures": [error_figure(k, m, t, op, exc) for k, m, t, op in CASE_MEASURES[name]]}


def run_bench(cfg: DictConfig) -> dict:
    from benchmarks.measure import machine_info

    t0 = time.perf_counter()
    cfg = effective_config(cfg)
    typed = case_configs(cfg)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # every tokenizer side is single-threaded
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    inputs = Inputs(cfg)
    report = {"mode": "quick" if cfg.quick else "full", "machine": machine_info(),
              "config": OmegaConf.to_container(cfg, resolve=True), "cases": {}, "figures": []}
    for name in cfg.cases:
        log.info("bench case %s", name)
        c0 = time.perf_counter()
        try:
            result = run_case(name, typed[name], inputs)
        except Exception as exc:  # one failed case must not lose the others' figures
            log.exception("bench case %s failed", name)
            result = error_result(name, exc)
        result["seconds"] = time.perf_counter() - c0
        report["cases"][name] = result
        report["figures"] += result["figures"]
        log.info("bench case %s: %.0f s", name, result["seconds"])
    report["seconds"] = time.perf_counter() - t0
    return report


def print_table(report: dict) -> None:
    from benchmarks.results import markdown_table

    print(markdown_table(report["figures"]))


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def main(cfg: DictConfig) -> None:
    from benchmarks.results import write_report

    quiet_libraries()
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    report = run_bench(cfg)
    json_path, md_path = write_report(report, to_absolute_path(cfg.out_dir))
    print_table(report)
    print(f"\n{json_path}\n{md_path}")


if __name__ == "__main__":
    sys.exit(main())
