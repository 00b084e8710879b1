"""The run folder of a student run: which checkpoint to resume, when to refuse, what marks a
checkpoint or the final model complete (docs/METHOD.md §2.5).

A run folder holds ``run.json`` (the recipe and the student's identity), ``checkpoint-<step>/``
(the Trainer's files, ``data_identity.json`` and, written last, ``checkpoint_complete.json``),
``metrics.jsonl``, ``runs/`` (TensorBoard), ``stable/`` (a ``wsd`` run's checkpoint at the end of its
stable phase), ``final/`` (written under a temporary name and
renamed, so it is whole or absent) and ``summary.json``.

A checkpoint without its completion marker was being written when the process died: it is never
resumed from and is deleted when the folder is prepared. A resume is refused when the recipe or
the data identity differs from the checkpoint's, so a resumed run sees exactly the batches the
interrupted one would have seen. Both are compared by content, not location: the student by its
digests or hub id (:func:`pipeline.folders.provenance.model_identity`), the scored data by identity and shard
sha256 (:func:`storage_schemas.reader.data_identity_differences`), so a moved project resumes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from pipeline.runtime.config import MissingPathError, UserError, override
from pipeline.folders.output_folder import SetAside, recover, set_aside
from storage_schemas import iter_identity_differences, write_json_atomic
from storage_schemas.reader import data_identity_differences

log = logging.getLogger(__name__)

RUN_NAME = "run.json"
FINAL_NAME = "final"
STABLE_NAME = "stable"  # a wsd run's checkpoint at the end of its stable phase (pipeline.train_student.schedule)
METRICS_NAME = "metrics.jsonl"
DATA_IDENTITY_NAME = "data_identity.json"
COMPLETE_NAME = "checkpoint_complete.json"
SUMMARY_NAME = "summary.json"
TENSORBOARD_NAME = "runs"
# What overwrite=true replaces, said in every message that suggests it (the folder's other files stay).
OVERWRITE_DELETES = ("overwrite=true starts this run afresh: it deletes this run's checkpoints, stable/, final/, metrics.jsonl, "
                     "summary.json and TensorBoard logs (runs/), once the new run has saved its first checkpoint")


def is_run_entry(path: Path) -> bool:
    """An entry of a run folder that belongs to the run (what ``overwrite=true`` replaces)."""
    return (path.name.startswith("checkpoint-") or path.name in (FINAL_NAME, f".{FINAL_NAME}.tmp", STABLE_NAME,
                                                                   f".{STABLE_NAME}.tmp", TENSORBOARD_NAME,
                                                                   RUN_NAME, METRICS_NAME, SUMMARY_NAME))


class RunMismatchError(UserError, RuntimeError):
    """The run folder holds a run with another recipe or other data; resuming would not be exact."""


# ---- markers ---------------------------------------------------------------------------------


def is_complete_checkpoint(folder: str | os.PathLike) -> bool:
    return (Path(folder) / COMPLETE_NAME).is_file()


def mark_complete(folder: str | os.PathLike, identity: dict, step: int, guard_state: dict,
                  loss_sum: float | None = None) -> None:
    """Complete a checkpoint the Trainer saved: the scored data's identity, then the marker (the
    step, the non-finite guard's state and the sum of the run's per-step losses up to the step),
    written last."""
    write_data_identity(folder, identity)
    write_json_atomic(Path(folder) / COMPLETE_NAME, {"step": step, "nonfinite": guard_state,
                                                     **({} if loss_sum is None else {"loss_sum": loss_sum})})


def _marker(folder: str | os.PathLike | None) -> dict:
    path = Path(folder) / COMPLETE_NAME if folder else None
    return json.loads(path.read_text()) if path and path.is_file() else {}


def read_guard_state(folder: str | os.PathLike | None) -> dict | None:
    """The non-finite guard's state recorded in a complete checkpoint (None: none)."""
    return _marker(folder).get("nonfinite")


