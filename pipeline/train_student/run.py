"""Stage 2 as a library call: train a student on a scored dataset with the teacher-guided loss.

:func:`run_training` reads as its steps: check the job (:func:`pipeline.train_student.config.validate`)
and resolve the batch geometry, open and validate the scored data, refuse a length the scored data
cannot hold (:func:`pipeline.train_student.data.check_token_budget`, before the token count), load
the student's tokenizer and plan the packed samples (:mod:`pipeline.train_student.data`,
docs/METHOD.md §2.4), check the run folder (resume or refuse, :mod:`pipeline.train_student.checkpoints`;
or continue another run, :mod:`pipeline.train_student.continuation`), load the student, train with
:class:`pipeline.train_student.trainer.GuidedTrainer` (the schedule:
:mod:`pipeline.train_student.schedule`; held-out bits per byte every ``train.eval_every`` steps),
save the final model, return the summary. Everything that can fail on bad input fails before the
model is loaded. Resuming restores weights, optimizer, schedule, RNG and data position, so a run
killed at any moment and resumed logs the per-step losses of an uninterrupted one (docs/METHOD.md §2.5).

The configuration and its checks: :mod:`pipeline.train_student.config`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainingArguments
from transformers.training_args import ParallelMode

from pipeline.folders.folder_lock import exclusive_writer
from pipeline.folders.model_source import model_positions, refuse_seq_len
from pipeline.folders.output_folder import SetAside
from pipeline.folders.provenance import model_identity
from pipeline.method.tokenization import byte_fallback_ids, fingerprint, load_tokenizer
from pipeline.runtime.config import ConfigError, Interrupted, raise_if
from pipeline.runtime.cpu_threads import threads_for, torch_threads
from pipeline.student_data.held_out_shards import held_out_record
from pipeline.student_data.build import StudentData
from pipeline.student_data.dataset import collate_packed
from pipeline.train_student.checkpoints import (
    METRICS_NAME,
    checkpoint_step,
    is_run_entry,
    prepare_run_folder,
    read_guard_state,
    read_loss_sum,
    recorded_summary,
    recover_run_folder,
    rerun_start,
    resolve_checkpoint,
    save_final,
    trainer_state,
)
from pipeline.train_student.config import (
    StudentConfig,
    TrainConfig,
    TrainJobConfig,
    batch_geometry,
    launch_problems,
    validate,
)
from pipeline.train_student.continuation import continuation_checkpoint, start_from_source
from pipeline.train_student.data import (
    check_token_budget,
    held_out_texts,
    number_of_steps,
    packing_config,
    prepare_data,
)
from pipeline.train_student.schedule import schedule_callbacks, schedule_problems, scheduler_arguments
from pipeline.train_student.several_teachers import TeacherMetrics
from pipeline.train_student.tracker_callbacks import start_trackers, tracker_callbacks
from pipeline.train_student.trainer import (
    CheckpointRecordCallback,
    GuidedTrainer,
    JsonlMetricsCallback,
    NonFiniteGuard,
    NonFiniteLossError,
)
from storage_schemas import filesystem as sfs
from storage_schemas import marker_of, store_calls
from storage_schemas.reader import BadShardError

log = logging.getLogger(__name__)


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
    trackers: list[str] = field(default_factory=lambda: list(TrainConfig().report_to))  # train.report_to

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
    raise_if(launch_problems())  # several processes that cannot be one run: before any work
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    problems = validate(job, world_size)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    s = job.student  # the sequence against the student's positions first: every later count depends on it
    refuse_seq_len(s.seq_len, s.model, model_positions(s.model, s.revision, s.trust_remote_code))
    accumulation, tokens_per_step = batch_geometry(job, world_size)
    args = _training_arguments(job, accumulation, max_steps=1, world_size=world_size)  # max_steps: once the data is known
    refuse_undistributed(args, world_size)  # sets up the process group: every rank takes the token counts from rank 0

    tokenizer = load_tokenizer(job.student.tokenizer or job.student.model, revision=job.student.revision,
                               trust_remote_code=job.student.trust_remote_code)
    if job.selection.byte_fallback == "exclude" and not byte_fallback_ids(tokenizer).any():
        raise ConfigError(f"loss.byte_fallback=exclude: the student tokenizer ({job.student.tokenizer or job.student.model}) "
                          "has no byte-fallback pieces (<0x..>) to keep out of the ranking; leave loss.byte_fallback=rank")
    data = prepare_data(job, tokenizer,
                        check=lambda scored: check_token_budget(job, scored, world_size, accumulation, tokenizer))
    with args.main_process_first(local=True, desc="student identity"):
        student = model_identity(job.student.model, job.student.revision)  # digests cached for the other ranks
    args.max_steps = number_of_steps(job, data, world_size, accumulation, tokens_per_step)
    raise_if(schedule_problems(job.train, args.max_steps))
    for key, value in scheduler_arguments(job.train, args.max_steps).items():
        setattr(args, key, value)
    data.dataset.end = args.max_steps * job.train.micro_batch_size * world_size * accumulation  # samples trained
    identity = data.identity(fingerprint(tokenizer), packing_config(job))
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
    if checkpoint is not None and args.process_index == 0:
        log.info("resuming %s from %s (step %d of %d)", job.output_dir, checkpoint, checkpoint_step(checkpoint),
                 args.max_steps)
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
    the evaluation while training (:func:`pipeline.train_student.data.held_out_texts`). ``on_checkpoint`` is called once each
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
        try:
            with _cpu_threads(job.train.cpu_threads), trainer.saving_on_signals():
                trainer.train(resume_from_checkpoint=checkpoint)
        except BadShardError:
            if trainer.bad_shard is None:
                raise
        except KeyboardInterrupt as exc:  # Ctrl-C: the run stops where it is
            raise Interrupted(getattr(exc, "signum", signal.SIGINT), f"stopped at step {trainer.state.global_step} of "
                              f"{args.max_steps}; {rerun_start(job.output_dir)}") from None
    if trainer.bad_shard is not None:
        raise BadShardError(bad_shard_stop(trainer.bad_shard, job.output_dir, trainer.state.global_step, args.max_steps))
    if trainer.stop_reason:
        raise NonFiniteLossError(trainer.stop_reason)
    step = trainer.state.global_step
    if trainer.stop_signal is not None and step < args.max_steps:  # its last step is the run's end: it finishes
        raise Interrupted(trainer.stop_signal, f"checkpoint-{step} saved at step {step} of {args.max_steps} "
                                               f"({Path(job.output_dir) / f'checkpoint-{step}'}); the same command "
                                               "resumes from it")
    return trainer, start_step


def bad_shard_stop(problem: str, output_dir: str, step: int, max_steps: int) -> str:
    """The one line of a run stopped by a damaged shard (:meth:`GuidedTrainer.get_batch_samples`):
    the reader's ``problem`` (the shard and what is wrong), how to score it again, where the same
    command resumes, and why ``data.on_bad_shard=skip`` cannot resume the run."""
    shard = problem.split(": ", 1)[0]
    remedy = ""
    if "make score-teacher" not in problem and shard.endswith(".parquet"):
        remedy = (f"; score it again: delete {marker_of(sfs.name(shard))} beside it and run make score-teacher with the "
                  "settings that scored its folder")
    return (f"{problem}{remedy}. Training stopped at step {step} of {max_steps}: {rerun_start(output_dir)} once the "
            "shard is scored again. data.on_bad_shard=skip cannot resume this run (leaving the shard out changes the "
            "samples of every later step); it trains a new run without the shard: the same command with "
            "data.on_bad_shard=skip and run_name=<a new name> (or overwrite=true)")


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
        trackers=list(job.train.report_to),
    )


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


def _cpu_only(train: TrainConfig, world_size: int) -> bool:
    """Whether the run trains on CPUs: ``train.use_cpu``, or several processes where no GPU is
    (transformers would otherwise leave each process training alone on its own copy of every batch)."""
    return train.use_cpu or (world_size > 1 and not torch.cuda.is_available())


def _training_arguments(job: TrainJobConfig, accumulation: int, max_steps: int, world_size: int = 1):
    t = job.train
    cpu = _cpu_only(t, world_size)
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
        use_cpu=cpu,
        ddp_backend=t.ddp_backend or ("gloo" if cpu and world_size > 1 else None),  # never MPI unless asked
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


def refuse_undistributed(args: TrainingArguments, world_size: int) -> None:
    """Set up the process group and refuse, in one line before any work, a launch whose processes
    would not train as one data-parallel run: each on its own part of every global batch, the
    gradients reduced, one process writing. ``world_size`` is the launcher's (``WORLD_SIZE``)."""
    joined, mode = args.world_size, args.parallel_mode
    if world_size > 1 and (mode != ParallelMode.DISTRIBUTED or joined != world_size):
        raise ConfigError(
            f"this launch started {world_size} processes (WORLD_SIZE={world_size}), but they do not form one "
            f"data-parallel run here (transformers sees {joined} process(es), {mode.value}), so each would train "
            "the same batches alone; launch with torchrun or accelerate launch on GPUs or CPUs (docs/multi-node.md), "
            "or run one process")
    if world_size == 1 and joined > 1:
        raise ConfigError(f"this process sees a distributed run of {joined} processes but WORLD_SIZE is unset; "
                          "launch with torchrun or accelerate launch, which set it (docs/multi-node.md)")


def _byte_pieces_or_none(tokenizer):
    """The tokenizer's byte-fallback table, None when it has no such piece (byte-level BPE)."""
    table = byte_fallback_ids(tokenizer)
    return table if table.any() else None


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
        byte_pieces=_byte_pieces_or_none(tokenizer),
    )
    start_trackers(trainer, tracker_recipe(job, identity))  # one line if one cannot start; then the recipe
    return trainer


def tracker_recipe(job: TrainJobConfig, identity: dict) -> dict[str, str]:
    """The recipe as the trackers receive it (:class:`pipeline.train_student.tracker_callbacks.RecipeToTrackers`),
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
