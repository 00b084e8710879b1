"""Stage 2 as a library call: train a student on a scored dataset with the teacher-guided loss.

:func:`run_training` reads as its steps: resolve the batch geometry, open and validate the scored
data, load the student's tokenizer and plan the packed samples, check the run folder (resume or
refuse), load the student, train with :class:`pipeline.train_student.trainer.GuidedTrainer`, save the
final model. Everything that can fail on bad input fails before the model is loaded.

The run folder ``output_dir`` (deterministic, e.g. ``outputs/students/<run name>``) holds
``run.json`` (the recipe), ``checkpoint-<step>/`` (model, optimizer, scheduler, RNG, trainer
state, ``data_identity.json`` and, written last, ``checkpoint_complete.json``), ``metrics.jsonl``,
``runs/`` (TensorBoard), ``final/`` (``save_pretrained`` model and tokenizer plus
``data_identity.json``; written under a temporary name and renamed, so it is whole or absent) and
``summary.json``.

Resume (``train.resume``): ``auto`` continues from the newest *complete* checkpoint in
``output_dir`` when there is one, ``never`` refuses a folder that already has checkpoints (unless
``overwrite``), a path resumes from that checkpoint. A checkpoint folder without
``checkpoint_complete.json`` was being written when the process died (SIGKILL, node loss): it is
never resumed from, and it is deleted when the run folder is prepared. A resume is refused when the
recipe (``run.json``) or the data identity (scored shards, student tokenizer, packing) differs from
the checkpoint's: a resumed run must see exactly the batches the interrupted one would have seen.
Both are compared by content, not location: the student model by its digests or hub id
(:func:`pipeline.identity.model_identity`, recorded in ``run.json``), the scored data by identity and
shard sha256 (:func:`storage_schemas.reader.data_identity_differences`), so a run whose project
folder moved resumes.
Resuming restores the weights, AdamW's state, the learning-rate schedule, the RNG states and the
data position (the Trainer skips the batches already trained), so on CPU a run killed at any
moment and resumed logs exactly the per-step losses of an uninterrupted run
(``tests/test_faults_stage2.py``).

Non-finite losses: a step whose loss or gradient is not finite is skipped, and after
``train.max_nonfinite_in_a_row`` such steps in a row the run saves a checkpoint and stops with
:class:`pipeline.train_student.trainer.NonFiniteLossError` (:mod:`pipeline.train_student.trainer`).

Security: the student's weights are loaded with ``use_safetensors=True`` (a checkpoint that has only
pickle weights is refused) and remote code only runs when ``student.trust_remote_code`` is set.

Batch geometry: ``micro_batch_size`` sequences per process per forward pass; either
``global_batch_tokens`` (the paper: 2M = 2^21 tokens = 1024 sequences of 2048) from which the
accumulation steps follow for the current world size, or ``gradient_accumulation_steps``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.train_student.align import AGGREGATIONS
from pipeline.train_student.guided_loss import MODES, RANK_OVER, UNMAPPED, SelectionConfig
from pipeline.identity import model_identity
from storage_schemas.reader import ON_BAD_SHARD, VERIFY, data_identity_differences, open_scored_dataset
from pipeline.score_teacher.writer import exclusive_writer
from pipeline.train_student.data import ALIGNMENTS, AlignmentConfig, PackingConfig, StudentData, build_student_data
from pipeline.tokenization import fingerprint, load_tokenizer
from storage_schemas import write_json_atomic
from storage_schemas.scored import iter_identity_differences

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
SAVE_DTYPES = ("auto", "float32", "bfloat16", "float16")
RESUME_KEYWORDS = ("auto", "never")
RUN_NAME = "run.json"
FINAL_NAME = "final"


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


@dataclass(frozen=True)
class DataConfig:
    folders: list[str]  # scored dataset folders (stage-1 output) of one teacher
    on_bad_shard: str = "error"  # error | skip
    verify: str = "size"  # size | sha256 (full read of every shard on open)
    allow_partial: bool = False  # train on the finished shards of an incomplete scoring
    cache_dir: str | None = None  # student token counts per shard (None: no cache)
    seed: int = 0
    shuffle: bool = True
    epochs: int = 1
    add_bos: bool | None = None  # None: as the student's tokenizer does
    add_eos: bool = True
    num_workers: int = 1  # data-loader worker processes (tokenization and alignment run there)
    prefetch_factor: int | None = None
    length_workers: int = 1  # processes for the one-off token count pass


@dataclass(frozen=True)
class LossConfig:
    mode: str = "guided"  # guided | cpt | random
    ratio: float = 0.4  # top-k share of mapped tokens (guided, random)
    rank_over: str = "batch"  # batch | sequence
    unmapped: str = "include"  # include | exclude
    aggregate: str = "max"  # max | mean | min
    alignment: str = "token"  # token | chunk | one_to_one
    n_chunks: int = 8  # C for chunk-level alignment

    def selection(self) -> SelectionConfig:
        return SelectionConfig(mode=self.mode, ratio=self.ratio, rank_over=self.rank_over, unmapped=self.unmapped)

    def alignment_config(self) -> AlignmentConfig:
        return AlignmentConfig(method=self.alignment, aggregate=self.aggregate, n_chunks=self.n_chunks)


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
    precision: str = "auto"  # auto: bf16 on a GPU that supports it, else fp32
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
    ddp_timeout: int = 7200  # seconds; ranks wait this long for the first one's token count pass
    torch_compile: bool = False
    cpu_threads: int | None = None  # torch intra-op threads while training (None: torch's default)
    max_nonfinite_in_a_row: int = 5  # skipped (non-finite) optimizer steps in a row before the run stops


# Train settings that do not change what is computed: they may differ on a resume.
OPERATIONAL = ("logging_steps", "save_steps", "save_total_limit", "resume", "progress", "report_to",
               "ddp_backend", "ddp_timeout", "torch_compile", "cpu_threads", "max_nonfinite_in_a_row", "save_dtype")


@dataclass(frozen=True)
class TrainJobConfig:
    student: StudentConfig
    data: DataConfig
    loss: LossConfig
    train: TrainConfig
    output_dir: str
    overwrite: bool = False  # delete this run's checkpoints and metrics first

    def recipe(self) -> dict:
        """What a resumed run must share with the interrupted one (``run.json``)."""
        data = {k: v for k, v in asdict(self.data).items()
                if k not in ("folders", "num_workers", "prefetch_factor", "length_workers", "cache_dir")}
        train = {k: v for k, v in asdict(self.train).items() if k not in OPERATIONAL}
        student = {k: v for k, v in asdict(self.student).items() if k != "name"}
        return {"student": student, "data": data, "loss": asdict(self.loss), "train": train}


def validate(job: TrainJobConfig, world_size: int = 1) -> list[str]:
    """Every problem of the configuration, as readable lines (empty when it is valid)."""
    p: list[str] = []
    loss, train, data = job.loss, job.train, job.data
    for where, value, choices in (
        ("loss.mode", loss.mode, MODES), ("loss.rank_over", loss.rank_over, RANK_OVER),
        ("loss.unmapped", loss.unmapped, UNMAPPED), ("loss.aggregate", loss.aggregate, AGGREGATIONS),
        ("loss.alignment", loss.alignment, ALIGNMENTS), ("data.on_bad_shard", data.on_bad_shard, ON_BAD_SHARD),
        ("data.verify", data.verify, VERIFY), ("train.precision", train.precision, PRECISIONS),
        ("train.save_dtype", train.save_dtype, SAVE_DTYPES),
    ):
        if value not in choices:
            p.append(f"{where}: {value!r} is not one of {', '.join(choices)}")
    if not 0.0 < loss.ratio <= 1.0:
        p.append(f"loss.ratio: {loss.ratio} is not in (0, 1]")
    for where, value in (("loss.n_chunks", loss.n_chunks), ("student.seq_len", job.student.seq_len),
                         ("train.micro_batch_size", train.micro_batch_size), ("data.epochs", data.epochs),
                         ("train.logging_steps", train.logging_steps), ("train.save_steps", train.save_steps),
                         ("train.max_nonfinite_in_a_row", train.max_nonfinite_in_a_row)):
        if value < 1:
            p.append(f"{where}: {value} must be >= 1")
    if not data.folders:
        p.append("data.folders: no scored dataset folder given")
    if train.max_steps is not None and train.max_tokens is not None:
        p.append("train.max_steps and train.max_tokens: set one of them, not both")
    if train.min_learning_rate > train.learning_rate:
        p.append(f"train.min_learning_rate {train.min_learning_rate} exceeds train.learning_rate {train.learning_rate}")
    try:
        batch_geometry(job, world_size)
    except ValueError as exc:
        p.append(str(exc))
    return p


def batch_geometry(job: TrainJobConfig, world_size: int) -> tuple[int, int]:
    """``(gradient_accumulation_steps, tokens per optimizer step)`` for ``world_size`` processes."""
    t = job.train
    per_pass = t.micro_batch_size * job.student.seq_len * world_size  # tokens of one forward on all ranks
    if t.global_batch_tokens is not None:
        if t.global_batch_tokens % per_pass:
            raise ValueError(
                f"train.global_batch_tokens {t.global_batch_tokens} is not a multiple of micro_batch_size x seq_len "
                f"x processes = {t.micro_batch_size} x {job.student.seq_len} x {world_size} = {per_pass}"
            )
        accumulation = t.global_batch_tokens // per_pass
        if t.gradient_accumulation_steps not in (None, accumulation):
            raise ValueError(f"train.gradient_accumulation_steps {t.gradient_accumulation_steps} contradicts "
                             f"global_batch_tokens (which gives {accumulation} with {world_size} processes)")
    else:
        accumulation = t.gradient_accumulation_steps or 1
    if accumulation < 1:
        raise ValueError(f"train.gradient_accumulation_steps must be >= 1, got {accumulation}")
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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_trained / self.seconds if self.seconds > 0 else 0.0


def run_training(job: TrainJobConfig, callbacks: list | None = None) -> TrainSummary:
    """Train the student (module docstring). ``callbacks`` are extra ``TrainerCallback``s.

    The global rank-0 process holds an exclusive lock on the run folder for the whole run, so a
    second launch of the same run is refused instead of interleaving checkpoints.
    """
    with contextlib.ExitStack() as lock:
        return _run_training(job, callbacks, lock)


def _run_training(job: TrainJobConfig, callbacks: list | None, lock: contextlib.ExitStack) -> TrainSummary:
    t0 = time.perf_counter()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    problems = validate(job, world_size)
    if problems:
        raise ValueError("invalid configuration:\n  - " + "\n  - ".join(problems))
    accumulation, tokens_per_step = batch_geometry(job, world_size)
    args = _training_arguments(job, accumulation, max_steps=1)  # max_steps is set once the data is known

    tokenizer = load_tokenizer(job.student.tokenizer or job.student.model, revision=job.student.revision,
                               trust_remote_code=job.student.trust_remote_code)
    with args.main_process_first(local=True, desc="scored data"):
        data = prepare_data(job, tokenizer)
        student = model_identity(job.student.model, job.student.revision)  # digests cached for the other ranks
    args.max_steps = _number_of_steps(job, data, world_size, accumulation, tokens_per_step)
    identity = data.identity(fingerprint(tokenizer), _packing(job))

    if int(os.environ.get("RANK", "0")) == 0:  # only after validation: a refused run writes nothing
        lock.enter_context(exclusive_writer(job.output_dir, what="training run"))
    checkpoint = resolve_checkpoint(job, identity, student)
    with args.main_process_first(local=False, desc="run folder"):
        if args.process_index == 0:
            prepare_run_folder(job, checkpoint, student)

    trainer, start_step = train_from(checkpoint, job, args, tokenizer, data, identity, callbacks)
    final = save_final(trainer, job, identity)
    return _summary(job, trainer, data, checkpoint, start_step, tokens_per_step, final, time.perf_counter() - t0)


def train_from(checkpoint: str | None, job: TrainJobConfig, args, tokenizer, data: StudentData, identity: dict,
               callbacks: list | None):
    """Load the student and train it from ``checkpoint`` (or from scratch) to ``args.max_steps``.

    A checkpoint already at ``max_steps`` is a finished run: its weights are loaded and nothing is
    trained (the HF Trainer would otherwise train one step past the end). The count of skipped
    non-finite steps continues from the checkpoint's; a run stopped by too many of them in a row
    raises :class:`NonFiniteLossError` (after its checkpoint is saved). Returns the trainer and the
    step it started from.
    """
    from pipeline.train_student.trainer import NonFiniteGuard, NonFiniteLossError, read_guard_state

    start_step = _checkpoint_step(checkpoint)
    finished = start_step >= args.max_steps
    student = replace(job.student, model=checkpoint, revision=None) if finished else job.student
    guard = NonFiniteGuard(max_in_a_row=job.train.max_nonfinite_in_a_row)
    guard.restore(read_guard_state(checkpoint))
    trainer = _trainer(job, args, load_student(student, len(tokenizer)), tokenizer, data, identity, guard, callbacks)
    if finished:
        log.info("%s is at step %d of %d: nothing to train", checkpoint, start_step, args.max_steps)
        trainer.state.log_history = _trainer_state(checkpoint).get("log_history", [])
        trainer.state.global_step = start_step
    else:
        with _cpu_threads(job.train.cpu_threads):
            trainer.train(resume_from_checkpoint=checkpoint)
    if trainer.stop_reason:
        raise NonFiniteLossError(trainer.stop_reason)
    return trainer, start_step


def _summary(job, trainer, data: StudentData, checkpoint, start_step, tokens_per_step, final, seconds) -> TrainSummary:
    steps = trainer.state.global_step
    return TrainSummary(
        output_dir=job.output_dir, final_model=str(final), steps=steps, resumed_from=checkpoint,
        tokens_per_step=tokens_per_step, tokens_trained=(steps - start_step) * tokens_per_step, seconds=seconds,
        data={**data.plan.summary(), "alignment": data.alignment.method, "aggregate": data.alignment.aggregate,
              "shards_used": len(data.scored.shards), "shards_skipped": data.scored.skipped,
              "teacher": data.scored.teacher.get("teacher", {}).get("name")},
        last_log=next((r for r in reversed(trainer.state.log_history) if "loss_kept" in r), {}),
        nonfinite_steps=list(trainer.guard.skipped),
    )


def prepare_data(job: TrainJobConfig, tokenizer) -> StudentData:
    d = job.data
    scored = open_scored_dataset(d.folders, on_bad_shard=d.on_bad_shard, verify=d.verify, allow_partial=d.allow_partial)
    return build_student_data(scored, tokenizer, _packing(job), job.loss.alignment_config(), cache_dir=d.cache_dir,
                              num_proc=d.length_workers, on_bad_shard=d.on_bad_shard)


def _packing(job: TrainJobConfig) -> PackingConfig:
    d = job.data
    return PackingConfig(seq_len=job.student.seq_len, seed=d.seed, shuffle=d.shuffle, epochs=d.epochs,
                         add_bos=d.add_bos, add_eos=d.add_eos)


def _number_of_steps(job: TrainJobConfig, data: StudentData, world_size: int, accumulation: int,
                     tokens_per_step: int) -> int:
    samples_per_step = job.train.micro_batch_size * world_size * accumulation
    available = data.plan.n_samples // samples_per_step
    if job.train.max_steps is not None:
        steps = job.train.max_steps
    elif job.train.max_tokens is not None:
        steps = math.ceil(job.train.max_tokens / tokens_per_step)
    else:
        steps = available
    if steps < 1 or steps > available:
        raise ValueError(
            f"{steps} optimizer steps asked for, the data gives {available}: {data.plan.n_samples} packed samples "
            f"of {job.student.seq_len} tokens, {samples_per_step} samples per step ({tokens_per_step} tokens). "
            "Ask for fewer steps, a smaller batch, or more passes (data.epochs)."
        )
    return steps


# ---- the run folder -------------------------------------------------------------------------


class RunMismatchError(RuntimeError):
    """The run folder holds a run with another recipe or other data; resuming would not be exact."""


def checkpoint_folders(out: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """``(complete, incomplete)`` checkpoint folders of a run folder, by step."""
    from pipeline.train_student.trainer import is_complete_checkpoint

    out = Path(out)
    found = [p for p in out.glob("checkpoint-*") if p.is_dir() and p.name.split("-", 1)[1].isdigit()]
    found.sort(key=lambda p: int(p.name.split("-", 1)[1]))
    return [p for p in found if is_complete_checkpoint(p)], [p for p in found if not is_complete_checkpoint(p)]


def resolve_checkpoint(job: TrainJobConfig, identity: dict, student: dict | None = None) -> str | None:
    """The checkpoint to resume from (``train.resume``), after checking it continues this run;
    ``student`` is the student model's identity (:func:`pipeline.identity.model_identity`)."""
    from pipeline.train_student.trainer import is_complete_checkpoint

    out = Path(job.output_dir)
    complete, incomplete = checkpoint_folders(out) if out.is_dir() and not job.overwrite else ([], [])
    latest = str(complete[-1]) if complete else None
    if incomplete:
        log.warning("ignoring incomplete checkpoint(s) %s (the process died while saving)",
                    ", ".join(p.name for p in incomplete))
    resume = job.train.resume
    if resume == "never":
        if latest:
            raise RunMismatchError(f"{out} already holds checkpoints ({Path(latest).name}); resume=never refuses "
                                   "to train over them. Use resume=auto, another run name, or overwrite=true.")
        return None
    checkpoint = latest if resume == "auto" else resume
    if checkpoint is None:
        return None
    if not Path(checkpoint).is_dir():
        raise FileNotFoundError(f"train.resume: checkpoint {checkpoint} not found")
    if not is_complete_checkpoint(checkpoint):
        raise RunMismatchError(f"cannot resume {checkpoint}: it is incomplete (no checkpoint_complete.json; the "
                               "process died while saving it). Resume from an earlier checkpoint.")
    problems = _resume_differences(job, identity, Path(checkpoint), student)
    if problems:
        raise RunMismatchError(
            f"cannot resume {checkpoint}: it belongs to a different run\n  " + "\n  ".join(problems)
            + "\nUse another run name, or overwrite=true to start this run afresh."
        )
    return str(checkpoint)