def read_loss_sum(folder: str | os.PathLike | None) -> float:
    """The sum of the run's per-step losses up to a complete checkpoint's step (0 without one), as
    its marker records it; for a checkpoint written before markers did, from its logged losses
    (each log's mean times the steps it covers: the steps after its last log are left out)."""
    recorded = _marker(folder).get("loss_sum")
    if recorded is not None or not folder:
        return float(recorded or 0.0)
    total, last = 0.0, 0
    for record in trainer_state(folder).get("log_history", []):
        if "loss" in record:
            total, last = total + record["loss"] * (record["step"] - last), record["step"]
    return total


def write_data_identity(folder: str | os.PathLike, identity: dict) -> None:
    write_json_atomic(Path(folder) / DATA_IDENTITY_NAME, identity)


def read_data_identity(folder: str | os.PathLike) -> dict | None:
    path = Path(folder) / DATA_IDENTITY_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def trainer_state(checkpoint: str | None) -> dict:
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text()) if checkpoint else {}


def checkpoint_step(checkpoint: str | None) -> int:
    return int(trainer_state(checkpoint).get("global_step", 0))


def recorded_summary(output_dir: str, checkpoint: str | None, steps: int) -> dict | None:
    """The ``summary.json`` of a run that is complete: its checkpoint (this run's newest) is at its
    last step, and ``final/`` and the summary are written, as the command leaves a run at its end.
    None otherwise (then a rerun writes what is missing)."""
    out = Path(output_dir)
    if checkpoint is None or checkpoint_step(checkpoint) < steps or not (out / FINAL_NAME).is_dir():
        return None
    try:
        return json.loads((out / SUMMARY_NAME).read_text())
    except (OSError, ValueError):
        return None


# ---- discovery and refusal -------------------------------------------------------------------


