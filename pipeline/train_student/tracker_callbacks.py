"""What a run adds to the Hugging Face Trainer's own tracker integrations (``train.report_to``,
:mod:`pipeline.train_student.trackers`): a tracker that cannot start ends the run in one line
before its first step (:func:`guard_tracker_start`), each started tracker receives the run's recipe
(:class:`RecipeToTrackers`), and a W&B run ends with the training (:class:`FinishWandbRun`).
"""

from __future__ import annotations

import sys
from typing import Sequence

from transformers import TrainerCallback

from pipeline.train_student.trackers import (
    START,
    TrackerStartError,
    first_line,
    get_available_reporting_integrations,
    integrations,
)


def guard_tracker_start(callbacks: Sequence[TrainerCallback]) -> None:
    """Each integration's start (its ``on_train_begin``: it opens its run there) made to end the
    run with one line, :class:`TrackerStartError`, instead of a traceback: before the first
    step, nothing trained, no checkpoint written."""
    names = {cls: name for name, cls in integrations().items()}
    for callback in callbacks:
        name = names.get(type(callback))
        if name is None or getattr(callback, "_start_guarded", False):
            continue
        start = callback.on_train_begin

        def guarded(*args, _start=start, _name=name, **kwargs):
            try:
                return _start(*args, **kwargs)
            except Exception as exc:
                how = START.get(_name, f"the settings of {_name}")
                raise TrackerStartError(
                    f"train.report_to: {_name} did not start ({type(exc).__name__}: {first_line(exc)}); nothing was "
                    f"trained. Set it up ({how}), or leave it out of train.report_to") from exc

        callback.on_train_begin, callback._start_guarded = guarded, True


class FinishWandbRun(TrainerCallback):
    """Ends the W&B run when training ends (after the Trainer's own W&B callback), so that each
    training is one W&B run even when a process trains several (the Trainer leaves it open until
    the process exits). MLflow's callback ends its run itself."""

    def on_train_end(self, args, state, control, **kwargs):
        wandb = sys.modules.get("wandb")
        if state.is_world_process_zero and wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.finish()


def tracker_callbacks(report_to: Sequence[str]) -> list[TrainerCallback]:
    """What the run adds to the Trainer's own integrations for ``report_to``."""
    uses_wandb = "wandb" in report_to or (list(report_to) == ["all"] and "wandb" in get_available_reporting_integrations())
    return [FinishWandbRun()] if uses_wandb else []


class RecipeToTrackers(TrainerCallback):
    """Gives each started tracker the run's recipe (``params``: flat ``recipe.*`` names and
    strings, :func:`pipeline.train_student.run.tracker_recipe`), so that runs can be filtered by
    it: MLflow's params, W&B's config, a TensorBoard text. It runs after the integrations' own
    start (they come first in the Trainer's callbacks), on the main process; other integrations
    get the Trainer's parameters only."""

    def __init__(self, params: dict[str, str], callbacks: Sequence[TrainerCallback]):
        self.params = dict(params)
        self.callbacks = callbacks

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        for callback in self.callbacks:
            kind = type(callback).__name__
            if kind == "MLflowCallback" and getattr(callback, "_initialized", False) and callback._ml_flow.active_run():
                limit = getattr(callback, "_MAX_PARAM_VAL_LENGTH", 6000)
                callback._ml_flow.log_params({k: v[:limit] for k, v in self.params.items()})
            elif kind == "WandbCallback" and getattr(callback, "_wandb", None) is not None and callback._wandb.run:
                callback._wandb.config.update(self.params, allow_val_change=True)
            elif kind == "TensorBoardCallback" and getattr(callback, "tb_writer", None) is not None:
                callback.tb_writer.add_text("recipe", "\n".join(f"    {k}: {v}" for k, v in self.params.items()))


def start_trackers(trainer, recipe: dict[str, str]) -> None:
    """What a run adds to its trackers' start: one line if one cannot start
    (:func:`guard_tracker_start`), then the recipe (:class:`RecipeToTrackers`)."""
    callbacks = trainer.callback_handler.callbacks
    guard_tracker_start(callbacks)
    trainer.add_callback(RecipeToTrackers(recipe, list(callbacks)))
