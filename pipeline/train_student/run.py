"""Stage 2 as a library call: train a student on a scored dataset with the teacher-guided loss.

:func:`run_training` reads as its steps: resolve the batch geometry, open and validate the scored
data, refuse a length the scored data cannot hold (:func:`check_token_budget`, before the token
count), load the student's tokenizer and plan the packed samples (docs/METHOD.md §2.4), check the run
folder (resume or refuse, :mod:`pipeline.train_student.checkpoints`; or continue another run,
:mod:`pipeline.train_student.continuation`), load the student, train with
:class:`pipeline.train_student.trainer.GuidedTrainer` (the schedule:
:mod:`pipeline.train_student.schedule`; held-out bits per byte every ``train.eval_every`` steps),
save the final model. Everything that can fail
on bad input fails before the model is loaded. Resuming restores weights, optimizer, schedule, RNG
and data position, so a run killed at any moment and resumed logs the per-step losses of an
uninterrupted one (docs/METHOD.md §2.5).

:func:`train_job_config` builds the typed job from a config mapping (``conf/train_student.yaml``),
reporting every problem at once; its ``loss`` group is :class:`SelectionConfig` plus
:class:`AlignmentConfig`. The student's weights load with ``use_safetensors=True`` and remote code
runs only when ``student.trust_remote_code`` is set. Batch geometry: ``micro_batch_size`` sequences
per process per forward pass, and either ``global_batch_tokens`` (accumulation follows from the
world size) or ``gradient_accumulation_steps``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Mapping

import torch
from transformers import AutoModelForCausalLM, TrainingArguments

from pipeline.method.bits_per_byte import TEXT_SUFFIXES, shard_documents, text_file_documents
from pipeline.runtime.config import (
    ConfigError,
    Interrupted,
    build,
    check_at_least,
    check_choice,
    defaults,
    lift_progress,
    raise_if,
)
from pipeline.runtime.cpu_threads import threads_for, torch_threads
from pipeline.folders.folder_lock import exclusive_writer
from pipeline.student_data.held_out_shards import held_out_entries, held_out_record, hold_out
from pipeline.method.guided_loss import SelectionConfig
from pipeline.folders.model_source import (
    TeacherSourceError,
    check_tokenizer_source,
    local_model_problem,
    model_positions,
    refuse_seq_len,
)
from pipeline.folders.provenance import model_identity
from pipeline.folders.rehearsal import refuse_rehearsal, warn_rehearsal
from pipeline.student_data.several_teachers import MISSING_RULES, open_teachers
from pipeline.student_data.student_side import (
    AlignmentConfig,
    scored_folder_problems,
    PackingConfig,
    StudentData,
    build_student_data,
    collate_packed,
    student_per_teacher_token,
)
from pipeline.method.tokenization import fingerprint, load_tokenizer
from pipeline.folders.output_folder import SetAside, overlap_problem
from pipeline.train_student.checkpoints import (  # noqa: F401  (RunMismatchError: the run's refusal)
    METRICS_NAME,
    RunMismatchError,
    checkpoint_step,
    is_run_entry,
    prepare_run_folder,
    recover_run_folder,
    read_guard_state,
    read_loss_sum,
    recorded_summary,
    resolve_checkpoint,
    save_final,
    trainer_state,
)
from pipeline.train_student.from_export import ExportData, open_export_data
from pipeline.train_student.mixture import (
    CorpusData,
    MixtureCorpus,
    MixtureData,
    build_mixture,
    mixture_problems,
    recipe_of,
)
from pipeline.train_student.continuation import (
    CONTINUE_NEEDS_WSD,
    continuation_checkpoint,
    continuation_problems,
    start_from_source,
)
from pipeline.train_student.schedule import SCHEDULES, schedule_callbacks, schedule_problems, scheduler_arguments
from pipeline.train_student.several_teachers import TeacherMetrics
from pipeline.train_student.trackers import start_trackers, tracker_callbacks, tracker_problems
from pipeline.train_student.trainer import (
    CheckpointRecordCallback,
    GuidedTrainer,
    JsonlMetricsCallback,
    NonFiniteGuard,
    NonFiniteLossError,
)
from storage_schemas import filesystem as sfs
from storage_schemas import store_calls
from storage_schemas.reader import ON_BAD_SHARD, VERIFY, ScoredDataset, ScoredFolder

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
SAVE_DTYPES = ("auto", "float32", "bfloat16", "float16")


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class StudentConfig:
    name: str
    model: str  # hub id or local folder
    revision: str | None = None
    tokenizer: str | None = None  # defaults to the model's own
    seq_len: int = 2048
    attn_implementation: str | None = None  # e.g. sdpa, flash_attention_2
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False

    def problems(self) -> list[str]:
        found: list[str] = []
        check_at_least(found, "seq_len", self.seq_len, 1)
        return found


@dataclass(frozen=True)
class DataConfig:
    folders: list[str]  # scored dataset folders (stage-1 output) of one teacher
    on_bad_shard: str = "error"  # error | skip
    verify: str = "size"  # size | sha256 (full read of every shard on open)
    allow_partial: bool = False  # train on the finished shards of an incomplete scoring
    allow_rehearsal: bool = False  # train on a rehearsal's scores (scorer.backend=rehearsal: no model's losses)
    cache_dir: str | None = None  # student token counts per shard (None: no cache)
    seed: int = 0
    shuffle: bool = True
    epochs: int = 1
    add_bos: bool | None = None  # None: as the student's tokenizer does
    add_eos: bool = True
    num_workers: int = 1  # data-loader worker processes (tokenization and alignment run there)
    prefetch_factor: int | None = None
    length_workers: int = 1  # processes for the one-off token count pass
    missing_documents: str = "refuse"  # several teachers: a document one lacks is refused | unmapped for it
    token_ratio_bound: float = 1.25  # student tokens per teacher token assumed at most, before the count
    held_out_shards: int = 0  # the last N planned shards of the first folder are never trained on (eval-student's held-out text)
    mixture: list[MixtureCorpus] | None = None  # several corpora drawn at set weights (folders is then not read)
    export: str | None = None  # a make export-student folder to train on instead of aligning the folders again

    def problems(self) -> list[str]:
        found: list[str] = []
        check_at_least(found, "held_out_shards", self.held_out_shards, 0)
        found += source_problems(self)
        check_choice(found, "on_bad_shard", self.on_bad_shard, ON_BAD_SHARD)
        check_choice(found, "missing_documents", self.missing_documents, MISSING_RULES)
        if not self.token_ratio_bound > 0:
            found.append(f"token_ratio_bound: must be > 0, got {self.token_ratio_bound}")
        check_choice(found, "verify", self.verify, VERIFY)
        check_at_least(found, "epochs", self.epochs, 1)
        check_at_least(found, "num_workers", self.num_workers, 0)  # 0: the training process loads the data
        if not self.folders and not self.mixture and not self.export:
            found.append("folders: no scored dataset folder given")
        return found


def source_problems(d: DataConfig) -> list[str]:
    """Where the data comes from: ``folders``, ``mixture`` or ``export``, and what each allows."""
    found: list[str] = []
    if d.mixture is not None:
        if not d.mixture:
            found.append("mixture: an empty list; list the corpora (name, weight, folders or export), or leave it null")
        found += mixture_problems(d.mixture)
        if d.export:
            found.append("export: give an export inside data.mixture (data.mixture[i].export), not beside it")
    return found


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 8
    gradient_accumulation_steps: int | None = None
    global_batch_tokens: int | None = None
    max_steps: int | None = None  # None: max_tokens, else one pass over the packed data
    max_tokens: int | None = None
    learning_rate: float = 8e-5
    min_learning_rate: float = 8e-6  # cosine decays to this
    warmup_steps: int = 0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    precision: str = "auto"  # auto: bf16 on a GPU that supports it, else fp32 | bf16 | fp16 | fp32
    save_dtype: str = "auto"  # the final model's weights; auto: the training precision (bf16 on GPUs)
    seed: int = 0
    logging_steps: int = 10
    save_steps: int = 500
    save_total_limit: int | None = 3
    resume: str = "auto"  # auto | never | <checkpoint folder>
    progress: bool = True
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    use_cpu: bool = False
    ddp_backend: str | None = None  # None: nccl on GPUs, gloo on CPUs
    ddp_timeout: int = 7200  # seconds; the other ranks wait this long for global rank 0's token count pass
    torch_compile: bool = False
    cpu_threads: int | None = None  # torch intra-op threads while training (None: the usable cores; never more)
    max_nonfinite_in_a_row: int = 5  # skipped (non-finite) optimizer steps in a row before the run stops
    lr_scheduler: str = "cosine"  # cosine: to min_learning_rate over the whole run | wsd: warm-up, stable, decay
    lr_decay_share: float = 0.2  # wsd: the decay's share of the run's steps
    lr_decay_steps: int | None = None  # wsd: the decay's length in steps (instead of lr_decay_share)
    continue_from: str | None = None  # a wsd run's folder: this run continues it from the end of its stable phase
    eval_every: int | None = None  # held-out bits per byte every N optimizer steps (and at the end)
    eval_texts: list[str] = field(default_factory=list)  # .txt/.jsonl files (none: data.held_out_shards' documents)
    eval_max_documents: int | None = None  # the first N held-out documents (None: all)
    eval_batch_size: int = 8  # blocks per forward pass of the evaluation

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "precision", self.precision, PRECISIONS)
        check_choice(found, "lr_scheduler", self.lr_scheduler, SCHEDULES)
        if not 0 < self.lr_decay_share < 1:
            found.append(f"lr_decay_share: {self.lr_decay_share} is not in (0, 1)")
        for name in ("lr_decay_steps", "eval_every", "eval_max_documents", "eval_batch_size"):
            check_at_least(found, name, getattr(self, name), 1)
        found += [f"eval_texts: {path}: not a .txt or .jsonl file" for path in self.eval_texts
                  if Path(path).suffix not in TEXT_SUFFIXES]
        if self.continue_from is not None and self.lr_scheduler != "wsd":
            found.append(f"continue_from: a continuation follows the wsd schedule (train.lr_scheduler=wsd), not "
                         f"{self.lr_scheduler}: {CONTINUE_NEEDS_WSD}")
        check_choice(found, "save_dtype", self.save_dtype, SAVE_DTYPES)
        for name in ("micro_batch_size", "logging_steps", "save_steps", "max_nonfinite_in_a_row", "max_steps",
                     "max_tokens", "gradient_accumulation_steps", "global_batch_tokens", "save_total_limit"):
            check_at_least(found, name, getattr(self, name), 1)
        check_at_least(found, "warmup_steps", self.warmup_steps, 0)
        if not self.learning_rate > 0:
            found.append(f"learning_rate: {self.learning_rate} must be > 0")
        if self.max_steps is not None and self.max_tokens is not None:
            found.append("max_steps: set max_steps or max_tokens, not both")
        if self.min_learning_rate > self.learning_rate:
            found.append(f"min_learning_rate: {self.min_learning_rate} exceeds train.learning_rate {self.learning_rate}")
        found += tracker_problems(self.report_to)
        return found


# Train settings that do not change what is computed: they may differ on a resume.
OPERATIONAL = ("logging_steps", "save_steps", "save_total_limit", "resume", "progress", "report_to",
               "ddp_backend", "ddp_timeout", "torch_compile", "cpu_threads", "max_nonfinite_in_a_row", "save_dtype",
               "eval_every", "eval_texts", "eval_max_documents", "eval_batch_size")
# A cosine run's recipe leaves these out, so that it reads as it did before wsd existed.
WSD_KEYS = ("lr_scheduler", "lr_decay_share", "lr_decay_steps")


@dataclass(frozen=True)
class TrainJobConfig:
    student: StudentConfig
    data: DataConfig
    train: TrainConfig
    output_dir: str
    overwrite: bool = False  # delete this run's checkpoints and metrics first
    selection: SelectionConfig = field(default_factory=SelectionConfig)  # the config's loss.mode, ratio, ...
    alignment: AlignmentConfig = field(default_factory=AlignmentConfig)  # loss.alignment, aggregate, n_chunks

    def problems(self) -> list[str]:
        """Problems that involve more than one group."""
        t = self.train
        if t.eval_every is not None and not t.eval_texts and not self.data.held_out_shards:
            return ["train.eval_every: no held-out text to evaluate on; hold shards out (data.held_out_shards=N), "
                    "give text files (train.eval_texts=[...]) or turn the evaluation off (train.eval_every=null)"]
        return []

    def recipe(self) -> dict:
        """What a resumed run must share with the interrupted one (``run.json``)."""
        data = {k: v for k, v in asdict(self.data).items()
                if k not in ("folders", "num_workers", "prefetch_factor", "length_workers", "cache_dir",
                             "allow_rehearsal",  # what it accepts, not what it computes
                             "missing_documents",  # several teachers: in the data identity
                             "held_out_shards",  # in the data identity (shards_held_out)
                             "token_ratio_bound",
                             "mixture", "export")}  # where the data is; the identity pins what it holds
        if self.data.mixture:
            data["mixture"] = recipe_of(self.data.mixture)
        train = {k: v for k, v in asdict(self.train).items() if k not in OPERATIONAL
                 and k != "continue_from"  # where it started; its own checkpoints hold the state
                 and not (k in WSD_KEYS and self.train.lr_scheduler == "cosine")}
        student = {k: v for k, v in asdict(self.student).items() if k != "name"}
        loss = {**asdict(self.selection), "aggregate": self.alignment.aggregate,
                "alignment": self.alignment.method, "n_chunks": self.alignment.n_chunks}
        return {"student": student, "data": data, "loss": loss, "train": train}


def validate(job: TrainJobConfig, world_size: int = 1) -> list[str]:
    """Every problem of the configuration, as readable lines (empty when it is valid): each
    group's own, and the batch geometry for ``world_size`` processes."""
    p: list[str] = []
    for where, part in (("student", job.student), ("data", job.data), ("train", job.train),
                        ("loss", job.selection)):
        p += [f"{where}.{line}" for line in part.problems()]
    p += [f"loss.{line.replace('method:', 'alignment:', 1)}" for line in job.alignment.problems()]
    p += job.problems()
    try:
        batch_geometry(job, world_size)
    except ValueError as exc:
        p.append(str(exc))
    overlap = run_folder_problem(job)
    return p + ([overlap] if overlap else [])