def _resume_differences(job: TrainJobConfig, identity: dict, checkpoint: Path, student: dict | None) -> list[str]:
    from pipeline.train_student.trainer import read_data_identity

    problems = []
    run_file = checkpoint.parent / RUN_NAME
    if run_file.is_file():
        record = json.loads(run_file.read_text())
        recorded, now = record.get("recipe", {}), _jsonable(job.recipe())
        if record.get("student") is not None and student is not None:
            # the student is compared by what it is; its paths only say where it was
            recorded, now = _without_student_paths(recorded), _without_student_paths(now)
            problems += [f"student {d}" for d in iter_identity_differences(record["student"], student)]
        problems += [f"recipe {d}" for d in iter_identity_differences(recorded, now)]
    recorded_data = read_data_identity(checkpoint)
    if recorded_data is None:
        problems.append(f"{checkpoint} has no data_identity.json")
    else:
        problems += [f"data {d}" for d in data_identity_differences(recorded_data, identity)]
    return [p if len(p) <= 300 else p[:297] + "..." for p in problems]  # shard lists can be long


def _without_student_paths(recipe: dict) -> dict:
    student = {k: v for k, v in (recipe.get("student") or {}).items() if k not in ("model", "tokenizer")}
    return {**recipe, "student": student}


def _jsonable(obj):
    return json.loads(json.dumps(obj))


