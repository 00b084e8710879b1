"""Experiment trackers: ``train.report_to`` names the Hugging Face Trainer's own integrations
(``tensorboard``, ``wandb``, ``mlflow``, ...), which receive every log the run writes to
``metrics.jsonl``: the Trainer's figures and the guided loss's own statistics
(:class:`pipeline.train_student.trainer.GuidedTrainer`). Each integration is configured as its
project documents it, by environment (``WANDB_PROJECT``, ``WANDB_MODE=offline``,
``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ...); the tracker's run is named after the run
folder, it ends with the training (:class:`FinishWandbRun`), and it receives the run's recipe
beside the Trainer's parameters (:class:`RecipeToTrackers`). W&B and MLflow come with the
``trackers`` extra.

:func:`tracker_problems` checks the names before any work: an integration the Trainer does not
have (with the nearest name), one whose package is not installed (with how to install it), and
MLflow's tracking store, opened as MLflow will open it (:func:`mlflow_store_problem`: the
``trackers`` extra's mlflow-skinny cannot open MLflow's default, a SQLite database). A tracker that
still fails to start when training begins (a server that does not answer, W&B without a key) ends
the run in one line before its first step (:func:`guard_tracker_start`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Sequence

from transformers import TrainerCallback
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

from pipeline.runtime.config import UserError, nearest

ALONE = ("all", "none")  # the Trainer's words for every installed integration, and for none
INSTALL = {"wandb": "pip install 'vocagno[trackers]'", "mlflow": "pip install 'vocagno[trackers]'"}
# The one line that gives MLflow a store the trackers extra can open: a folder of files beside the project.
MLFLOW_FILE_STORE = "MLFLOW_TRACKING_URI=file:$PWD/mlruns MLFLOW_ALLOW_FILE_STORE=true"
# What makes each tracker start, for the line that says it did not.
START = {"mlflow": f"MLFLOW_TRACKING_URI (a server, http://<host>:5000, or local files: {MLFLOW_FILE_STORE})",
         "wandb": "WANDB_API_KEY or wandb login, or WANDB_MODE=offline without network"}


class TrackerStartError(UserError, RuntimeError):
    """A tracker of ``train.report_to`` could not start; nothing was trained."""


def tracker_problems(report_to: Sequence[str]) -> list[str]:
    """``report_to: ...`` lines for names the Trainer does not know or cannot load, and for an
    MLflow whose tracking store cannot be opened (empty: fine)."""
    names = list(report_to)
    if any(n in ALONE for n in names) and len(names) > 1:
        return [f"report_to: {names} mixes {' or '.join(ALONE)} with other names; give one of them alone, or a list of trackers"]
    known = sorted(INTEGRATION_TO_CALLBACK)
    installed = set(get_available_reporting_integrations())
    found = []
    for name in names:
        if name in ALONE:
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            found.append(f"report_to: {name!r} is not one of the Trainer's integrations ({', '.join(known)})"
                         f"{nearest(str(name), known)}")
        elif name not in installed:
            found.append(f"report_to: {name} is not installed ({INSTALL.get(name, f'install the package of {name}')})")
    if "mlflow" in installed and ("mlflow" in names or names == ["all"]):
        problem = mlflow_store_problem()
        found += [problem] if problem else []
    return found


def mlflow_store_problem() -> str | None:
    """Why MLflow cannot open its tracking store (the URI MLflow resolves: ``MLFLOW_TRACKING_URI``,
    else its default), or None. Opening it makes no request (a file store's folder is created, as
    MLflow would create it); a store MLflow
    refuses (a database without sqlalchemy, which mlflow-skinny lacks; a file store without
    ``MLFLOW_ALLOW_FILE_STORE``) is named with the line that gives it one that opens."""
    import mlflow  # optional (the trackers extra), and heavy: only where report_to names it

    uri = mlflow.get_tracking_uri()
    try:
        from mlflow.tracking._tracking_service.utils import _get_store  # as mlflow above; MLflow's own opener
    except ImportError:  # another MLflow's layout: the start is still guarded (guard_tracker_start)
        return None
    try:
        _get_store()
    except Exception as exc:  # MLflow raises its own and ImportError for a missing driver
        scheme = uri.split(":", 1)[0].split("+", 1)[0]
        if scheme in ("sqlite", "postgresql", "mysql", "mssql") and importlib.util.find_spec("sqlalchemy") is None:
            default = "" if os.environ.get("MLFLOW_TRACKING_URI") else ", MLflow's default with MLFLOW_TRACKING_URI unset,"
            why = f"a database{default} which mlflow-skinny (the trackers extra) cannot open: it has no sqlalchemy"
        elif "MLFLOW_ALLOW_FILE_STORE" in str(exc):
            why = "a folder of files, which MLflow opens only with MLFLOW_ALLOW_FILE_STORE=true"
        else:
            why = _first_line(exc)
        return (f"report_to: mlflow cannot open its tracking store {uri} ({why}); give it one: {MLFLOW_FILE_STORE} "
                "(a folder of files), or MLFLOW_TRACKING_URI=http://<host>:5000 (a server), or pip install mlflow "
                "(the full package opens the default database)")
    return None


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def guard_tracker_start(callbacks: Sequence[TrainerCallback]) -> None:
    """Each integration's start (its ``on_train_begin``: it opens its run there) made to end the
    run with one line, :class:`TrackerStartError`, instead of a traceback: before the first
    step, nothing trained, no checkpoint written."""
    names = {cls: name for name, cls in INTEGRATION_TO_CALLBACK.items()}
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
                    f"train.report_to: {_name} did not start ({type(exc).__name__}: {_first_line(exc)}); nothing was "
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
