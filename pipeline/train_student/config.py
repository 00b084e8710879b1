"""Stage 2's typed configuration (``conf/train_student.yaml`` overrides these defaults), and every
check that needs only the settings.

:class:`TrainJobConfig` holds the groups :class:`StudentConfig`, :class:`DataConfig` and
:class:`TrainConfig`, and the ``loss`` group: :class:`SelectionConfig` plus :class:`AlignmentConfig`.
Each group lists its own problems (``problems()``); :func:`train_job_config` builds the typed job
from a config mapping, reporting every problem at once, and with ``check_files`` also the files the
settings name (:func:`file_problems`, :func:`source_file_problems`); :func:`validate` checks a job
built in code, the batch geometry for the real world size included (:func:`batch_geometry`:
``micro_batch_size`` sequences per process per forward pass, and either ``global_batch_tokens``,
from which the accumulation follows for the world size, or ``gradient_accumulation_steps``);
:meth:`TrainJobConfig.recipe` is what a resumed run must share with the interrupted one. The
student's weights load with ``use_safetensors=True`` and remote code runs only when
``student.trust_remote_code`` is set. The run itself: :mod:`pipeline.train_student.run`; its data:
:mod:`pipeline.train_student.data`.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

from pipeline.folders.model_source import TeacherSourceError, check_tokenizer_source, local_model_problem
from pipeline.folders.output_folder import overlap_problem
from pipeline.method.bits_per_byte import TEXT_SUFFIXES
from pipeline.method.selection import SelectionConfig
from pipeline.runtime.config import (
    ConfigError,
    build,
    check_at_least,
    check_choice,
    defaults,
    lift_progress,
    raise_if,
)
from pipeline.student_data.several_teachers import MISSING_RULES
from pipeline.student_data.settings import AlignmentConfig, scored_folder_problems
from pipeline.train_student.trackers import tracker_name_problems, tracker_problems
from storage_schemas import ContractError, read_manifest
from storage_schemas import filesystem as sfs
from storage_schemas.reader import ON_BAD_SHARD, VERIFY

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
SAVE_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULES = ("cosine", "wsd")  # the learning-rate schedules (pipeline.train_student.schedule)
# Why a cosine run cannot be continued (train.continue_from, pipeline.train_student.continuation)
CONTINUE_NEEDS_WSD = (
    "the cosine schedule's learning rate at every step depends on the run's total length, so no continuation "
    "of a cosine run equals one longer run; train with train.lr_scheduler=wsd to be able to continue, or start "
    "a new run from the model in <run>/final (docs/configuration.md, \"Training longer\")"
)


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


CORPUS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a corpus name appears in metric names


@dataclass(frozen=True)
class MixtureCorpus:
    """One corpus of ``data.mixture``: its scored folders (one teacher or several, as ``data.folders``)
    or an export of them, its sampling weight, and the most passes over it the run may take."""

    name: str
    weight: float
    folders: list[str] = field(default_factory=list)
    export: str | None = None  # a make export-student folder instead of folders
    epochs: int | None = None  # passes over this corpus at most; None: data.epochs

    def problems(self) -> list[str]:
        found: list[str] = []
        if not isinstance(self.name, str) or not CORPUS_NAME.fullmatch(self.name):
            found.append(f"name: {self.name!r} must be letters, digits, '_', '.' or '-' (it names the corpus's metrics)")
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight) and self.weight > 0):
            found.append(f"weight: {self.weight!r} must be a finite number > 0")
        if bool(self.folders) == bool(self.export):
            found.append("folders: give the corpus's scored folders or its export (data.mixture[...].export), one of them")
        check_at_least(found, "epochs", self.epochs, 1)
        return found


def mixture_problems(mixture: Sequence[MixtureCorpus]) -> list[str]:
    """What is wrong with each corpus (``mixture[i].<key>: ...``) and with the list as a whole."""
    found = [f"mixture[{i}].{line}" for i, corpus in enumerate(mixture) for line in corpus.problems()]
    names = [c.name for c in mixture]
    twice = sorted({n for n in names if names.count(n) > 1})
    return found + ([f"mixture: corpus name(s) {', '.join(twice)} used twice; name each corpus once"] if twice else [])


def run_corpus_name(corpus: str, names: Sequence[str] | None) -> str:
    """The corpus part of a run's default folder (``<student_root>/<corpus>/<run_name>``): a mixture's
    is ``mixture-`` and its corpora's names joined by ``+`` in their order (``mixture-math+web``;
    beyond 100 characters, their number and a digest of the names), any other run's ``data.corpus``."""
    if not names:
        return corpus
    joined = "+".join(names)
    if len(joined) <= 100:
        return f"mixture-{joined}"
    return f"mixture-{len(names)}-corpora-{hashlib.sha256(joined.encode()).hexdigest()[:8]}"