def run_folder_problem(job: TrainJobConfig) -> str | None:
    """The run folder may not be, hold or lie inside what the run reads (the student, its
    tokenizer, a scored folder, an export, a mixture's corpora, and with ``overwrite`` the checkpoint ``train.resume`` names),
    whatever ``overwrite`` says (:func:`pipeline.folders.output_folder.overlap_problem`)."""
    inputs = {"student.model": job.student.model, "student.tokenizer": job.student.tokenizer,
              **{f"data.folders[{i}]": f for i, f in enumerate(job.data.folders)}}
    if job.data.export:
        inputs["data.export"] = job.data.export
    for i, corpus in enumerate(job.data.mixture or []):
        inputs.update({f"data.mixture[{i}].folders[{j}]": f for j, f in enumerate(corpus.folders)})
        if corpus.export:
            inputs[f"data.mixture[{i}].export"] = corpus.export
    if job.overwrite and job.train.resume not in ("auto", "never"):
        inputs["train.resume"] = job.train.resume  # overwrite=true would set it aside before resuming from it
    problem = overlap_problem(job.output_dir, inputs)
    return problem and (f"{problem}, so the run may not write there, whatever overwrite says: train into a folder "
                        "of its own, run_name=<a new name> (or output_dir=<a new folder>)")


