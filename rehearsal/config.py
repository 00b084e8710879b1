"""``make rehearse``'s typed settings; ``conf/rehearse.yaml`` only overrides them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from pipeline.runtime.config import build, check_at_least, raise_if

STEPS = ("corpus", "stage1", "rerun", "count", "train", "export", "summary", "validate", "s3", "kills", "markers")
FORMATS = ("parquet", "megatron")


@dataclass(frozen=True)
class RehearseConfig:
    fractions: list[float] = field(default_factory=lambda: [0.0001, 0.001, 0.01])  # of OpenWebMath's 6,315,233 documents
    seed: int = 0
    pool_pages: int = 20_000  # sample pages the corpus's documents are cut from (rehearsal.corpus)
    steps: list[str] = field(default_factory=lambda: list(STEPS))  # which steps run (the others are left out)
    work_dir: str = "outputs/rehearsal"  # corpora, scored folders, exports, runs, caches; results per fraction
    out_dir: str = "bench-results"  # scale.json, scale.md, scale.png
    docs_page: str | None = "docs/sizing-a-run.md"  # its bill section is rewritten from the results (None: not)
    tokenizers_dir: str = "../shared/tokenizers"  # the paper's real vocabularies
    teacher_tokenizer: str = "qwen2"  # Qwen2.5's (benchmarks.inputs.REAL_TOKENIZERS)
    student_tokenizer: str = "llama-spm"  # TinyLlama's
    rows_per_shard: int = 250  # 25,261 shards for the whole corpus
    actors: int = 2  # scorer actors of 1 CPU each
    window: int = 4096
    stride: int = 2048
    length_workers: int = 2
    loader_workers: int = 2  # data.num_workers of the training run
    seq_len: int = 128  # the training run's (its steps stay cheap); the export packs export_seq_len
    export_seq_len: int = 2048
    micro_batch_size: int = 4
    train_steps: int = 200
    export_formats: list[str] = field(default_factory=lambda: list(FORMATS))
    s3_fraction: float | None = 0.001  # this fraction also through moto's S3 server
    kill_fraction: float | None = 0.001  # this fraction's stage 1 and export also SIGKILLed and rerun
    kills: int = 3
    markers_shards: int = 25_000  # the synthetic markers folder
    reuse: bool = True  # a fraction whose results are saved (work_dir/results) is not run again
    interval_s: float = 0.2  # process-tree sampling
    step_timeout_s: float = 3600.0

    def problems(self) -> list[str]:
        found = [f"steps: {s!r} is not one of {', '.join(STEPS)}" for s in self.steps if s not in STEPS]
        found += [f"fractions: {f} must be in (0, 1]" for f in self.fractions if not 0 < f <= 1]
        found += [f"export_formats: {f!r} is not one of {', '.join(FORMATS)}" for f in self.export_formats
                  if f not in FORMATS]
        for name in ("rows_per_shard", "actors", "window", "stride", "length_workers", "seq_len", "export_seq_len",
                     "micro_batch_size", "train_steps", "kills", "markers_shards"):
            check_at_least(found, name, getattr(self, name), 1)
        check_at_least(found, "loader_workers", self.loader_workers, 0)
        if self.stride >= self.window:
            found.append(f"stride: {self.stride} must be < window ({self.window})")
        if not self.fractions:
            found.append("fractions: give at least one")
        return found


def rehearse_config(values: Mapping[str, Any]) -> RehearseConfig:
    from omegaconf import DictConfig, OmegaConf  # the entry point's composed config, as a plain mapping

    if isinstance(values, DictConfig):
        values = OmegaConf.to_container(values, resolve=True)
    problems: list[str] = []
    typed = build(RehearseConfig, values, "", problems, drop=("hydra",))
    raise_if(problems)
    return typed
