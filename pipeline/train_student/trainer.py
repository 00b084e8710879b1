"""The Hugging Face ``Trainer`` with the teacher-guided loss (docs/METHOD.md §2.2), its metrics and
its checkpoint records.

:class:`GuidedTrainer` changes ``transformers.Trainer`` in nine ways:

* ``compute_loss`` hands the student's logits to :func:`pipeline.method.guided_loss.guided_loss` (the public loss)
  with the batch's ``labels`` (already shifted by the packing, :mod:`pipeline.student_data.dataset`),
  ``teacher_loss`` and ``mapped``. The loss is a per-micro-batch mean, so the top k% is selected
  per micro-batch and per rank, see docs/METHOD.md §2.2. ``random`` mode seeds its draw with
  ``(seed, step, micro-batch, rank)``, so a resumed run draws the same tokens.
* the sampler is sequential: the dataset is already in its shuffled order, so the Trainer's resume
  (skip the batches already trained) lands exactly on the next sample. It stops at the dataset's
  ``end`` (the samples the run trains), so no data-loader worker, prefetching ahead, reads a
  sample past the last step.
* every log adds token-weighted statistics of the selection since the last log (``loss_kept``,
  ``loss_all``, ``kept_fraction``, ``mapped_fraction``, ``teacher_loss_kept``/``_dropped``,
  ``excess_loss``, ``tokens_per_s``, ``tokens_seen``, ``sample_first``/``sample_last``), and its
  ``epoch`` is the passes over the scored data (the Trainer's own counts the bounded sampler). It
  also describes the run's own selection by the tokens it *trained* on and those it *left* (valid
  tokens not trained): ``student_loss_left`` (beside ``loss_kept``, the student's loss on the
  trained ones), ``teacher_loss_trained``/``_left`` (over the mapped ones of each group) and, for a
  student tokenizer with byte fallback, ``byte_share_trained``/``_left`` (the share of byte-fallback
  pieces in each group).
* with several teachers (docs/METHOD.md §2.6) every log also adds per-teacher metrics
  (:class:`pipeline.train_student.several_teachers.TeacherMetrics`: ``decided_t<i>``,
  ``mapped_fraction_t<i>``, ``selection_jaccard_t<a>_t<b>``), kept in the section "several
  teachers" below; a skipped step's sums are dropped, as for the other metrics.
* with a data mixture (:mod:`pipeline.train_student.mixture`) every log also adds the realised
  share of each corpus among the samples drawn since the last log, ``mixture_share_<name>``
  (section "mixtures" below), counted from the ``corpus`` of each sample of the batches.
* its evaluation (``train.eval_every``, the Trainer's own evaluation steps) is held-out bits per byte
  (:func:`pipeline.method.bits_per_byte.text_losses`, the measure of ``make eval-student``) on the texts
  given as ``eval_dataset``, each process measuring every ``world_size``-th text; it logs
  ``eval_bits_per_byte``, ``eval_nats_per_token`` and ``eval_runtime`` beside the training metrics
  and leaves the model, its mode and the random state as they were.
* a step whose loss (any micro-batch, any rank) or gradient is not finite is skipped whole: the
  optimizer does nothing, while the step still counts (batches consumed, schedule advanced), so a
  resumed run stays exact. After ``max_in_a_row`` such steps in a row the trainer saves a
  checkpoint and stops; the run then raises :class:`NonFiniteLossError`. With fp16 the gradient
  scaler keeps handling overflow itself; only non-finite losses count there.
* SIGTERM or SIGUSR1 while it trains (a preemption, ``scancel``, a time limit: Slurm's ``--signal``)
  is noted (:meth:`GuidedTrainer.saving_on_signals`), and the optimizer step under way ends with a
  log and a complete checkpoint at that step, on every rank (the ranks agree in the step's one
  reduction), then training stops; the run then raises :class:`pipeline.runtime.config.Interrupted`. A
  resumed run goes on from that step exactly. The data-loader workers, which get the same signal
  from a scheduler, leave it to the training process.
* a shard found damaged while a step's micro-batches are read (by a data-loader worker, on any
  rank: the ranks agree once per step, before its first forward) stops the run at the step
  reached, as a signal does: the steps since the last log are logged, a complete checkpoint is
  saved there (unless one already is) and training stops; ``bad_shard`` then holds the reader's
  message, which the run raises as :class:`storage_schemas.reader.BadShardError`. Nothing of the
  step under way has touched the weights, so a rerun on the shard scored again resumes exactly.
* its last log's ``train_loss`` is the mean loss over all the run's steps, those of the runs it
  resumed or continued included (the Trainer's own counts this call's steps only), as an
  uninterrupted run reports it: each complete checkpoint records the sum of the losses up to its
  step (:meth:`GuidedTrainer.loss_sum`). Loading a checkpoint does not warn that a tied weight
  (``lm_head.weight`` of a student with tied embeddings, never saved) is missing; any other
  missing weight still is.

Callbacks write the metrics as JSON lines and complete every checkpoint with the data identity
and its marker (:mod:`pipeline.train_student.checkpoints`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from pipeline.method.bits_per_byte import default_window, text_losses
from pipeline.runtime.config import UserError, handling
from pipeline.method.guided_loss import SelectionConfig, guided_loss
from pipeline.train_student.checkpoints import mark_complete
from pipeline.train_student.several_teachers import TeacherMetrics
from storage_schemas.reader import BadShardError

log = logging.getLogger(__name__)

# The signals that save a checkpoint at the current step before the run stops (module docstring).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# Running sums kept on the device between logging steps (no host synchronisation per step).
_SUMS = ("tokens", "n_valid", "n_mapped", "n_selected", "n_kept", "loss_kept", "loss_all",
         "teacher_loss_kept", "teacher_loss_dropped", "excess_loss",
         "n_left", "student_loss_left", "n_trained_mapped", "teacher_loss_trained", "n_left_mapped",
         "teacher_loss_left", "n_byte_trained", "n_byte_left")


class NonFiniteLossError(UserError, RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient; the run stopped."""


