"""Experiment trackers: ``train.report_to`` names the Hugging Face Trainer's own integrations
(``tensorboard``, ``wandb``, ``mlflow``, ...), which receive every log the run writes to
``metrics.jsonl``: the Trainer's figures and the guided loss's own statistics
(:class:`pipeline.train_student.trainer.GuidedTrainer`). Each integration is configured as its
project documents it, by environment (``WANDB_PROJECT``, ``WANDB_MODE=offline``,
``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ...); the tracker's run is named after the run
folder, and it ends with the training (:class:`FinishWandbRun`). W&B and MLflow come with the
``trackers`` extra.

:func:`tracker_problems` checks the names before any work: an integration the Trainer does not
have (with the nearest name) and one whose package is not installed (with how to install it).
"""

from __future__ import annotations

import sys
from typing import Sequence

from transformers import TrainerCallback
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

from pipeline.config import nearest

ALONE = ("all", "none")  # the Trainer's words for every installed integration, and for none
INSTALL = {"wandb": "pip install 'vocagno[trackers]'", "mlflow": "pip install 'vocagno[trackers]'"}


def tracker_problems(report_to: Sequence[str]) -> list[str]:
    """``report_to: ...`` lines for names the Trainer does not know or cannot load (empty: fine)."""
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
    return found


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