# The job's configuration as a config file writes it (conf/train_student.yaml). The ``loss`` group
# is SelectionConfig's fields plus AlignmentConfig's, its ``method`` written ``loss.alignment``.
LOSS_ALIGNMENT_KEYS = {"alignment": "method"}
STUDENT_RECIPE_KEYS = ("embedded", "build")  # the embedded student's build, for the front end
DATA_NAMING_KEYS = ("corpus", "teacher")  # name the default folders and the run
FRONT_END_KEYS = ("artifacts_dir", "scored_root", "student_root", "run_name", "hydra", "plan", "plan_measure")


def config_defaults() -> dict:
    """Every setting of the job with its default, as the config file is laid out; the YAML files
    override these."""
    return {
        "student": defaults(StudentConfig),
        "data": defaults(DataConfig),
        "loss": {**defaults(SelectionConfig), **defaults(AlignmentConfig, rename=LOSS_ALIGNMENT_KEYS)},
        "train": defaults(TrainConfig),
        **defaults(TrainJobConfig, drop=("student", "data", "train", "selection", "alignment")),
        "progress": None,  # every command's key for its progress bars: sets train.progress (lift_progress)
    }


def train_job_config(values: Mapping, check_files: bool = False) -> TrainJobConfig:
    """The typed job from a composed config (plain mapping). Every problem is reported in one
    :class:`pipeline.runtime.config.ConfigError`: unknown keys, wrong types, bad choices and ranges in
    every group and the batch geometry for one process (checked again for the real world size);
    with ``check_files``, also scored folders that do not exist and a local student that does not
    (unless it is the embedded one, built later). Local paths become absolute."""
    problems: list[str] = []
    values = lift_progress(values, "train")
    student_values, loss = dict(values.get("student") or {}), dict(values.get("loss") or {})
    selection_keys = set(defaults(SelectionConfig))
    parts = {
        "student": build(StudentConfig, student_values, "student", problems, drop=STUDENT_RECIPE_KEYS),
        "data": build(DataConfig, values.get("data"), "data", problems, drop=DATA_NAMING_KEYS),
        "train": build(TrainConfig, values.get("train"), "train", problems),
        "selection": build(SelectionConfig, {k: v for k, v in loss.items() if k in selection_keys}, "loss", problems),
        "alignment": build(AlignmentConfig, {k: v for k, v in loss.items() if k not in selection_keys}, "loss",
                           problems, rename=LOSS_ALIGNMENT_KEYS, also_known=selection_keys),
    }
    top = {k: v for k, v in values.items() if k not in ("student", "data", "train", "loss", *FRONT_END_KEYS)}
    job = build(TrainJobConfig, {**top, **{k: v for k, v in parts.items() if v is not None}}, "", problems,
                assume=parts)
    if parts["train"] is not None and parts["student"] is not None:
        try:
            _geometry(parts["train"], parts["student"].seq_len, world_size=1)
        except ValueError as exc:
            problems.append(str(exc))
    if check_files:  # from the values as written: a bad value elsewhere in the group does not hide them
        data_values = values.get("data") or {}
        folders = None if data_values.get("mixture") else data_values.get("folders")  # a mixture does not read them
        problems += file_problems(folders, student_values.get("model"), embedded_student=bool(student_values.get("embedded")))
        problems += source_file_problems(data_values)
        overlap = run_folder_problem(job) if job is not None else None
        problems += [overlap] if overlap else []
        train_values = values.get("train") or {}
        problems += continuation_problems(train_values.get("continue_from"), str(values.get("output_dir", "")))
        problems += [f"train.eval_texts: text file not found: {path}" for path in train_values.get("eval_texts") or []
                     if isinstance(path, str) and Path(path).suffix in TEXT_SUFFIXES and not Path(path).is_file()]
    raise_if(problems)
    embedded = bool(student_values.get("embedded"))
    model = job.student.model
    data = job.data
    return replace(
        job, output_dir=os.path.abspath(job.output_dir),
        student=replace(job.student, model=os.path.abspath(model)) if embedded or Path(model).exists() else job.student,
        data=replace(data, folders=_absolute(data.folders), cache_dir=os.path.abspath(data.cache_dir) if data.cache_dir else None,
                     export=_absolute([data.export])[0] if data.export else None,
                     mixture=[replace(c, folders=_absolute(c.folders), export=_absolute([c.export])[0] if c.export else None)
                              for c in data.mixture] if data.mixture else data.mixture),
    )