def prepare_run_folder(job: TrainJobConfig, checkpoint: str | None, student: dict | None = None) -> None:
    """Create the folder, clear it when ``overwrite``, delete incomplete checkpoints (left by a
    process killed while saving) and record the recipe and the student's identity (main process
    only)."""
    out = Path(job.output_dir)
    for path in checkpoint_folders(out)[1] if out.is_dir() else []:
        log.warning("deleting incomplete checkpoint %s", path)
        shutil.rmtree(path)
    if job.overwrite and out.is_dir():
        for path in out.iterdir():
            if path.name.startswith("checkpoint-") or path.name in (FINAL_NAME, "runs"):
                shutil.rmtree(path)
            elif path.name in (RUN_NAME, "metrics.jsonl", "summary.json"):
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    if checkpoint is None or not (out / RUN_NAME).is_file():
        write_json_atomic(out / RUN_NAME, {"recipe": job.recipe(), "student": student, "output_dir": str(out)})


def _trainer_state(checkpoint: str | None) -> dict:
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text()) if checkpoint else {}


def _checkpoint_step(checkpoint: str | None) -> int:
    return int(_trainer_state(checkpoint).get("global_step", 0))




# ---- model and trainer ----------------------------------------------------------------------


def load_student(student: StudentConfig, vocab_size: int):
    """The student model (float32 master weights; mixed precision comes from the Trainer)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"revision": student.revision, "trust_remote_code": student.trust_remote_code, "dtype": torch.float32,
              "use_safetensors": True}  # never unpickle downloaded weights
    if student.attn_implementation:
        kwargs["attn_implementation"] = student.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(student.model, **kwargs)
    rows = model.get_input_embeddings().weight.shape[0]
    if vocab_size > rows:
        raise ValueError(f"the student tokenizer has {vocab_size} tokens, the model's embedding only {rows} rows")
    context = getattr(model.config, "max_position_embeddings", None)
    if context and student.seq_len > context:
        raise ValueError(f"student.seq_len {student.seq_len} exceeds the model's context {context}")
    model.config.use_cache = False
    return model


@contextlib.contextmanager
def _cpu_threads(n: int | None):
    """``torch.set_num_threads(n)`` for the duration (None: leave it). On a shared CPU, intra-op
    threads beyond the idle cores make every step many times slower (OpenMP threads wait on each
    other); 1 is often the fastest there."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _precision(train: TrainConfig) -> dict:
    import torch

    precision = train.precision
    if precision == "auto":
        gpu = torch.cuda.is_available() and not train.use_cpu
        precision = "bf16" if gpu and torch.cuda.is_bf16_supported() else "fp32"
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def final_dtype(train: TrainConfig):
    """The dtype of the saved final model: ``train.save_dtype``, or for ``auto`` the precision the
    model was trained in (bf16 or fp16 mixed precision, else float32). Checkpoints for resuming
    keep the float32 master weights."""
    import torch

    if train.save_dtype != "auto":
        return getattr(torch, train.save_dtype)
    precision = _precision(train)
    return torch.bfloat16 if precision["bf16"] else torch.float16 if precision["fp16"] else torch.float32


