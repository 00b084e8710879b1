"""The export's typed configuration (``conf/export_student.yaml`` overrides these defaults).

Its groups are laid out as stage 2's (``conf/train_student.yaml``), so the settings that decide the
data are written the same way in both: ``student.*`` (tokenizer, ``seq_len``), ``data.*`` (folders,
order, BOS/EOS, several teachers) and ``loss.*`` (alignment, aggregation, chunks, combination);
``export.*`` holds what only the export has (layout, shard size, formats).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from pipeline.runtime.config import build, check_at_least, check_choice, defaults, lift_progress, raise_if
from pipeline.folders.model_source import local_model_problem, looks_local
from pipeline.student_data.several_teachers import MISSING_RULES
from pipeline.student_data.settings import AlignmentConfig, scored_folder_problems
from storage_schemas import filesystem as sfs
from storage_schemas.reader import ON_BAD_SHARD, VERIFY

LAYOUTS = ("packed", "documents")
FORMATS = ("parquet", "megatron", "litdata")
# The package each native format is written with, and how to install it (pyproject's extras).
FORMAT_PACKAGES = {"megatron": ("megatron.core", "pip install 'vocagno[megatron]'"),
                   "litdata": ("litdata", "pip install 'vocagno[litdata]' -c <(echo torch==<your torch version>)")}
COMPRESSIONS = ("zstd", "snappy", "gzip", "none")


@dataclass(frozen=True)
class StudentConfig:
    """The student whose tokens the export holds: its tokenizer, and its positions (from its config)."""

    name: str
    model: str | None = None  # hub id or local folder: its config gives the positions, its tokenizer the tokens
    revision: str | None = None
    tokenizer: str | None = None  # defaults to the model's own
    seq_len: int = 2048  # packed rows hold seq_len + 1 tokens (seq_len inputs, seq_len targets)
    trust_remote_code: bool = False

    def problems(self) -> list[str]:
        found: list[str] = []
        check_at_least(found, "seq_len", self.seq_len, 1)
        if not self.model and not self.tokenizer:
            found.append("model: give the student's model (its tokenizer and positions), or at least student.tokenizer")
        return found


@dataclass(frozen=True)
class DataConfig:
    """The scored folders and the order of their documents (stage 2's ``data`` group, docs/METHOD.md §2.4, §2.6)."""

    folders: list[str]  # scored dataset folders (stage-1 output); several teachers: loss.combine
    on_bad_shard: str = "error"  # error | skip
    verify: str = "sha256"  # sha256: each shard's bytes against its recorded sha256 on opening (one more read) | size
    allow_partial: bool = False  # export the finished shards of an incomplete scoring
    allow_rehearsal: bool = False  # export a rehearsal's scores (scorer.backend=rehearsal: no model's losses)
    cache_dir: str | None = None  # student token counts per (tokenizer, shard), shared with stage 2
    seed: int = 0
    shuffle: bool = True
    epochs: int = 1
    add_bos: bool | None = None  # None: as the student's tokenizer does
    add_eos: bool = True
    length_workers: int = 1  # processes for the one-off token count
    missing_documents: str = "refuse"  # several teachers: refuse | unmapped
    held_out_shards: int = 0  # the last N planned shards of the first folder are left out, as stage 2 leaves them

    def problems(self) -> list[str]:
        found: list[str] = []
        check_at_least(found, "held_out_shards", self.held_out_shards, 0)
        check_choice(found, "on_bad_shard", self.on_bad_shard, ON_BAD_SHARD)
        check_choice(found, "verify", self.verify, VERIFY)
        check_choice(found, "missing_documents", self.missing_documents, MISSING_RULES)
        check_at_least(found, "epochs", self.epochs, 1)
        check_at_least(found, "length_workers", self.length_workers, 1)
        if not self.folders:
            found.append("folders: no scored dataset folder given")
        return found


@dataclass(frozen=True)
class ExportConfig:
    """What only the export has."""

    layout: str = "packed"  # packed: stage 2's samples, seq_len + 1 tokens each | documents: one row per document
    rows_per_shard: int = 1024
    formats: list[str] = field(default_factory=lambda: ["parquet"])  # parquet, and megatron / litdata beside it
    compression: str = "zstd"  # the Parquet files'
    batch_rows: int = 64  # rows tokenized and aligned per call (memory holds about this many)
    limit_shards: int | None = None  # write at most this many pending shards in this run (a rerun writes the rest)
    progress: bool = True

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "layout", self.layout, LAYOUTS)
        check_choice(found, "compression", self.compression, COMPRESSIONS)
        check_at_least(found, "rows_per_shard", self.rows_per_shard, 1)
        check_at_least(found, "batch_rows", self.batch_rows, 1)
        check_at_least(found, "limit_shards", self.limit_shards, 0)
        found += [f"formats: {f!r} is not one of {', '.join(FORMATS)}" for f in self.formats if f not in FORMATS]
        if "parquet" not in self.formats:
            found.append("formats: parquet is always written (the manifest and the card describe it); list it")
        if len(set(self.formats)) != len(self.formats):
            found.append(f"formats: {list(self.formats)} lists a format twice")
        return found


