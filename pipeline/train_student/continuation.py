"""``train.continue_from``: a new run that continues another from the end of its stable phase.

A run trained with the ``wsd`` schedule keeps ``stable/``, the complete checkpoint of the last step
of its stable phase (:mod:`pipeline.train_student.schedule`). Its learning rate up to that step does
not depend on the run's length, so a longer run with the same settings takes exactly the same steps
up to there. A continuation is such a longer run that starts from ``stable/`` instead of from step
0: weights, optimizer moments, the schedule's position, the random state and the data position
(the next packed sample after that step) are the source's, and it trains to its own
``train.max_steps``, counted from the first run's start, decaying at its own end. It therefore
equals one run of the new length. The source's decay steps are a branch the continuation does not
build on: it trains those samples again, at the stable learning rate, as the longer run would.

Refused, with every difference listed, where this would not hold: a source trained with the
``cosine`` schedule (its learning rate at every step depends on its total length), a source that
has no ``stable/`` yet, a recipe or data that differ from the source's in anything but the length
and the decay, and a length whose stable phase would end before the source's checkpoint. The
continuation's folder starts with the source's metrics up to that step, and
``continued_from.json`` names the source.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.runtime.config import MissingPathError
from pipeline.train_student.checkpoints import (
    METRICS_NAME,
    RUN_NAME,
    STABLE_NAME,
    RunMismatchError,
    checkpoint_step,
    is_complete_checkpoint,
    resume_differences,
)
from pipeline.train_student.config import CONTINUE_NEEDS_WSD
from pipeline.train_student.schedule import stable_end
from storage_schemas import write_json_atomic

CONTINUED_NAME = "continued_from.json"
# Recipe keys a continuation may change: the length, and the decay at its new end.
MAY_CHANGE = ("train.max_steps", "train.max_tokens", "train.lr_decay_share", "train.lr_decay_steps")


def continuation_checkpoint(job, identity: dict, student: dict | None, steps: int) -> str:
    """The checkpoint ``job`` (``train.continue_from`` set, ``steps`` optimizer steps in all) starts
    from: the source run's ``stable/``; :class:`RunMismatchError` where the continuation would not
    equal one run of ``steps`` steps (module docstring)."""
    source = Path(job.train.continue_from)
    run_file = source / RUN_NAME
    if not run_file.is_file():
        raise MissingPathError(f"train.continue_from: {source} is not a train-student run folder (no {RUN_NAME})")
    recorded = json.loads(run_file.read_text()).get("recipe", {}).get("train", {})
    if recorded.get("lr_scheduler", "cosine") != "wsd":
        raise RunMismatchError(f"cannot continue {source}: it was trained with the cosine schedule; "
                               + CONTINUE_NEEDS_WSD.replace("<run>", str(source)))
    stable = source / STABLE_NAME
    if not is_complete_checkpoint(stable):
        raise RunMismatchError(
            f"cannot continue {source}: it has no complete {STABLE_NAME}/ checkpoint (the end of its stable phase), so it "
            "has not reached that step yet. Resume it first (the same command that started it), then continue it.")
    differences = [d for d in resume_differences(job.recipe(), identity, stable, student)
                   if not d.startswith(tuple(f"recipe {key}:" for key in MAY_CHANGE))]
    if differences:
        raise RunMismatchError(
            f"cannot continue {source}: this run's settings differ from it in what the data or the schedule mean\n  "
            + "\n  ".join(differences)
            + f"\nA continuation may change only {', '.join(MAY_CHANGE)}; use the source's other settings, "
            "or start a new run (without train.continue_from).")
    step = checkpoint_step(str(stable))
    end = stable_end(job.train, steps)
    if end < step:
        raise RunMismatchError(
            f"cannot continue {source} to {steps} steps: train.max_steps counts from the first run's start, and a run of "
            f"{steps} steps would start its decay after step {end}, before the step {step} it continues from. Ask for "
            f"train.max_steps={shortest_continuation(job.train, step)} or more (or a shorter decay).")
    return str(stable)


def shortest_continuation(train, step: int) -> int:
    """The fewest steps in all whose stable phase reaches ``step``."""
    steps = step + 1
    while stable_end(train, steps) < step:
        steps += 1
    return steps


def start_from_source(continue_from: str, output_dir: str, checkpoint: str) -> None:
    """Begin the continuation's folder: the source's metrics (the metrics callback drops the lines
    after the checkpoint's step when training begins, as on a resume, so the folder reads as one run
    from step 1) and ``continued_from.json``. Main process only."""
    source = Path(continue_from) / METRICS_NAME
    if source.is_file():
        shutil.copyfile(source, Path(output_dir) / METRICS_NAME)
    write_json_atomic(Path(output_dir) / CONTINUED_NAME, {
        "run": str(Path(continue_from).resolve()), "step": checkpoint_step(checkpoint),
        "checkpoint": str(Path(checkpoint).resolve())})
