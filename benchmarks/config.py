"""The bench's typed configuration: every setting and its default, and the sizes of a quick run.

``conf/bench.yaml`` only overrides these (``bench_defaults`` is registered from
:class:`BenchConfig` by ``benchmarks/__main__.py``); ``quick=true`` merges :data:`QUICK_SIZES` over
the settings, so a smoke run takes the same code paths at tiny sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from benchmarks import CASES
from benchmarks.alignment import AlignmentBenchConfig
from benchmarks.export import ExportBenchConfig
from benchmarks.export_data import ExportDataBenchConfig
from benchmarks.guided_loss import GuidedLossBenchConfig
from benchmarks.held_out_eval import HeldOutEvalBenchConfig
from benchmarks.memory import MemoryBenchConfig
from benchmarks.served_teacher import ServedTeacherBenchConfig
from benchmarks.stage1 import Stage1BenchConfig
from benchmarks.storage import StorageBenchConfig
from benchmarks.student_data import StudentDataBenchConfig
from benchmarks.teachers import TeachersBenchConfig
from benchmarks.threads import ThreadsBenchConfig
from benchmarks.vllm_backend import VLLMBackendBenchConfig
from pipeline.runtime.config import build, check_at_least, raise_if

# Merged over the settings when quick=true: same code paths, tiny sizes, one repetition.
QUICK_SIZES: dict[str, Any] = {
    "scored_docs": 40,
    "scored_rows_per_shard": 10,
    "alignment": {"min_bytes": 131072, "repeats": 2, "dtw_docs": 1, "dtw_budget_s": 3.0},
    "stage1": {"n_docs": 8, "repeats": 1,
               "model": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128, "num_heads": 2}},
    "storage": {"max_shards": 1, "levels": [3], "object_store_repeats": 1},
    "guided_loss": {"model": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128, "num_heads": 2},
                    "vocab_size": 4096, "repeats": 3, "loss_repeats": 5, "warmup": 1},
    "student_data": {"max_shards": 1, "repeats": 1, "warmup": 0, "seq_len": 512},
    "memory": {"n_docs": 8, "scale": 3, "rows_per_shard": 4, "train_steps": 2},
    "teachers": {"max_shards": 1, "repeats": 1, "warmup": 0, "seq_len": 512},
    "served_teacher": {"n_docs": 8, "repeats": 1, "concurrency": [1, 4]},
    "export": {"max_shards": 1, "repeats": 1, "warmup": 0, "seq_len": 512, "scale": 2},
    "vllm_backend": {"n_docs": 8, "repeats": 1},
    "export_data": {"max_shards": 1, "repeats": 1, "warmup": 0, "seq_len": 512},
    "held_out_eval": {"n_docs": 8, "repeats": 1, "warmup": 0, "train_steps": 6, "eval_every": 3},
    "threads": {"batch_size": 2, "block": 32, "repeats": 2, "warmup": 0},
}


@dataclass(frozen=True)
class BenchConfig:
    quick: bool = False  # QUICK_SIZES merged over the settings below
    cases: list[str] = field(default_factory=lambda: list(CASES))
    out_dir: str = "bench-results"  # latest.json (every raw timing) and latest.md (the table)
    work_dir: str = "outputs/bench-work"  # scratch: cached tokenizers, random-weight models, corpora
    tokenizers_dir: str = "../shared/tokenizers"  # the paper's real vocabularies
    artifacts_dir: str = "artifacts"  # embedded sample corpus and tiny teacher (make score-teacher)
    # The scored dataset (stage-1 output) the storage, student-data, teachers and export cases read:
    # made by each bench run in work_dir, never an existing folder: scored_docs sample documents scored
    # by the embedded tiny teacher (built and cached under artifacts_dir) with float32 losses, so each
    # storage setting rounds the teacher's own values (benchmarks.__main__.Inputs.scored_dataset).
    scored_docs: int = 1200
    scored_rows_per_shard: int = 100  # 12 shards: the export's memory case compares 3 with 12
    scored_stride: int = 384  # the embedded tiny teacher's (conf/teacher/tiny.yaml)
    alignment: AlignmentBenchConfig = field(default_factory=AlignmentBenchConfig)
    stage1: Stage1BenchConfig = field(default_factory=Stage1BenchConfig)
    storage: StorageBenchConfig = field(default_factory=StorageBenchConfig)
    guided_loss: GuidedLossBenchConfig = field(default_factory=GuidedLossBenchConfig)
    student_data: StudentDataBenchConfig = field(default_factory=StudentDataBenchConfig)
    memory: MemoryBenchConfig = field(default_factory=MemoryBenchConfig)
    teachers: TeachersBenchConfig = field(default_factory=TeachersBenchConfig)
    served_teacher: ServedTeacherBenchConfig = field(default_factory=ServedTeacherBenchConfig)
    vllm_backend: VLLMBackendBenchConfig = field(default_factory=VLLMBackendBenchConfig)
    export: ExportBenchConfig = field(default_factory=ExportBenchConfig)
    export_data: ExportDataBenchConfig = field(default_factory=ExportDataBenchConfig)
    held_out_eval: HeldOutEvalBenchConfig = field(default_factory=HeldOutEvalBenchConfig)
    threads: ThreadsBenchConfig = field(default_factory=ThreadsBenchConfig)

    def problems(self) -> list[str]:
        problems = [f"cases: {c!r} is not one of {', '.join(CASES)}" for c in self.cases if c not in CASES]
        check_at_least(problems, "scored_docs", self.scored_docs, 1)
        check_at_least(problems, "scored_rows_per_shard", self.scored_rows_per_shard, 1)
        return problems

    def case(self, name: str):
        """The typed settings of case ``name``."""
        return getattr(self, name)


def bench_config(values: Mapping[str, Any]) -> BenchConfig:
    """The typed configuration (:data:`QUICK_SIZES` merged in when ``quick`` is true); every problem
    is reported at once (:class:`pipeline.runtime.config.ConfigError`)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(values, DictConfig):
        values = OmegaConf.to_container(values, resolve=True)
    if values.get("quick") is True:
        values = merged(values, QUICK_SIZES)
    problems: list[str] = []
    typed = build(BenchConfig, values, "", problems)
    raise_if(problems)
    return typed


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s values put in, mappings merged key by key."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
    return out