def _absolute(paths: list[str]) -> list[str]:
    return [p if sfs.is_remote(p) else os.path.abspath(p) for p in paths]


def file_problems(folders, model, embedded_student: bool = False) -> list[str]:
    """Scored folders that are missing or hold no dataset, and a student given as a local path
    that does not exist or holds no model (each with its fix)."""
    found = scored_folder_problems(folders)
    problem = None if embedded_student else local_model_problem("student.model", model)
    return found + ([problem] if problem else [])


def check_student_source(student: StudentConfig) -> None:
    """Raise :class:`pipeline.folders.model_source.TeacherSourceError`, one line naming the setting and the
    ways out, within seconds, unless a hub student (and a hub tokenizer of its own) is in the Hugging
    Face cache or on a reachable hub: before any work, as stage 1 checks its teacher. Local paths are
    the configuration checks' (:func:`file_problems`)."""
    for setting, source in (("student.model", student.model), ("student.tokenizer", student.tokenizer)):
        if source and not os.path.exists(os.path.expanduser(source)):
            try:
                check_tokenizer_source(setting, source, student.revision)
            except TeacherSourceError as exc:  # its local way out names a tokenizer; student.model is a model folder
                raise TeacherSourceError(str(exc).replace("student.model=/path/to/tokenizer",
                                                          "student.model=/path/to/folder")) from None


def source_file_problems(data_values: Mapping) -> list[str]:
    """Scored folders and exports of ``data.mixture`` and ``data.export`` that do not exist."""
    found = []
    mixture = data_values.get("mixture")
    for i, corpus in enumerate(mixture if isinstance(mixture, list) else []):
        if isinstance(corpus, Mapping):
            found += [line.replace("data.folders", f"data.mixture[{i}].folders")
                      for line in file_problems(corpus.get("folders"), None)]
            found += _export_missing(corpus.get("export"), f"data.mixture[{i}].export")
    return found + _export_missing(data_values.get("export"), "data.export")


def _export_missing(folder, key: str) -> list[str]:
    if isinstance(folder, str) and folder and not sfs.is_dir(folder):
        return [f"{key}: export folder not found: {folder} (write it first: make export-student with the run's "
                "student and data settings)"]
    return []


def batch_geometry(job: TrainJobConfig, world_size: int) -> tuple[int, int]:
    """``(gradient_accumulation_steps, tokens per optimizer step)`` for ``world_size`` processes."""
    return _geometry(job.train, job.student.seq_len, world_size)


def _geometry(t: TrainConfig, seq_len: int, world_size: int) -> tuple[int, int]:
    per_pass = t.micro_batch_size * seq_len * world_size  # tokens of one forward on all ranks
    if t.global_batch_tokens is not None:
        if t.global_batch_tokens % per_pass:
            raise ConfigError(
                f"train.global_batch_tokens {t.global_batch_tokens} is not a multiple of micro_batch_size x seq_len "
                f"x processes = {t.micro_batch_size} x {seq_len} x {world_size} = {per_pass}"
            )
        accumulation = t.global_batch_tokens // per_pass
        if t.gradient_accumulation_steps not in (None, accumulation):
            raise ConfigError(f"train.gradient_accumulation_steps {t.gradient_accumulation_steps} contradicts "
                             f"global_batch_tokens (which gives {accumulation} with {world_size} processes)")
    else:
        accumulation = t.gradient_accumulation_steps or 1
    if accumulation < 1:
        raise ConfigError(f"train.gradient_accumulation_steps must be >= 1, got {accumulation}")
    return accumulation, accumulation * per_pass


# --------------------------------------------------------------------------------------------
# The run


@dataclass
class TrainSummary:
    output_dir: str
    final_model: str
    steps: int
    resumed_from: str | None
    tokens_per_step: int
    tokens_trained: int  # in this call
    seconds: float
    data: dict  # plan summary, shards used/skipped, alignment
    last_log: dict
    nonfinite_steps: list[int] = field(default_factory=list)  # optimizer steps skipped (whole run)
    store_calls: dict = field(default_factory=dict)  # object-store requests and the client's retries (store_calls)
    evaluations: list[dict] = field(default_factory=list)  # train.eval_every: {step, eval_bits_per_byte, ...}
    train_loss: float | None = None  # the mean loss over all the run's steps, resumed or continued ones included
    already_complete: bool = False  # the run had ended before this call: it trained and wrote nothing

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_trained / self.seconds if self.seconds > 0 else 0.0


def run_training(job: TrainJobConfig, callbacks: list | None = None) -> TrainSummary:
    """Train the student (module docstring). ``callbacks`` are extra ``TrainerCallback``s.

    The global rank-0 process holds an exclusive lock on the run folder for the whole run, so a
    second launch of the same run is refused instead of interleaving checkpoints.
    """
    store_calls.start(own=True)  # before any S3 request: this run's counts are its own
    with contextlib.ExitStack() as lock:
        summary = _run_training(job, callbacks, lock)
    return replace(summary, store_calls=store_calls.snapshot())  # this process and its data-loader workers