@dataclass(frozen=True)
class ExportJobConfig:
    student: StudentConfig
    data: DataConfig
    output_dir: str
    export: ExportConfig = field(default_factory=ExportConfig)
    alignment: AlignmentConfig = field(default_factory=AlignmentConfig)  # loss.alignment, aggregate, n_chunks, combine
    overwrite: bool = False  # delete an export of another setup in output_dir first


# The job's configuration as the config file writes it (stage 2's layout).
LOSS_ALIGNMENT_KEYS = {"alignment": "method"}
STUDENT_RECIPE_KEYS = ("embedded", "build", "attn_implementation", "gradient_checkpointing")  # presets' training keys
DATA_NAMING_KEYS = ("corpus", "teacher")  # name the default folders and the output
FRONT_END_KEYS = ("artifacts_dir", "scored_root", "export_root", "hydra")


def config_defaults() -> dict:
    """Every setting with its default, as the config file is laid out; the YAML files override these."""
    return {
        "student": defaults(StudentConfig),
        "data": defaults(DataConfig),
        "loss": defaults(AlignmentConfig, rename=LOSS_ALIGNMENT_KEYS),
        "export": defaults(ExportConfig),
        **defaults(ExportJobConfig, drop=("student", "data", "export", "alignment")),
        "progress": None,  # every command's key for its progress bars: sets export.progress (lift_progress)
    }


def export_job_config(values: Mapping, check_files: bool = False) -> ExportJobConfig:
    """The typed job from a composed config (plain mapping), every problem in one
    :class:`pipeline.runtime.config.ConfigError`: unknown keys, wrong types, bad choices, a native format
    whose package is not installed; with ``check_files`` also scored folders and a local student
    that do not exist (unless the student is the embedded one, built later). Local paths become absolute."""
    problems: list[str] = []
    values = lift_progress(values, "export")
    student_values = dict(values.get("student") or {})
    parts = {
        "student": build(StudentConfig, student_values, "student", problems, drop=STUDENT_RECIPE_KEYS),
        "data": build(DataConfig, values.get("data"), "data", problems, drop=DATA_NAMING_KEYS),
        "export": build(ExportConfig, values.get("export"), "export", problems),
        "alignment": build(AlignmentConfig, values.get("loss"), "loss", problems, rename=LOSS_ALIGNMENT_KEYS),
    }
    if parts["export"] is not None:
        problems += format_problems(parts["export"].formats)
    top = {k: v for k, v in values.items() if k not in ("student", "data", "export", "loss", *FRONT_END_KEYS)}
    job = build(ExportJobConfig, {**top, **{k: v for k, v in parts.items() if v is not None}}, "", problems,
                assume=parts)
    if check_files:
        problems += file_problems((values.get("data") or {}).get("folders"), student_values,
                                  embedded=bool(student_values.get("embedded")))
    raise_if(problems)
    return _absolute(job, embedded=bool(student_values.get("embedded")))


def format_problems(formats) -> list[str]:
    """Native formats whose writer's package is not installed (found without importing it)."""
    found = []
    for name in formats:
        package, install = FORMAT_PACKAGES.get(name, (None, None))
        if package and importlib.util.find_spec(package.split(".")[0]) is None:
            found.append(f"export.formats: {name} is written with the {package.split('.')[0]} package, which is "
                         f"not installed ({install})")
    return found


def file_problems(folders, student: Mapping, embedded: bool) -> list[str]:
    """Scored folders that are missing or hold no dataset, and a student model or tokenizer given
    as a local path that does not exist (or, for the model, holds none), each with its fix."""
    found = scored_folder_problems(folders)
    model = None if embedded else local_model_problem("student.model", student.get("model"))
    tokenizer = student.get("tokenizer")
    if isinstance(tokenizer, str) and tokenizer and looks_local(tokenizer) and not os.path.exists(os.path.expanduser(tokenizer)):
        found.append(f"student.tokenizer: no such local file or folder: {tokenizer}")
    return found + ([model] if model else [])


def _absolute(job: ExportJobConfig, embedded: bool) -> ExportJobConfig:
    """Local paths made absolute (the output folder, scored folders, the student, the cache)."""
    def local(path: str | None, always: bool = False) -> str | None:
        if path and not sfs.is_remote(path) and (always or Path(path).exists()):
            return os.path.abspath(path)
        return path

    s, d = job.student, job.data
    return replace(
        job, output_dir=local(job.output_dir, always=True),
        student=replace(s, model=local(s.model, always=embedded), tokenizer=local(s.tokenizer)),
        data=replace(d, folders=[local(f, always=True) for f in d.folders], cache_dir=local(d.cache_dir, always=True)),
    )