@dataclass
class NonFiniteGuard:
    """Which optimizer steps were skipped for a non-finite loss or gradient (module docstring),
    the current streak, and when to stop. Saved in every checkpoint, so a resumed run keeps
    counting where the interrupted one was."""

    max_in_a_row: int = 5
    skipped: list[int] = field(default_factory=list)  # 1-based optimizer steps, as in the logs
    in_a_row: int = 0

    def record(self, step: int, finite: bool) -> bool:
        """Record step ``step``; True when the run must stop."""
        if finite:
            self.in_a_row = 0
            return False
        self.skipped.append(step)
        self.in_a_row += 1
        return self.in_a_row >= self.max_in_a_row

    def state(self) -> dict:
        return {"skipped": list(self.skipped), "in_a_row": self.in_a_row}

    def restore(self, state: dict | None) -> None:
        state = state or {}
        self.skipped = [int(s) for s in state.get("skipped", [])]
        self.in_a_row = int(state.get("in_a_row", 0))


class GuidedTrainer(Trainer):
    def __init__(self, *args, selection: SelectionConfig, seed: int = 0, guard: NonFiniteGuard | None = None,
                 teacher_metrics: TeacherMetrics | None = None, eval_batch_size: int = 8,
                 byte_pieces: np.ndarray | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # A bool per vocabulary id: a byte-fallback piece (pipeline.method.tokenization.byte_fallback_ids)
        self.byte_pieces = None if byte_pieces is None else torch.as_tensor(byte_pieces, dtype=torch.bool)
        self.eval_batch_size = eval_batch_size  # blocks per forward pass of the held-out evaluation
        self.teacher_metrics = teacher_metrics  # several teachers (docs/METHOD.md §2.6)
        self._teacher_sums = self._teacher_step_sums = None
        self._corpus_counts = None  # a mixture's samples per corpus since the last log, on the device
        self.selection = selection
        self.selection_seed = seed
        self.guard = guard or NonFiniteGuard()
        self.stop_reason: str | None = None  # set when the guard stopped the run
        self.loss_is_scaled_for_ga = False
        self._sums = None  # (len(_SUMS),) float64 on the device
        self._samples = None  # (2,) first and last sample index since the last log, on the device
        self._step_sums = None  # (len(_SUMS),) of the current optimizer step's micro-batches
        self._step_nonfinite = None  # 0-dim bool: a micro-batch of the current step had a non-finite loss
        self._skip_update = False  # the decision for the current step, read by the guarded optimizer step
        self._skipped_since_log = 0
        self._micro = (-1, 0)  # (global step, micro-batch index within it)
        self._last_log_time = None
        self.stop_signal: int | None = None  # SIGTERM or SIGUSR1 noted while training (saving_on_signals)
        self.bad_shard: str | None = None  # a damaged shard met while reading a step's batches (any rank)
        self._steps_read = 0  # optimizer steps whose batches this call has read
        self.earlier_loss_sum = 0.0  # the losses of the steps before this call's first (a resume, a continuation)
        for callback in self.callback_handler.callbacks:  # each checkpoint records the run's loss sum
            if isinstance(callback, CheckpointRecordCallback):
                callback.loss_sum = self.loss_sum

    # ---- stopping on a signal (module docstring) ------------------------------------------------

    @contextlib.contextmanager
    def saving_on_signals(self):
        """While it trains, SIGTERM and SIGUSR1 are noted (the first one; a repeat, as torchrun
        passes the scheduler's on, changes nothing) instead of stopping the process where it is:
        the step under way ends with a checkpoint (:meth:`_decide_update`). Outside the main
        thread signals cannot be caught, and they keep what they do."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(signum, frame):
            if self.stop_signal is None:
                self.stop_signal = signum

        with handling(STOP_SIGNALS, note):
            yield

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        inner = getattr(loader, "base_dataloader", loader)  # accelerate's wrapper reads its loader's settings
        inner.worker_init_fn = functools.partial(_worker_ignores_stop_signals, inner.worker_init_fn)
        _end_workers_at_exit()
        return loader

    # ---- data --------------------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, read before its first forward; a damaged shard met while
        reading them, on any rank, stops the run at the step reached (module docstring)."""
        problem = None
        try:
            batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        except BadShardError as exc:
            batches, items, problem = [], None, worker_message(exc)
        problem = self._on_any_rank(problem, device)
        if problem is None:
            self._steps_read += 1
            return batches, items
        self.bad_shard = problem
        if not self._steps_read:  # nothing trained in this call: nothing to log or save
            raise BadShardError(problem)
        self.control.should_training_stop = self.control.should_log = True  # the Trainer's loop ends: it logs and saves
        self.control.should_save = self.state.global_step % self.args.save_steps != 0  # else saved at this step already
        return [], None

    def _on_any_rank(self, problem: str | None, device) -> str | None:
        """``problem``, or another rank's (one reduction per step; the message only when there is one)."""
        if self.args.world_size == 1:
            return problem
        found = torch.tensor(float(problem is not None), device=device)
        if not self.accelerator.reduce(found, reduction="sum").item():
            return None
        problems = [None] * self.args.world_size
        torch.distributed.all_gather_object(problems, problem)
        return next(p for p in problems if p is not None)

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return torch.utils.data.SequentialSampler(range(min(getattr(dataset, "end", len(dataset)), len(dataset))))

    # ---- loss --------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(input_ids=inputs["input_ids"]).logits  # (B, T, V)
        byte_pieces = self._byte_pieces(inputs["labels"])
        selection = guided_loss(
            logits, inputs["labels"], inputs.get("teacher_loss"), inputs.get("mapped"),
            self.selection, generator=self._generator(logits.device), byte_pieces=byte_pieces,
        )
        loss, stats = selection.loss, selection.stats
        if model.training:
            self._accumulate(inputs, stats, loss, selection, byte_pieces)
            self._accumulate_teachers(inputs, selection)
            self._accumulate_corpora(inputs)
        return (loss, {"logits": logits}) if return_outputs else loss

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """For ``random`` mode: a generator seeded by (seed, step, micro-batch, rank)."""
        step, micro = self._micro
        self._micro = (self.state.global_step, micro + 1 if step == self.state.global_step else 0)
        if self.selection.mode != "random":
            return None
        seed = np.random.SeedSequence(
            [self.selection_seed, self.state.global_step, self._micro[1], self.args.process_index]
        ).generate_state(1)[0]
        return torch.Generator(device=device).manual_seed(int(seed))

    def _byte_pieces(self, labels: torch.Tensor) -> torch.Tensor | None:
        """(B, T) bool: the targets that are byte-fallback pieces (None without a vocabulary table)."""
        if self.byte_pieces is None:
            return None
        if self.byte_pieces.device != labels.device:
            self.byte_pieces = self.byte_pieces.to(labels.device)
        ids = labels.clamp(min=0, max=self.byte_pieces.numel() - 1)
        return self.byte_pieces[ids] & (labels >= 0)

    def _accumulate(self, inputs, stats, loss, selection, byte_pieces) -> None:
        n_dropped = stats.n_mapped - stats.n_selected
        values = torch.stack([
            torch.tensor(inputs["input_ids"].numel(), device=loss.device, dtype=torch.float64),
            stats.n_valid, stats.n_mapped, stats.n_selected, stats.n_kept,
            loss.detach() * stats.n_kept,
            stats.loss_all * stats.n_valid,
            stats.teacher_loss_kept * stats.n_selected,
            stats.teacher_loss_dropped * n_dropped,
            stats.excess_loss * stats.n_mapped,
            *_trained_and_left(selection, inputs.get("teacher_loss"), byte_pieces),
        ]).double().nan_to_num(nan=0.0)  # a mean over no token is NaN; its weight is 0
        self._step_sums = values if self._step_sums is None else self._step_sums + values
        bad = ~torch.isfinite(loss.detach())
        self._step_nonfinite = bad if self._step_nonfinite is None else self._step_nonfinite | bad
        idx = inputs["sample_index"].double()
        span = torch.stack([idx.min(), idx.max()])
        self._samples = span if self._samples is None else torch.stack(
            [torch.minimum(self._samples[0], span[0]), torch.maximum(self._samples[1], span[1])])

    # ---- non-finite steps (module docstring) --------------------------------------------------

    def create_optimizer(self, model=None):
        """The Trainer's optimizer (AdamW by default), its ``step`` guarded: on a skipped step it
        does nothing at all (no moment update, no weight decay, no step count)."""
        optimizer = super().create_optimizer(model)
        if not hasattr(optimizer, "unguarded_step"):
            unguarded = optimizer.step

            def step(*args, **kwargs):
                return None if self._skip_update else unguarded(*args, **kwargs)

            optimizer.unguarded_step, optimizer.step = unguarded, step
        return optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:  # the step's last micro-batch: its gradients are complete
            self._decide_update()
        return loss

    def _decide_update(self) -> None:
        """Check the step (losses of its micro-batches, gradient norm) on every process, count it,
        and stop the run after too many bad steps in a row."""
        bad = self._step_nonfinite
        bad = torch.zeros((), dtype=torch.bool, device=self.args.device) if bad is None else bad
        if self.accelerator.scaler is None:  # with fp16 the scaler owns gradient overflow
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if grads:
                bad = bad | ~torch.isfinite(torch.nn.utils.get_total_norm(grads))
        flags = torch.stack([bad.float(), torch.tensor(float(self.stop_signal is not None), device=bad.device)])
        if self.args.world_size > 1:  # one reduction: any rank's bad step, any rank's signal
            flags = self.accelerator.reduce(flags, reduction="sum")
        skip, signalled = (bool(f) for f in (flags > 0).tolist())  # one host synchronisation per optimizer step
        step = self.state.global_step + 1
        self._skip_update = skip
        if self._step_sums is not None:
            kept = self._step_sums
            if skip:  # a skipped step's tokens count for throughput only (_SUMS[0])
                kept = torch.cat([kept[:1], torch.zeros_like(kept[1:])])
            self._sums = kept if self._sums is None else self._sums + kept
        self._step_sums = self._step_nonfinite = None
        self._close_teacher_step(skip)
        stop = self.guard.record(step, finite=not skip)
        if skip:
            self._skipped_since_log += 1
            if self.is_world_process_zero():
                log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row, %d in this run)",
                            step, self.guard.in_a_row, len(self.guard.skipped))
        if stop:
            self.stop_reason = self._stop_message(step)
        if stop or signalled:
            if signalled and self.stop_signal is None:
                self.stop_signal = signal.SIGTERM  # another rank's signal: this one stops with it
            self.control.should_training_stop = True
            self.control.should_save = True  # this step's weights (for the guard: the last applied step's), resumable
            self.control.should_log = True

    def _stop_message(self, step: int) -> str:
        a = self.args
        first = step - self.guard.in_a_row + 1
        per_step = a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size
        return (
            f"training stopped at step {step}: {self.guard.in_a_row} optimizer steps in a row (steps {first}-{step}, "
            f"packed samples {(first - 1) * per_step}-{step * per_step - 1}) had a non-finite loss or gradient; "
            f"none of them changed the weights ({len(self.guard.skipped)} skipped steps in this run). The checkpoint "
            f"{Path(a.output_dir) / f'checkpoint-{step}'} holds the weights of step {first - 1}. Lower the learning "
            "rate, inspect those samples, or raise train.max_nonfinite_in_a_row; a rerun resumes from that checkpoint."
        )

    # ---- logging -----------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "train_loss" in logs and self.state.global_step:  # the end of training: the whole run's mean
            logs["train_loss"] = (self.earlier_loss_sum + self._total_loss_scalar) / self.state.global_step
        if "loss" in logs and self._sums is not None:  # a training logging step, on every rank
            logs.update(self._selection_metrics())
            logs.update(self._teacher_log())
            logs.update(self._mixture_log())
            logs.update(nonfinite_steps=len(self.guard.skipped), skipped_steps=self._skipped_since_log)
            self._skipped_since_log = 0
        passes = self._data_passes()
        if passes is None:
            super().log(logs, start_time)
            return
        # The Trainer writes its state.epoch into every log: the share of the sampler consumed. The
        # sampler stops at the run's last sample, so that reads 1.0 at the end of any run; log the
        # passes over the scored data instead, and keep the Trainer's own value for its loop.
        trainer_epoch, self.state.epoch = self.state.epoch, passes
        try:
            super().log(logs, start_time)
        finally:
            self.state.epoch = trainer_epoch

    def loss_sum(self) -> float:
        """The sum of the per-step losses of the run's steps so far, earlier calls' included."""
        return self.earlier_loss_sum + self._total_loss_scalar + float(self._tr_loss.item())

    def _issue_warnings_after_load(self, load_result) -> None:
        """The Trainer's warnings after loading a checkpoint, without the tied weights it lists as
        missing (never saved: they are their source's, loaded); a missing source still warns."""
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        missing = set(load_result.missing_keys)
        untied = [k for k in load_result.missing_keys if k not in tied or tied[k] in missing]
        if len(untied) < len(missing):
            self.model.tie_weights()
        super()._issue_warnings_after_load(load_result._replace(missing_keys=untied))

    def _data_passes(self) -> float | None:
        """Passes over the documents so far (``epoch`` in the logs): samples consumed over the
        samples of one pass. None when the dataset has no packing plan or training has not begun."""
        plan = getattr(self.train_dataset, "plan", None)
        if plan is None or self.state.epoch is None or not plan.n_samples:
            return None
        length = len(self.train_dataset)
        sampled = min(getattr(self.train_dataset, "end", length), length)
        return self.state.epoch * sampled * plan.epochs / plan.n_samples

    def _selection_metrics(self) -> dict[str, float]:
        sums, samples = self._sums, self._samples
        if self.args.world_size > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
            gathered = self.accelerator.gather(samples.unsqueeze(0))  # (world, 2)
            samples = torch.stack([gathered[:, 0].min(), gathered[:, 1].max()])
        s = dict(zip(_SUMS, sums.tolist()))
        now = time.perf_counter()
        elapsed = now - self._last_log_time if self._last_log_time is not None else math.nan
        self._last_log_time = now
        self._sums = self._samples = None
        return {
            "loss_kept": _ratio(s["loss_kept"], s["n_kept"]),
            "loss_all": _ratio(s["loss_all"], s["n_valid"]),
            "kept_fraction": _ratio(s["n_kept"], s["n_valid"]),
            "mapped_fraction": _ratio(s["n_mapped"], s["n_valid"]),
            "teacher_loss_kept": _ratio(s["teacher_loss_kept"], s["n_selected"]),
            "teacher_loss_dropped": _ratio(s["teacher_loss_dropped"], s["n_mapped"] - s["n_selected"]),
            "excess_loss": _ratio(s["excess_loss"], s["n_mapped"]),
            "student_loss_left": _ratio(s["student_loss_left"], s["n_left"]),
            "teacher_loss_trained": _ratio(s["teacher_loss_trained"], s["n_trained_mapped"]),
            "teacher_loss_left": _ratio(s["teacher_loss_left"], s["n_left_mapped"]),
            **({"byte_share_trained": _ratio(s["n_byte_trained"], s["n_kept"]),
                "byte_share_left": _ratio(s["n_byte_left"], s["n_left"])} if self.byte_pieces is not None else {}),
            "tokens_per_s": s["tokens"] / elapsed if elapsed and elapsed > 0 else math.nan,
            "tokens_seen": self.state.global_step * self.tokens_per_step,
            "sample_first": float(samples[0]),
            "sample_last": float(samples[1]),
        }

    # ---- held-out evaluation -----------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Held-out bits per byte of the model as it is now (module docstring)."""
        texts = list(eval_dataset if eval_dataset is not None else self.eval_dataset)
        model, t0 = self.model, time.perf_counter()
        training = model.training
        try:
            with self.accelerator.autocast():  # the training's mixed precision, if any
                losses = text_losses(model, self.processing_class, texts[self.args.process_index::self.args.world_size],
                                     window=default_window(model), batch_size=self.eval_batch_size)
        finally:
            model.train(training)
        sums = torch.tensor([math.fsum(x.nats for x in losses), sum(x.n_bytes for x in losses),
                             sum(x.n_tokens for x in losses)], dtype=torch.float64, device=self.args.device)
        if self.args.world_size > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        nats, n_bytes, n_tokens = sums.tolist()
        metrics = {f"{metric_key_prefix}_bits_per_byte": _ratio(nats / math.log(2), n_bytes),
                   f"{metric_key_prefix}_nats_per_token": _ratio(nats, n_tokens),
                   f"{metric_key_prefix}_runtime": round(time.perf_counter() - t0, 4)}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ---- several teachers (docs/METHOD.md §2.6) ------------------------------------------------

    def _accumulate_teachers(self, inputs, selection) -> None:
        """Add a micro-batch's per-teacher sums (:class:`TeacherMetrics`) to the current step's."""
        if self.teacher_metrics is None or "teacher_losses" not in inputs:
            return
        sums = self.teacher_metrics.sums(selection.token_loss, selection.valid, selection.selected,
                                         inputs["teacher_losses"], inputs["teacher_loss"])
        self._teacher_step_sums = sums if self._teacher_step_sums is None else self._teacher_step_sums + sums

    def _close_teacher_step(self, skip: bool) -> None:
        """At the end of an optimizer step: its sums count unless the step was skipped."""
        sums, self._teacher_step_sums = self._teacher_step_sums, None
        if sums is not None and not skip:
            self._teacher_sums = sums if self._teacher_sums is None else self._teacher_sums + sums

    def _teacher_log(self) -> dict[str, float]:
        """The per-teacher metrics since the last log (all ranks' sums)."""
        if self.teacher_metrics is None:
            return {}
        sums = self._teacher_sums
        if sums is None:
            sums = torch.zeros(self.teacher_metrics.n_sums, dtype=torch.float64, device=self.args.device)
        if self.args.world_size > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        self._teacher_sums = None
        return self.teacher_metrics.metrics(sums.tolist())

    # ---- mixtures (pipeline.train_student.mixture) -----------------------------------------------

    def _accumulate_corpora(self, inputs) -> None:
        """Count a micro-batch's samples per corpus of the mixture (drawn, whether or not the step
        is later skipped)."""
        names = getattr(self.train_dataset, "corpus_names", None)
        if names is None or "corpus" not in inputs:
            return
        counts = torch.bincount(inputs["corpus"].reshape(-1), minlength=len(names)).double()
        self._corpus_counts = counts if self._corpus_counts is None else self._corpus_counts + counts

    def _mixture_log(self) -> dict[str, float]:
        """Each corpus's share of the samples drawn since the last log (all ranks' counts)."""
        names = getattr(self.train_dataset, "corpus_names", None)
        if names is None:
            return {}
        counts = self._corpus_counts
        if counts is None:
            counts = torch.zeros(len(names), dtype=torch.float64, device=self.args.device)
        if self.args.world_size > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        self._corpus_counts = None
        total = float(counts.sum())
        return {f"mixture_share_{name}": _ratio(float(n), total) for name, n in zip(names, counts.tolist())}

    @property
    def tokens_per_step(self) -> int:
        a = self.args
        return a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size * self.train_dataset.plan.seq_len

    def train(self, *args, **kwargs):
        self._last_log_time = time.perf_counter()
        return super().train(*args, **kwargs)