def _run_training(job: TrainJobConfig, callbacks: list | None, lock: contextlib.ExitStack) -> TrainSummary:
    t0 = time.perf_counter()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    problems = validate(job, world_size)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    s = job.student  # the sequence against the student's positions first: every later count depends on it
    refuse_seq_len(s.seq_len, s.model, model_positions(s.model, s.revision, s.trust_remote_code))
    accumulation, tokens_per_step = batch_geometry(job, world_size)
    args = _training_arguments(job, accumulation, max_steps=1)  # max_steps is set once the data is known

    tokenizer = load_tokenizer(job.student.tokenizer or job.student.model, revision=job.student.revision,
                               trust_remote_code=job.student.trust_remote_code)
    args.process_index  # noqa: B018  (sets up the process group: every rank takes the token counts from rank 0)
    data = prepare_data(job, tokenizer,
                        check=lambda scored: check_token_budget(job, scored, world_size, accumulation, tokenizer))
    with args.main_process_first(local=True, desc="student identity"):
        student = model_identity(job.student.model, job.student.revision)  # digests cached for the other ranks
    args.max_steps = _number_of_steps(job, data, world_size, accumulation, tokens_per_step)
    raise_if(schedule_problems(job.train, args.max_steps))
    for key, value in scheduler_arguments(job.train, args.max_steps).items():
        setattr(args, key, value)
    data.dataset.end = args.max_steps * job.train.micro_batch_size * world_size * accumulation  # samples trained
    identity = data.identity(fingerprint(tokenizer), _packing(job))
    if job.data.held_out_shards and data.scored is not None:  # only then: every other identity stays as it was
        identity["shards_held_out"] = held_out_record(data.scored.folders[0], job.data.held_out_shards)
    held_out = held_out_texts(job, data)

    if int(os.environ.get("RANK", "0")) == 0:  # only after validation: a refused run writes nothing
        lock.enter_context(exclusive_writer(job.output_dir, what="training run"))
    with args.main_process_first(local=False, desc="run folder recovery"):
        if args.process_index == 0:
            recover_run_folder(job.output_dir)
    checkpoint = resolve_checkpoint(job.output_dir, job.train.resume, job.overwrite, job.recipe(), identity, student)
    recorded = recorded_summary(job.output_dir, checkpoint, args.max_steps)
    if recorded is not None:  # the same command again after the run's end: nothing is trained or written
        names = {f.name for f in fields(TrainSummary)}
        return TrainSummary(**{k: v for k, v in recorded.items() if k in names}, already_complete=True)
    continued = None  # a new continuation: it starts from the source run's stable checkpoint
    if checkpoint is None and job.train.continue_from:
        checkpoint = continued = continuation_checkpoint(job, identity, student, args.max_steps)
    aside = SetAside(Path(job.output_dir), is_run_entry)  # what overwrite=true set aside (rank 0)
    with args.main_process_first(local=False, desc="run folder"):
        if args.process_index == 0:
            aside = prepare_run_folder(job.output_dir, job.overwrite, checkpoint, job.recipe(), student)
            if continued:
                start_from_source(job.train.continue_from, job.output_dir, continued)

    try:
        trainer, start_step = train_from(checkpoint, job, args, tokenizer, data, identity, callbacks, held_out,
                                         on_checkpoint=aside.commit)
        final = save_final(trainer, job.output_dir, identity, final_dtype(job.train))
    except BaseException:
        aside.restore()  # nothing saved yet: the old run comes back whole (a no-op once committed)
        raise
    aside.commit()
    return _summary(job, trainer, data, checkpoint, start_step, tokens_per_step, final, time.perf_counter() - t0)


def train_from(checkpoint: str | None, job: TrainJobConfig, args, tokenizer, data: StudentData, identity: dict,
               callbacks: list | None, held_out: list[str] | None = None, on_checkpoint=None):
    """Load the student and train it from ``checkpoint`` (or from scratch) to ``args.max_steps``.

    A checkpoint already at ``max_steps`` is a finished run: its weights are loaded and nothing is
    trained (the HF Trainer would otherwise train one step past the end). The count of skipped
    non-finite steps continues from the checkpoint's; a run stopped by too many of them in a row
    raises :class:`NonFiniteLossError` (after its checkpoint is saved), one stopped by SIGTERM or
    SIGUSR1 :class:`pipeline.runtime.config.Interrupted` (after its checkpoint at the step under way is
    saved: :meth:`GuidedTrainer.saving_on_signals`). ``held_out``: the texts of
    the evaluation while training (:func:`held_out_texts`). ``on_checkpoint`` is called once each
    checkpoint is complete. Returns the trainer and the step it started from.
    """

    start_step = checkpoint_step(checkpoint)
    finished = start_step >= args.max_steps
    student = replace(job.student, model=checkpoint, revision=None) if finished else job.student
    guard = NonFiniteGuard(max_in_a_row=job.train.max_nonfinite_in_a_row)
    guard.restore(read_guard_state(checkpoint))
    trainer = _trainer(job, args, load_student(student, len(tokenizer)), tokenizer, data, identity, guard, callbacks,
                       held_out, on_checkpoint)
    trainer.earlier_loss_sum = read_loss_sum(checkpoint)  # the whole run's train_loss (trainer module docstring)
    if finished:
        log.info("%s is at step %d of %d: nothing to train", checkpoint, start_step, args.max_steps)
        trainer.state.log_history = trainer_state(checkpoint).get("log_history", [])
        trainer.state.global_step = start_step
    else:
        with _cpu_threads(job.train.cpu_threads), trainer.saving_on_signals():
            trainer.train(resume_from_checkpoint=checkpoint)
    if trainer.stop_reason:
        raise NonFiniteLossError(trainer.stop_reason)
    step = trainer.state.global_step
    if trainer.stop_signal is not None and step < args.max_steps:  # its last step is the run's end: it finishes
        raise Interrupted(trainer.stop_signal, f"checkpoint-{step} saved at step {step} of {args.max_steps} "
                                               f"({Path(job.output_dir) / f'checkpoint-{step}'}); the same command "
                                               "resumes from it")
    return trainer, start_step


def _summary(job, trainer, data: StudentData, checkpoint, start_step, tokens_per_step, final, seconds) -> TrainSummary:
    steps = trainer.state.global_step
    return TrainSummary(
        output_dir=job.output_dir, final_model=str(final), steps=steps, resumed_from=checkpoint,
        tokens_per_step=tokens_per_step, tokens_trained=(steps - start_step) * tokens_per_step, seconds=seconds,
        data=data.summary(),
        last_log=next((r for r in reversed(trainer.state.log_history) if "loss_kept" in r), {}),
        nonfinite_steps=list(trainer.guard.skipped),
        evaluations=[r for r in trainer.state.log_history if "eval_bits_per_byte" in r],
        train_loss=next((r["train_loss"] for r in reversed(trainer.state.log_history) if "train_loss" in r), None),
    )