def checkpoint_folders(out: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """``(complete, incomplete)`` checkpoint folders of a run folder, by step."""
    out = Path(out)
    found = [p for p in out.glob("checkpoint-*") if p.is_dir() and p.name.split("-", 1)[1].isdigit()]
    found.sort(key=lambda p: int(p.name.split("-", 1)[1]))
    return [p for p in found if is_complete_checkpoint(p)], [p for p in found if not is_complete_checkpoint(p)]


def rerun_start(output_dir: str | os.PathLike) -> str:
    """Where the same command starts again after a stop, in words: the run folder's newest complete
    checkpoint (``train.resume=auto``), or the beginning."""
    complete = checkpoint_folders(output_dir)[0] if Path(output_dir).is_dir() else []
    if not complete:
        return "no checkpoint of this run yet: the same command starts it again"
    return f"the same command resumes from {complete[-1].name} ({complete[-1]})"


def resolve_checkpoint(output_dir: str, resume: str, overwrite: bool, recipe: dict, identity: dict,
                       student: dict | None = None) -> str | None:
    """The checkpoint to resume from: ``resume`` is ``auto`` (the newest complete one, if any),
    ``never`` (refuse a folder that has checkpoints) or a checkpoint folder; it must continue this
    run (``recipe``, data ``identity``, ``student`` identity), else :class:`RunMismatchError`."""
    out = Path(output_dir)
    complete, incomplete = checkpoint_folders(out) if out.is_dir() and not overwrite else ([], [])
    latest = str(complete[-1]) if complete else None
    if incomplete:
        log.warning("ignoring incomplete checkpoint(s) %s (the process died while saving)",
                    ", ".join(p.name for p in incomplete))
    if resume == "never":
        if latest:
            raise RunMismatchError(f"{out} already holds checkpoints ({Path(latest).name}); resume=never refuses "
                                   f"to train over them. Use resume=auto, another run name (run_name=<a new name>), "
                                   f"or {OVERWRITE_DELETES}.")
        return None
    checkpoint = latest if resume == "auto" else resume
    if checkpoint is None:
        return None
    if not Path(checkpoint).is_dir():
        raise MissingPathError(f"train.resume: checkpoint {checkpoint} not found")
    if not is_complete_checkpoint(checkpoint):
        raise RunMismatchError(f"cannot resume {checkpoint}: it is incomplete (no checkpoint_complete.json; the "
                               "process died while saving it). Resume from an earlier checkpoint.")
    problems = resume_differences(recipe, identity, Path(checkpoint), student)
    if problems:
        budget_only = all(p.startswith(("recipe train.max_steps:", "recipe train.max_tokens:")) for p in problems)
        raise RunMismatchError(
            f"cannot resume {checkpoint}: it belongs to a different run\n  " + "\n  ".join(problems) + "\n"
            + "\n".join(ways_on(Path(checkpoint), budget_only, recipe))
        )
    return str(checkpoint)


def ways_on(checkpoint: Path, longer: bool, recipe: dict | None = None) -> list[str]:
    """What a refused resume can do instead, one line each: with ``longer`` (only the length
    changed), a continuation of a ``wsd`` run (:mod:`pipeline.train_student.continuation`), else a new
    run from this one's final model; then another run name, or ``overwrite=true`` with what it deletes."""
    ways = []
    train = (recipe or {}).get("train") or {}
    if longer and train.get("lr_scheduler") == "wsd":
        length = next((f"train.{k}={train[k]}" for k in ("max_steps", "max_tokens") if train.get(k) is not None),
                      "train.max_steps=<the new total>")
        ways.append(f"To train further, continue it as a new run: {override('train.continue_from', checkpoint.parent)} "
                    f"run_name=<a new name> {length} (it goes on from the end of this run's stable phase with the "
                    "next unseen sample; docs/configuration.md, \"Training longer\").")
    elif longer:
        ways.append(f"To train further, start a new run from this one's model: "
                    f"{override('student.model', checkpoint.parent / FINAL_NAME)}"
                    " student.embedded=false run_name=<a new name> (or output_dir=<a new folder>; the learning-rate "
                    "schedule starts again; docs/configuration.md, \"Training longer\").")
    ways.append(f"Or use another run name (run_name=<a new name>); or {OVERWRITE_DELETES}.")
    return ways


def resume_differences(recipe: dict, identity: dict, checkpoint: Path, student: dict | None) -> list[str]:
    """How ``checkpoint``'s run (its folder's ``run.json`` and its data identity) differs from this
    run's ``recipe``, data ``identity`` and ``student``, one line each."""
    problems = []
    run_file = checkpoint.parent / RUN_NAME
    if run_file.is_file():
        record = json.loads(run_file.read_text())
        recorded, now = record.get("recipe", {}), json.loads(json.dumps(recipe))
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


# ---- preparing the folder and the final model ------------------------------------------------


def recover_run_folder(output_dir: str) -> None:
    """Put back a run that an ``overwrite=true`` killed before its first checkpoint had set aside
    (:func:`pipeline.folders.output_folder.recover`; main process only, holding the folder's lock)."""
    recover(output_dir, is_run_entry)


def prepare_run_folder(output_dir: str, overwrite: bool, checkpoint: str | None, recipe: dict,
                       student: dict | None = None) -> SetAside:
    """Create the folder, delete incomplete checkpoints (left by a process killed while saving)
    and record the recipe and the student's identity (main process only). With ``overwrite`` the
    run's entries (:func:`is_run_entry`) are first set aside, not deleted: the caller commits
    (deletes them) once the new run has saved a checkpoint, or restores them if it fails before."""
    out = Path(output_dir)
    aside = set_aside(out, is_run_entry) if overwrite else SetAside(out, is_run_entry)
    for path in checkpoint_folders(out)[1] if out.is_dir() else []:
        log.warning("deleting incomplete checkpoint %s", path)
        shutil.rmtree(path)
    out.mkdir(parents=True, exist_ok=True)
    if checkpoint is None or not (out / RUN_NAME).is_file():
        write_json_atomic(out / RUN_NAME, {"recipe": recipe, "student": student, "output_dir": str(out)})
    return aside


def save_final(trainer, output_dir: str, identity: dict, dtype) -> Path:
    """``save_pretrained`` model (cast to ``dtype`` in place: training is over) and tokenizer in
    ``<output_dir>/final``, with the data identity. Written as ``.final.tmp`` and renamed:
    ``final`` is whole or absent, even after a kill."""
    final = Path(output_dir) / FINAL_NAME
    tmp = final.with_name(f".{FINAL_NAME}.tmp")
    if trainer.is_world_process_zero() and tmp.exists():
        shutil.rmtree(tmp)
    trainer.model.to(dtype)
    trainer.save_model(str(tmp))  # model (safetensors) and the processing class (tokenizer)
    if trainer.is_world_process_zero():
        write_data_identity(tmp, identity)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    return final
