"""Experiment trackers: ``train.report_to`` names the Hugging Face Trainer's own integrations
(``tensorboard``, ``wandb``, ``mlflow``, ...), which receive every log the run writes to
``metrics.jsonl``: the Trainer's figures and the guided loss's own statistics
(:class:`pipeline.train_student.trainer.GuidedTrainer`). Each integration is configured as its
project documents it, by environment (``WANDB_PROJECT``, ``WANDB_MODE=offline``,
``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ...); the tracker's run is named after the run
folder, it ends with the training (:class:`~pipeline.train_student.tracker_callbacks.FinishWandbRun`), and it receives the run's recipe
beside the Trainer's parameters (:class:`~pipeline.train_student.tracker_callbacks.RecipeToTrackers`). W&B and MLflow come with the
``trackers`` extra.

:func:`tracker_problems` checks the names before any work: an integration the Trainer does not
have (with the nearest name), one whose package is not installed (with how to install it), and
MLflow's tracking store, opened as MLflow will open it (:func:`mlflow_store_problem`: the
``trackers`` extra's mlflow-skinny cannot open MLflow's default, a SQLite database). A tracker that
still fails to start when training begins (a server that does not answer, W&B without a key) ends
the run in one line before its first step (:func:`~pipeline.train_student.tracker_callbacks.guard_tracker_start`). This module asks
transformers only inside the checks that need its tables, so that a config error is refused first;
the callbacks, which subclass transformers' ``TrainerCallback``: :mod:`pipeline.train_student.tracker_callbacks`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Sequence

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


def get_available_reporting_integrations() -> list[str]:
    """The Trainer's integrations whose packages are installed (transformers' own answer)."""
    from transformers.integrations.integration_utils import get_available_reporting_integrations as installed  # lazy: seconds to import; a config error is refused first

    return installed()


def integrations() -> dict:
    """The Trainer's integrations: each name and its callback class (transformers' own table)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK  # lazy: seconds to import; a config error is refused first

    return INTEGRATION_TO_CALLBACK


def tracker_name_problems(report_to: Sequence[str]) -> list[str]:
    """``report_to`` mixing ``all`` or ``none`` with other names (the settings alone)."""
    names = list(report_to)
    if any(n in ALONE for n in names) and len(names) > 1:
        return [f"report_to: {names} mixes {' or '.join(ALONE)} with other names; give one of them alone, or a list of trackers"]
    return []


def tracker_problems(report_to: Sequence[str]) -> list[str]:
    """``report_to: ...`` lines for names the Trainer does not know or cannot load, and for an
    MLflow whose tracking store cannot be opened (empty: fine); what this machine has, so
    transformers is asked (a ``report_to`` that mixes ``all`` or ``none`` with names:
    :func:`tracker_name_problems`)."""
    names = list(report_to)
    if tracker_name_problems(names) or all(n == "none" for n in names):  # nothing to ask transformers
        return []
    table = integrations()
    known = sorted(table)
    installed = set(get_available_reporting_integrations())
    found = []
    for name in names:
        if name in ALONE:
            continue
        if name not in table:
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
            why = first_line(exc)
        return (f"report_to: mlflow cannot open its tracking store {uri} ({why}); give it one: {MLFLOW_FILE_STORE} "
                "(a folder of files), or MLFLOW_TRACKING_URI=http://<host>:5000 (a server), or pip install mlflow "
                "(the full package opens the default database)")
    return None


def first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