@functools.cache
def _end_workers_at_exit() -> None:
    """Data-loader workers ignore SIGTERM (:func:`_worker_ignores_stop_signals`), which is how
    multiprocessing ends its daemonic children when the process exits before the loader shut them
    down (an error raised while training, a stop after the checkpoint): it would then wait for them
    for ever. This exit hook, registered after multiprocessing's own and so run before it, kills
    them first; a worker holds nothing that needs saving."""
    def kill_daemonic_children() -> None:
        for child in multiprocessing.active_children():
            if child.daemon:
                child.kill()
                child.join(5)

    atexit.register(kill_daemonic_children)


def _worker_ignores_stop_signals(init, worker_id: int) -> None:
    """A data-loader worker's start: SIGTERM and SIGUSR1 ignored (a scheduler signals every process;
    the training process saves and stops, and ends its workers), then the Trainer's own ``init``."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    if init is not None:
        init(worker_id)


def _trained_and_left(selection, teacher_loss: torch.Tensor | None, byte_pieces: torch.Tensor | None) -> list:
    """The sums behind the trained / left metrics (module docstring), in ``_SUMS``'s order from
    ``n_left``: 0-dim tensors on the loss's device."""
    valid, trained = selection.valid, selection.trained
    left = valid & ~trained
    l_s = selection.token_loss.float()
    zero = torch.zeros((), dtype=torch.float64, device=l_s.device)
    if teacher_loss is None:
        mapped_t = mapped_l = torch.zeros_like(valid)
        l_t = torch.zeros_like(l_s)
    else:
        known = ~torch.isnan(teacher_loss)
        mapped_t, mapped_l = trained & known, left & known
        l_t = torch.nan_to_num(teacher_loss.float(), nan=0.0)
    if byte_pieces is None:
        bytes_t = bytes_l = zero
    else:
        bytes_t, bytes_l = (byte_pieces & trained).sum(), (byte_pieces & left).sum()
    return [left.sum(), torch.where(left, l_s, 0.0).sum(), mapped_t.sum(), torch.where(mapped_t, l_t, 0.0).sum(),
            mapped_l.sum(), torch.where(mapped_l, l_t, 0.0).sum(), bytes_t, bytes_l]