def prepare_data(job: TrainJobConfig, tokenizer, check=None) -> StudentData | MixtureData | ExportData:
    """Open the scored folders, run ``check(scored)`` (before the token count), count and plan; or
    mix the corpora of ``data.mixture`` (:func:`prepare_mixture`), or read ``data.export``
    (:mod:`pipeline.train_student.from_export`)."""
    d = job.data
    if d.mixture:
        return prepare_mixture(job, tokenizer)
    if d.export:  # the rows are read as they were exported: nothing is counted, tokenized or aligned
        return open_export_data(d.export, tokenizer, job.student.seq_len, d, job.alignment)
    scored = open_teachers(d.folders, on_bad_shard=d.on_bad_shard, verify=d.verify, allow_partial=d.allow_partial)
    warn_rehearsal(refuse_rehearsal(scored, d.allow_rehearsal))
    scored = hold_out(scored, d.held_out_shards)
    if check is not None:
        check(scored)
    return build_student_data(scored, tokenizer, _packing(job), job.alignment, cache_dir=d.cache_dir,
                              num_proc=d.length_workers, on_bad_shard=d.on_bad_shard,
                              missing_documents=d.missing_documents)


def prepare_mixture(job: TrainJobConfig, tokenizer) -> MixtureData:
    """Each corpus of ``data.mixture`` packed as a single-corpus run of its folders would be, with
    its own passes (``epochs``, else ``data.epochs``), then mixed (:mod:`pipeline.train_student.mixture`).
    ``data.held_out_shards`` holds shards of the first corpus out."""
    corpora = []
    for i, corpus in enumerate(job.data.mixture):
        epochs = corpus.epochs or job.data.epochs
        one = replace(job.data, folders=list(corpus.folders), epochs=epochs, mixture=None, export=corpus.export,
                      held_out_shards=job.data.held_out_shards if i == 0 else 0)
        log.info("corpus %s of the mixture (weight %g, at most %d pass(es))", corpus.name, corpus.weight, epochs)
        corpora.append(CorpusData(corpus.name, corpus.weight, epochs, prepare_data(replace(job, data=one), tokenizer)))
    return build_mixture(corpora, job.data.seed, job.student.seq_len)


def held_out_texts(job: TrainJobConfig, data: StudentData) -> list[str] | None:
    """The documents ``train.eval_every`` measures bits per byte on (None: no evaluation): those of
    ``train.eval_texts``, else of the shards ``data.held_out_shards`` holds out, at most
    ``train.eval_max_documents``, empty ones left out."""
    t = job.train
    if t.eval_every is None:
        return None
    if t.eval_texts:
        texts = [text for path in t.eval_texts for text in text_file_documents(path) if text]
        where = f"train.eval_texts ({', '.join(t.eval_texts)})"
    else:
        folder = held_out_folder(job, data)
        files = [e["file"] for e in held_out_entries(folder, job.data.held_out_shards)]
        texts = shard_documents(ScoredDataset.open(folder.path), files, t.eval_max_documents)
        where = f"the held-out shards of {folder.path} ({', '.join(files)})"
    if not texts:
        raise ConfigError(f"train.eval_every: {where} hold no document to evaluate on")
    return texts[: t.eval_max_documents]


def held_out_folder(job: TrainJobConfig, data) -> ScoredFolder:
    """The scored folder whose last ``data.held_out_shards`` shards are held out: the first the run
    reads, or for an export (which holds them out too, and records them) the first of
    ``data.folders`` (of the first corpus of a mixture), whose held-out shards it must equal."""
    if data.scored is not None:
        return data.scored.folders[0]
    folders = job.data.mixture[0].folders if job.data.mixture else job.data.folders
    if not folders:
        raise ConfigError("train.eval_every: the held-out text of an export is read from its scored folders; give "
                          "them (data.folders=[...], as the export's), evaluate on text files (train.eval_texts=[...]) "
                          "or not at all (train.eval_every=null)")
    return ScoredDataset.open(folders[0]).folders[0]


def _packing(job: TrainJobConfig) -> PackingConfig:
    d = job.data
    return PackingConfig(seq_len=job.student.seq_len, seed=d.seed, shuffle=d.shuffle, epochs=d.epochs,
                         add_bos=d.add_bos, add_eos=d.add_eos)


# The bound's margin over the student-per-teacher-token ratio of a sample of documents
SAMPLED_RATIO_MARGIN = 1.25


