"""The learning-rate schedule of a student run, and the checkpoint that lets a run be continued.

Two schedules, both transformers' own (:func:`transformers.get_scheduler`):

* ``cosine`` (``cosine_with_min_lr``): linear warm-up, then a cosine from ``learning_rate`` down to
  ``min_learning_rate`` over the rest of the run. Its learning rate at every step depends on the
  run's total length, so a run cannot be lengthened without changing the steps it already took.
* ``wsd`` (``warmup_stable_decay``): linear warm-up, a stable phase at ``learning_rate``, then a
  cosine decay to ``min_learning_rate`` over the last :func:`decay_steps` steps. Up to the end of the
  stable phase it does not depend on the total, so a longer run takes the same steps there.

A ``wsd`` run keeps the checkpoint of the last step of its stable phase as ``stable/`` in its folder
(:class:`StableCheckpointCallback`): the Trainer's own rotation (``save_total_limit``) only ever
removes ``checkpoint-<step>`` folders, and ``stable/`` is written under a temporary name and
renamed, so it is whole or absent. ``train.continue_from`` resumes a longer run from there
(:mod:`pipeline.train_student.continuation`).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from transformers import TrainerCallback

from pipeline.train_student.checkpoints import STABLE_NAME, checkpoint_step, is_complete_checkpoint

log = logging.getLogger(__name__)


def decay_steps(train, steps: int) -> int:
    """Steps of a ``wsd`` run's decay: ``train.lr_decay_steps``, else ``train.lr_decay_share`` of
    the run's ``steps`` (rounded, at least one)."""
    if train.lr_decay_steps is not None:
        return train.lr_decay_steps
    return max(1, round(train.lr_decay_share * steps))


def stable_end(train, steps: int) -> int | None:
    """The last optimizer step of a ``wsd`` run's stable phase (every step up to it ran at a learning
    rate that does not depend on ``steps``); None for ``cosine``."""
    return steps - decay_steps(train, steps) if train.lr_scheduler == "wsd" else None


def schedule_problems(train, steps: int) -> list[str]:
    """What makes a ``wsd`` schedule impossible for a run of ``steps`` optimizer steps: a decay as
    long as the run. (A warm-up that reaches into the decay is allowed, as with cosine: the stable
    phase is then empty, and the kept checkpoint lies in the warm-up, whose rates do not depend on
    the run's length either.)"""
    if train.lr_scheduler != "wsd" or decay_steps(train, steps) < steps:
        return []
    return [f"train.lr_decay_steps: a decay of {decay_steps(train, steps)} steps leaves nothing before it in a run of "
            f"{steps} steps; shorten the decay (train.lr_decay_steps or train.lr_decay_share) or train longer"]


def scheduler_arguments(train, steps: int) -> dict:
    """``lr_scheduler_type`` and ``lr_scheduler_kwargs`` of the Trainer's arguments for a run of ``steps``."""
    if train.lr_scheduler == "wsd":
        return {"lr_scheduler_type": "warmup_stable_decay",
                "lr_scheduler_kwargs": {"num_decay_steps": decay_steps(train, steps), "decay_type": "cosine",
                                        "min_lr_ratio": train.min_learning_rate / train.learning_rate}}
    return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": train.min_learning_rate}}


def schedule_callbacks(train, steps: int) -> list:
    """The callbacks a run's schedule needs (a ``wsd`` run keeps its stable checkpoint)."""
    end = stable_end(train, steps)
    return [] if end is None else [StableCheckpointCallback(end)]


class StableCheckpointCallback(TrainerCallback):
    """Saves a checkpoint at the last step of the stable phase and keeps a copy of it as ``stable/``.

    Place it after the callback that completes checkpoints: the copy is made once that checkpoint
    carries its completion marker. A run killed between the save and the copy makes the copy when
    it resumes (``on_train_begin``)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._keep(args.output_dir)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero and state.global_step == self.step:
            self._keep(args.output_dir)

    def _keep(self, output_dir: str) -> None:
        source, kept = Path(output_dir) / f"checkpoint-{self.step}", Path(output_dir) / STABLE_NAME
        if is_complete_checkpoint(source) and not (is_complete_checkpoint(kept) and checkpoint_step(str(kept)) == self.step):
            keep_stable(source, kept)


def keep_stable(checkpoint: Path, target: Path) -> None:
    """``checkpoint`` copied to ``target`` (hard links where the filesystem allows: the Trainer never
    rewrites a saved file, it only deletes whole checkpoints), through a temporary name."""
    tmp = target.with_name(f".{target.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        shutil.copytree(checkpoint, tmp, copy_function=os.link)
    except OSError:  # another filesystem, or one without hard links
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(checkpoint, tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    log.info("kept %s as %s (the end of the stable phase: train.continue_from continues from it)", checkpoint.name,
             target)
