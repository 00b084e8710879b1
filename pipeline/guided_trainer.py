"""The Hugging Face ``Trainer`` with the teacher-guided loss, its metrics and its records.

:class:`GuidedTrainer` changes three things of ``transformers.Trainer``:

* ``compute_loss`` runs the student on ``input_ids`` and hands its logits to
  :func:`pipeline.guided_loss.guided_loss` with the batch's ``labels`` (already the next token of
  each position: the data is packed with the shift done, see :mod:`pipeline.student_data`, so
  nothing is shifted here), ``teacher_loss`` and ``mapped``. The loss is a per-micro-batch mean
  (``loss_is_scaled_for_ga = False``: the Trainer divides it by the accumulation steps), so with
  gradient accumulation and with several processes every micro-batch selects its own top k%;
  METHOD 2.2 asks for this to be documented: the selection is per micro-batch and per rank.
* the training sampler is sequential: the dataset is already in its shuffled order, and a
  sequential sampler makes the Trainer's resume (skip the batches already trained, without loading
  them) land exactly on the next sample.
* every logging step adds token-weighted statistics of the selection, summed over the
  micro-batches and processes since the last log: ``loss_kept`` (student loss on the trained
  tokens), ``loss_all`` (on all tokens), ``kept_fraction``, ``mapped_fraction``,
  ``teacher_loss_kept`` / ``teacher_loss_dropped`` (mean ``L_t`` of selected / not selected mapped
  tokens), ``excess_loss`` (mean ``l_s - L_t`` over mapped tokens), ``tokens_per_s`` (all
  processes, wall clock between logs), ``tokens_seen`` and ``sample_first``/``sample_last`` (the
  range of sample indices trained since the last log). The Trainer adds ``loss``,
  ``learning_rate``, ``grad_norm`` and ``epoch``.

``random`` mode draws its tokens from a generator seeded with ``(seed, step, micro-batch, rank)``,
so a resumed run draws the same tokens. Callbacks write the metrics as JSON lines
(:class:`JsonlMetricsCallback`) and the scored dataset's identity into every checkpoint
(:class:`DataIdentityCallback`).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from pipeline.guided_loss import SelectionConfig, guided_loss

DATA_IDENTITY_NAME = "data_identity.json"
METRICS_NAME = "metrics.jsonl"

# Running sums kept on the device between logging steps (no host synchronisation per step).
_SUMS = ("tokens", "n_valid", "n_mapped", "n_selected", "n_kept", "loss_kept", "loss_all",
         "teacher_loss_kept", "teacher_loss_dropped", "excess_loss")


class GuidedTrainer(Trainer):
    def __init__(self, *args, selection: SelectionConfig, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.selection = selection
        self.selection_seed = seed
        self.loss_is_scaled_for_ga = False
        self._sums = None  # (len(_SUMS),) float64 on the device
        self._samples = None  # (2,) first and last sample index since the last log, on the device
        self._micro = (-1, 0)  # (global step, micro-batch index within it)
        self._last_log_time = None

    # ---- data --------------------------------------------------------------------------------

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    # ---- loss --------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(input_ids=inputs["input_ids"]).logits  # (B, T, V)
        loss, stats = guided_loss(
            logits, inputs["labels"], inputs.get("teacher_loss"), inputs.get("mapped"),
            self.selection, generator=self._generator(logits.device),
        )
        if model.training:
            self._accumulate(inputs, stats, loss)
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

    def _accumulate(self, inputs, stats, loss) -> None:
        n_dropped = stats.n_mapped - stats.n_selected
        values = torch.stack([
            torch.tensor(inputs["input_ids"].numel(), device=loss.device, dtype=torch.float64),
            stats.n_valid, stats.n_mapped, stats.n_selected, stats.n_kept,
            loss.detach() * stats.n_kept,
            stats.loss_all * stats.n_valid,
            stats.teacher_loss_kept * stats.n_selected,
            stats.teacher_loss_dropped * n_dropped,
            stats.excess_loss * stats.n_mapped,
        ]).double().nan_to_num(nan=0.0)  # a mean over no token is NaN; its weight is 0
        self._sums = values if self._sums is None else self._sums + values
        idx = inputs["sample_index"].double()
        span = torch.stack([idx.min(), idx.max()])
        self._samples = span if self._samples is None else torch.stack(
            [torch.minimum(self._samples[0], span[0]), torch.maximum(self._samples[1], span[1])])

    # ---- logging -----------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._sums is not None:  # a training logging step, on every rank
            logs.update(self._selection_metrics())
        super().log(logs, start_time)

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
            "tokens_per_s": s["tokens"] / elapsed if elapsed and elapsed > 0 else math.nan,
            "tokens_seen": self.state.global_step * self.tokens_per_step,
            "sample_first": float(samples[0]),
            "sample_last": float(samples[1]),
        }

    @property
    def tokens_per_step(self) -> int:
        a = self.args
        return a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size * self.train_dataset.plan.seq_len

    def train(self, *args, **kwargs):
        self._last_log_time = time.perf_counter()
        return super().train(*args, **kwargs)


def _ratio(total: float, count: float) -> float:
    return total / count if count > 0 else math.nan


# --------------------------------------------------------------------------------------------
# Callbacks


class JsonlMetricsCallback(TrainerCallback):
    """Appends every log as one JSON line (``{"step": ..., **logs}``) to ``<output_dir>/metrics.jsonl``.

    On a resume, lines of steps after the checkpoint are dropped first, so the file reads as one
    run: each step once, in order.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.path.is_file():
            kept = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= state.global_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            record = {"step": state.global_step, "time": time.time(), **logs}
            with open(self.path, "a") as f:
                f.write(json.dumps(record, allow_nan=True) + "\n")


class DataIdentityCallback(TrainerCallback):
    """Writes the scored dataset's identity (``data_identity.json``) into every checkpoint folder."""

    def __init__(self, identity: dict):
        self.identity = identity

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                write_data_identity(folder, self.identity)


def write_data_identity(folder: str | os.PathLike, identity: dict) -> None:
    from storage_schemas import write_json_atomic

    write_json_atomic(Path(folder) / DATA_IDENTITY_NAME, identity)


def read_data_identity(folder: str | os.PathLike) -> dict | None:
    path = Path(folder) / DATA_IDENTITY_NAME
    return json.loads(path.read_text()) if path.is_file() else None