def _training_arguments(job: TrainJobConfig, accumulation: int, max_steps: int):
    from transformers import TrainingArguments

    t = job.train
    return TrainingArguments(
        output_dir=job.output_dir,
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=max_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": t.min_learning_rate},
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
        remove_unused_columns=False,
        label_names=["labels"],
        eval_strategy="no",
    )


def _trainer(job, args, model, tokenizer, data: StudentData, identity: dict, guard, callbacks):
    from pipeline.train_student.trainer import METRICS_NAME, CheckpointRecordCallback, GuidedTrainer, JsonlMetricsCallback
    from pipeline.train_student.data import collate_packed

    return GuidedTrainer(
        model=model,
        args=args,
        train_dataset=data.dataset,
        data_collator=collate_packed,
        processing_class=tokenizer,
        callbacks=[JsonlMetricsCallback(Path(job.output_dir) / METRICS_NAME), CheckpointRecordCallback(identity, guard),
                   *(callbacks or [])],
        selection=job.loss.selection(),
        seed=job.train.seed,
        guard=guard,
    )


def save_final(trainer, job: TrainJobConfig, identity: dict) -> Path:
    """``save_pretrained`` model (in :func:`final_dtype`; training is over, so the model is cast in
    place) and tokenizer in ``<output_dir>/final``, with the data identity.
    Written as ``.final.tmp`` and renamed: ``final`` is whole or absent, even after a kill."""
    from pipeline.train_student.trainer import write_data_identity

    final = Path(job.output_dir) / FINAL_NAME
    tmp = final.with_name(f".{FINAL_NAME}.tmp")
    if trainer.is_world_process_zero() and tmp.exists():
        shutil.rmtree(tmp)
    trainer.model.to(final_dtype(job.train))
    trainer.save_model(str(tmp))  # model (safetensors) and the processing class (tokenizer)
    if trainer.is_world_process_zero():
        write_data_identity(tmp, identity)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    return final