def check_token_budget(job: TrainJobConfig, scored, world_size: int, accumulation: int, tokenizer=None) -> None:
    """Refuse, before the token count, a run asking for more optimizer steps than the scored data
    can possibly give.

    The student's token count is not known before the count pass, so it is bounded from the
    teacher's, which every manifest records per shard: at most ``data.token_ratio_bound``
    student tokens per teacher token, or, with the student's ``tokenizer``, 1.25 times the ratio
    on a sample of documents where that is more (a small student vocabulary against a large
    teacher's: stories260K's 512 tokens give 1.9 per SmolLM2 token on real mathematics), plus BOS
    and EOS per document, times ``data.epochs``. A run that passes may still be refused after the
    count (:func:`_number_of_steps`), with the exact numbers. Shards whose manifest entry records
    no token count leave the check out.
    """
    t, d = job.train, job.data
    samples_per_step = t.micro_batch_size * world_size * accumulation
    tokens_per_step = samples_per_step * job.student.seq_len
    if t.max_steps is not None:
        asked, what = t.max_steps, f"train.max_steps {t.max_steps:,}"
    elif t.max_tokens is not None:
        asked, what = math.ceil(t.max_tokens / tokens_per_step), f"train.max_tokens {t.max_tokens:,}"
    else:
        return  # one pass over whatever the data holds
    # Several teachers: with missing_documents=refuse every teacher holds the same documents, so the
    # largest teacher count bounds the stream; with unmapped the stream is at most their union (the sum).
    teachers = scored if isinstance(scored, list) else [scored]
    counts = [_recorded_tokens(one) for one in teachers]
    if any(c is None for c in counts):
        log.warning("a manifest records no token count for some shard: the length is checked after the token count")
        return
    pick = max if d.missing_documents == "refuse" else lambda cs: tuple(map(sum, zip(*cs)))
    teacher_tokens, documents = pick(counts)
    n_shards = sum(len(one.shards) for one in teachers)
    ratio, why = d.token_ratio_bound, "data.token_ratio_bound"

    def steps_at_most(ratio: float) -> tuple[int, int]:
        per_pass = math.floor(teacher_tokens * ratio) + 2 * documents  # stream tokens, at most
        return per_pass, max(0, (per_pass * d.epochs - 1) // job.student.seq_len) // samples_per_step

    per_pass, bound = steps_at_most(ratio)
    if asked <= bound:
        return
    # Only a run the fixed bound would refuse reads a sample (the sampled ratio can only raise it):
    # the usual run reads nothing before its token count.
    sampled = student_per_teacher_token(teachers[0].shards, tokenizer) if tokenizer is not None else None
    if sampled is not None and SAMPLED_RATIO_MARGIN * sampled > ratio:
        ratio, why = SAMPLED_RATIO_MARGIN * sampled, f"{SAMPLED_RATIO_MARGIN} x {sampled:.2f} on a sample of documents"
        per_pass, bound = steps_at_most(ratio)
        if asked <= bound:
            return
    epochs = math.ceil((asked * samples_per_step * job.student.seq_len + 1) / per_pass)
    fewer = (f"train.max_tokens={bound * tokens_per_step} or less (or train.max_steps={bound}, or neither: one pass)"
             if bound else "a smaller global batch")
    raise ConfigError(
        f"{what} asks for {asked:,} optimizer steps of {tokens_per_step:,} tokens ({asked * tokens_per_step:,} "
        f"tokens); the scored data holds {teacher_tokens:,} teacher tokens in {n_shards} shard(s), at most "
        f"{per_pass:,} student tokens per pass (<= {ratio:.3g} per teacher token, {why}, "
        f"plus BOS/EOS per document) x {d.epochs} pass(es): at most {bound:,} steps. Ask for {fewer}, or for "
        f"data.epochs={epochs} or more, or score more data."
    )


def _recorded_tokens(scored) -> tuple[int, int] | None:
    """(teacher tokens, documents) of one teacher's opened folders from their manifests; None when
    some shard's entry records no token count."""
    entries = {(i, e.get("file")): e for i, f in enumerate(scored.folders) for e in f.manifest.get("shards", [])}
    recorded = [entries.get((s.folder, str(s.path).replace("\\", "/").rsplit("/", 1)[-1]), {}).get("tokens")
                for s in scored.shards]
    if any(not isinstance(n, int) for n in recorded):
        return None
    return sum(recorded), sum(s.rows for s in scored.shards)


def _number_of_steps(job: TrainJobConfig, data: StudentData, world_size: int, accumulation: int,
                     tokens_per_step: int) -> int:
    samples_per_step = job.train.micro_batch_size * world_size * accumulation
    available = data.plan.n_samples // samples_per_step
    log.info("the packed data (%d pass(es)): %d samples, %d optimizer steps of %d tokens", job.data.epochs,
             data.plan.n_samples, available, tokens_per_step)
    if job.train.max_steps is not None:
        steps = job.train.max_steps
    elif job.train.max_tokens is not None:
        steps = math.ceil(job.train.max_tokens / tokens_per_step)
    else:
        steps = available
    if isinstance(data, MixtureData):  # names the corpus that runs out
        data.check_length(steps * samples_per_step, samples_per_step)
    if steps < 1 or steps > available:
        raise ConfigError(
            f"{steps} optimizer steps asked for, the data gives {available}: {data.plan.n_samples} packed samples "
            f"of {job.student.seq_len} tokens, {samples_per_step} samples per step ({tokens_per_step} tokens). "
            f"Ask for fewer steps (train.max_tokens={available * tokens_per_step} or train.max_steps={available}), "
            "a smaller batch, or more passes (data.epochs)."
        )
    return steps


# ---- model and trainer ----------------------------------------------------------------------


def load_student(student: StudentConfig, vocab_size: int):
    """The student model (float32 master weights; mixed precision comes from the Trainer)."""

    kwargs = {"revision": student.revision, "trust_remote_code": student.trust_remote_code, "dtype": torch.float32,
              "use_safetensors": True}  # never unpickle downloaded weights
    if student.attn_implementation:
        kwargs["attn_implementation"] = student.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(student.model, **kwargs)
    rows = model.get_input_embeddings().weight.shape[0]
    if vocab_size > rows:
        raise ConfigError(f"the student tokenizer has {vocab_size} tokens, the model's embedding only {rows} rows")
    context = getattr(model.config, "max_position_embeddings", None)
    if context and student.seq_len > context:
        raise ConfigError(f"student.seq_len {student.seq_len} exceeds the model's context {context}")
    model.config.use_cache = False
    return model


def _cpu_threads(n: int | None):
    """torch's intra-op threads while training: ``train.cpu_threads`` (None: every usable core),
    never more than this process's share of the usable cores (:mod:`pipeline.runtime.cpu_threads`; the
    processes of a data-parallel run on one node share them). On a shared CPU, threads beyond the
    idle cores make every step many times slower; 1 is often the fastest there."""
    return torch_threads(threads_for(n, sharing=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _on_gpu(train: TrainConfig) -> bool:
    return torch.cuda.is_available() and not train.use_cpu


def _precision(train: TrainConfig) -> dict:
    precision = train.precision
    if precision == "auto":
        precision = "bf16" if _on_gpu(train) and torch.cuda.is_bf16_supported() else "fp32"
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def final_dtype(train: TrainConfig):
    """The dtype of the saved final model: ``train.save_dtype``, or for ``auto`` the precision the
    model was trained in (bf16 or fp16 mixed precision, else float32). Checkpoints for resuming
    keep the float32 master weights."""

    if train.save_dtype != "auto":
        return getattr(torch, train.save_dtype)
    precision = _precision(train)
    return torch.bfloat16 if precision["bf16"] else torch.float16 if precision["fp16"] else torch.float32


def _training_arguments(job: TrainJobConfig, accumulation: int, max_steps: int):
    t = job.train
    return TrainingArguments(
        output_dir=job.output_dir,
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=max_steps,
        learning_rate=t.learning_rate,
        **scheduler_arguments(t, max_steps),
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon,
        max_grad_norm=t.max_grad_norm,
        **_precision(t),
        **({"gradient_checkpointing": True} if job.student.gradient_checkpointing else {}),
        torch_compile=t.torch_compile,
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        report_to=list(t.report_to),
        run_name=Path(job.output_dir).name,  # the trackers' name for the run (pipeline.train_student.trackers)
        disable_tqdm=not t.progress,
        seed=t.seed,
        data_seed=t.seed,
        use_cpu=t.use_cpu,
        ddp_backend=t.ddp_backend,
        ddp_find_unused_parameters=False,
        ddp_timeout=t.ddp_timeout,
        dataloader_num_workers=job.data.num_workers,
        dataloader_prefetch_factor=job.data.prefetch_factor if job.data.num_workers > 0 else None,
        dataloader_drop_last=True,
        dataloader_pin_memory=_on_gpu(t),  # pinned memory speeds copies to a GPU only
        remove_unused_columns=False,
        label_names=["labels"],
        **({"eval_strategy": "steps", "eval_steps": t.eval_every} if t.eval_every else {"eval_strategy": "no"}),
    )


def _trainer(job, args, model, tokenizer, data: StudentData, identity: dict, guard, callbacks, held_out=None,
             on_checkpoint=None):
    trainer = GuidedTrainer(
        model=model,
        args=args,
        train_dataset=data.dataset,
        eval_dataset=held_out,
        eval_batch_size=job.train.eval_batch_size,
        data_collator=collate_packed,
        processing_class=tokenizer,
        callbacks=[JsonlMetricsCallback(Path(job.output_dir) / METRICS_NAME),
                   CheckpointRecordCallback(identity, guard, on_checkpoint),
                   *schedule_callbacks(job.train, args.max_steps), *tracker_callbacks(job.train.report_to),
                   *(callbacks or [])],
        selection=job.selection,
        seed=job.train.seed,
        guard=guard,
        teacher_metrics=_teacher_metrics(job, data),
    )
    start_trackers(trainer, tracker_recipe(job, identity))  # one line if one cannot start; then the recipe
    return trainer


def tracker_recipe(job: TrainJobConfig, identity: dict) -> dict[str, str]:
    """The recipe as the trackers receive it (:class:`pipeline.train_student.trackers.RecipeToTrackers`),
    flat ``recipe.*`` names and strings: the loss and its selection, each teacher's alignment as
    resolved, the teachers, the scored folders (or export) and a short digest of each folder's
    dataset identity, the mixture's weights, the student and its tokenizer, and ``recipe.data.digest``,
    a short digest of the run's whole data identity without paths (runs on the same data share it,
    wherever the data was)."""
    s, a, d = job.selection, job.alignment, job.data
    teachers = [t for part in _data_parts(identity) for t in part[1]]
    recipe = {"loss.mode": s.mode, "loss.ratio": s.ratio, "loss.rank_over": s.rank_over, "loss.unmapped": s.unmapped,
              "loss.alignment": ",".join(t["alignment"]["method"] for t in teachers),
              "loss.aggregate": ",".join(t["alignment"]["aggregate"] for t in teachers),
              "loss.n_chunks": ",".join(str(t["alignment"]["n_chunks"]) for t in teachers),
              "teachers": ",".join(dict.fromkeys(t["name"] for t in teachers)),
              "data.identity": ",".join(f"{where}{t['name']}:{'+'.join(t['digests'])}"
                                        for where, ts in _data_parts(identity) for t in ts),
              "data.digest": _digest(_without_paths(identity)),
              "data.held_out_shards": d.held_out_shards, "data.seed": d.seed, "data.epochs": d.epochs,
              "student.model": job.student.model, "student.tokenizer": job.student.tokenizer or job.student.model,
              "student.tokenizer_sha256": _tokenizer_sha256(identity)[:12], "student.seq_len": job.student.seq_len}
    if len(teachers) > 1 and not d.mixture:
        recipe.update({"loss.combine": a.combine, "loss.teacher_weights": ",".join(map(str, a.teacher_weights or []))})
    if d.folders and not d.mixture:
        recipe["data.folders"] = ",".join(d.folders)
    if d.export:
        recipe["data.export"] = d.export
    for c in d.mixture or []:
        recipe[f"data.mixture.{c.name}.weight"] = c.weight
        recipe[f"data.mixture.{c.name}.source"] = c.export or ",".join(c.folders)
    return {f"recipe.{k}": str(v) for k, v in recipe.items()}


def _data_parts(identity: dict) -> list[tuple[str, list[dict]]]:
    """``(where, teachers)`` of a data identity: one entry, or one per corpus of a mixture (``where``
    then ``<corpus>/``); each teacher its name, resolved alignment and its folders' identity digests."""
    if "mixture" in identity:
        return [(f"{c['name']}/", teachers) for c in identity["mixture"]["corpora"]
                for _, teachers in _data_parts(c["data"])]
    inner = identity.get("export") or identity
    several = inner.get("teachers")
    if not several:  # one teacher, read from its folders
        several = [{"teacher": inner["teacher"], "folders": inner["folders"], "alignment": inner["alignment"]}]
    return [("", [{"name": str(((t.get("teacher") or {}).get("teacher") or {}).get("name", "?")),
                   "alignment": t["alignment"],
                   "digests": [_digest(f.get("identity")) for f in t.get("folders") or []]} for t in several])]


def _tokenizer_sha256(identity: dict) -> str:
    if "mixture" in identity:
        return _tokenizer_sha256(identity["mixture"]["corpora"][0]["data"])
    if "export" in identity:
        return str((identity["export"].get("student") or {}).get("tokenizer_sha256", ""))
    return str(identity.get("student_tokenizer_sha256", ""))


def _without_paths(value):
    """A data identity without where things were (folder paths, the manifest's sha256), as
    :func:`storage_schemas.reader.data_identity_differences` compares it."""
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items() if k not in ("path", "manifest_sha256")}
    if isinstance(value, list):
        return [_without_paths(v) for v in value]
    return value


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _teacher_metrics(job: TrainJobConfig, data: StudentData):
    """Per-teacher metrics of a several-teacher run (None with one teacher)."""

    sources = data.dataset.teachers
    return None if sources is None else TeacherMetrics(sources.names, sources.combine, sources.weights, job.selection)