def worker_message(exc: BaseException) -> str:
    """The message of ``exc`` as raised in a data-loader worker: torch raises it again in the
    training process as ``Caught <type> in DataLoader worker process <n>`` and the worker's whole
    traceback, which ends with the original message."""
    cls = type(exc)
    return str(exc).rsplit(f"{cls.__module__}.{cls.__qualname__}: ", 1)[-1].strip()


def _ratio(total: float, count: float) -> float:
    return total / count if count > 0 else math.nan


# --------------------------------------------------------------------------------------------
# Callbacks


class JsonlMetricsCallback(TrainerCallback):
    """Appends every log as one JSON line (``{"step": ..., **logs}``) to ``<output_dir>/metrics.jsonl``.

    On a resume, lines of steps after the checkpoint are dropped first (and a last line cut short
    by a killed process), so the file reads as one run: each step once, in order. The rewrite goes
    through a temporary file, so a kill during it leaves the old file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.path.is_file():
            kept = [ln for ln in self.path.read_text().splitlines() if _step_of(ln) <= state.global_step]
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text("".join(ln + "\n" for ln in kept))
            os.replace(tmp, self.path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            record = {"step": state.global_step, "time": time.time(), **logs}
            with open(self.path, "a") as f:
                f.write(json.dumps(record, allow_nan=True) + "\n")


def _step_of(line: str) -> float:
    """The step of a metrics line; infinity for a line that is not a JSON record (cut short)."""
    try:
        return json.loads(line).get("step", 0)
    except (json.JSONDecodeError, AttributeError):
        return math.inf


class CheckpointRecordCallback(TrainerCallback):
    """Completes every checkpoint folder the Trainer saved: the scored dataset's identity
    (``data_identity.json``), then ``checkpoint_complete.json`` (the step and the
    :class:`NonFiniteGuard` state), written last (after all processes finished their files)."""

    def __init__(self, identity: dict, guard: NonFiniteGuard, on_complete: Callable[[], None] | None = None):
        self.identity = identity
        self.guard = guard
        self.on_complete = on_complete  # called once a checkpoint is complete (rank 0)
        self.loss_sum: Callable[[], float] | None = None  # GuidedTrainer.loss_sum, set by the trainer

    def on_save(self, args, state, control, **kwargs):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank has written its RNG state
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                mark_complete(folder, self.identity, state.global_step, self.guard.state(),
                              self.loss_sum() if self.loss_sum else None)
                if self.on_complete is not None:
                    self.on_complete()