def run_names(corpus: str, teacher: str, mixture, folders) -> tuple[str, str]:
    """The corpus and teacher parts of a run's (or an export's) default folder: a mixture's corpus
    part is named after its corpora; otherwise both are what the scored folders' manifests say
    (:func:`scored_names`), else ``data.corpus`` and ``data.teacher`` (docs/storage-schema.md,
    "What a student run writes")."""
    if mixture:
        return run_corpus_name(corpus, [str(c.get("name")) for c in mixture]), teacher
    return scored_names(list(folders or [])) or (corpus, teacher)


def scored_names(folders: Sequence[str] | None) -> tuple[str, str] | None:
    """``(corpus, teachers)`` as the scored folders' manifests name them: the first folder's corpus,
    and the teachers in the folders' order joined by ``+`` (``qwen+deepseek``); what names a run
    given ``data.folders``. None when a folder holds no readable manifest, or one without these
    names (the configuration checks name such a folder)."""
    corpora, teachers = [], []
    for folder in folders or []:
        try:
            identity = read_manifest(folder).get("identity") or {}
        except ContractError:
            return None
        corpora.append((identity.get("corpus") or {}).get("name"))
        teachers.append((identity.get("teacher") or {}).get("name"))
    names = [*corpora[:1], *teachers]
    if not names or not all(isinstance(n, str) and CORPUS_NAME.fullmatch(n) for n in names):
        return None
    return corpora[0], "+".join(dict.fromkeys(teachers))


def recipe_of(mixture: Sequence[MixtureCorpus] | None) -> dict | None:
    """The mixture as a run's recipe records it: the order of the corpora and each one's weight and
    passes, keyed by name, so that a changed weight is named (``data.mixture.corpora.web.weight``).
    Where the corpora are is left out: the data identity pins what they hold."""
    if not mixture:
        return None
    return {"order": [c.name for c in mixture],
            "corpora": {c.name: {"weight": float(c.weight), "epochs": c.epochs} for c in mixture}}


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
        found += tracker_name_problems(self.report_to)  # which are installed: tracker_problems (train_job_config)
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
    p += [f"train.{line}" for line in tracker_problems(job.train.report_to)]
    try:
        batch_geometry(job, world_size)
    except ValueError as exc:
        p.append(str(exc))
    overlap = run_folder_problem(job)
    return p + ([overlap] if overlap else [])


def launch_problems(environ: Mapping[str, str] = os.environ) -> list[str]:
    """What makes this process's launch one that cannot train as one data-parallel run of
    ``WORLD_SIZE`` processes: a ``WORLD_SIZE`` above 1 without the rank and rendezvous address that
    ``torchrun`` and ``accelerate launch`` set beside it (a variable left over in the shell, a
    launcher the project does not know). Empty when the launch is one process or a launcher's."""
    world = environ.get("WORLD_SIZE", "").strip()
    if not world:
        return []
    if not world.isdigit() or int(world) < 1:
        return [f"WORLD_SIZE={world!r} is not a number of processes; launch with torchrun or accelerate launch, which set it"]
    missing = [k for k in ("RANK", "MASTER_ADDR") if not environ.get(k)]
    if int(world) > 1 and missing:
        return [f"WORLD_SIZE={world} but {' and '.join(missing)} unset: not a launch of {world} processes by torchrun or "
                "accelerate launch, which set them all (docs/multi-node.md); launch with one of them, or unset "
                "WORLD_SIZE to train in one process"]
    return []


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


def train_job_config(values: Mapping, check_files: bool = False, check_installed: bool = True) -> TrainJobConfig:
    """The typed job from a composed config (plain mapping). Every problem is reported in one
    :class:`pipeline.runtime.config.ConfigError`: unknown keys, wrong types, bad choices and ranges in
    every group and the batch geometry for one process (checked again for the real world size);
    with ``check_files``, also scored folders that do not exist and a local student that does not
    (unless it is the embedded one, built later); with ``check_installed``, the trackers of
    ``train.report_to`` this machine lacks (:func:`pipeline.train_student.trackers.tracker_problems`, which
    imports transformers: a command's check of its command line leaves them to its run). Local paths become absolute."""
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
    if check_installed and parts["train"] is not None:  # what this machine has: transformers is asked
        problems += [f"train.{line}" for line in tracker_problems(parts["train"].report_to)]
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


def continuation_problems(continue_from: str | None, output_dir: str) -> list[str]:
    """What is wrong with ``train.continue_from`` before anything is read: a folder that does not
    exist, or the run's own folder."""
    if not isinstance(continue_from, str):
        return []
    if not Path(continue_from).is_dir():
        return [f"train.continue_from: no such run folder: {continue_from}"]
    if Path(continue_from).resolve() == Path(output_dir).resolve():
        return [f"train.continue_from: {continue_from} is this run's own folder; a continuation is a new run: give it "
                "another run_name (or output_dir)"]
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
