"""Run the experiment's student arms: train each (stage 2's :func:`run_training`), then evaluate it.

Runs go to a pool of processes (one CPU thread each). A finished run leaves ``repro_result.json``
in its folder, keyed by its recipe; a rerun with the same recipe reads it instead of training
again, so an interrupted ``make repro`` continues where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from pipeline.train_student.config import TrainJobConfig

log = logging.getLogger(__name__)
RESULT = "repro_result.json"
EVALUATION = "bits-per-byte+answers"  # names what a result holds: a new measure set invalidates cached results


@dataclass(frozen=True)
class RunTask:
    arm: str
    seed: int
    teacher: str
    student: str
    corpus: str  # the student corpus variant's name
    noise_share: float
    job: TrainJobConfig
    held_out: tuple[str, ...]
    completion_seed: int
    n_completions: int
    window: int

    def key(self) -> str:
        recipe = {"job": asdict(self.job), "held_out": hashlib.sha256("\x00".join(self.held_out).encode()).hexdigest(),
                  "completion_seed": self.completion_seed, "n_completions": self.n_completions, "window": self.window,
                  "measures": EVALUATION}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_result(task: RunTask) -> dict | None:
    path = Path(task.job.output_dir) / RESULT
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if result.get("key") == task.key() else None


def train_and_evaluate(task: RunTask) -> dict:
    """One arm and seed: train (from scratch: the run folder is reset) and evaluate the final model."""
    from pipeline.train_student.run import run_training
    from repro.evaluate import completion_items, evaluate_model
    from storage_schemas import write_json_atomic

    hit = cached_result(task)
    if hit is not None:
        return hit
    out = Path(task.job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.log", "w") as log_file, contextlib.redirect_stdout(log_file):
        summary = run_training(task.job)  # the trainer's per-step log lines go to the run's log file
        items = completion_items(task.n_completions, task.completion_seed)
        scores = evaluate_model(summary.final_model, list(task.held_out), items, task.window)
    result = {
        "key": task.key(), "arm": task.arm, "seed": task.seed, "teacher": task.teacher, "student": task.student,
        "corpus": task.corpus, "noise_share": task.noise_share, "mode": task.job.selection.mode,
        "ratio": 1.0 if task.job.selection.mode == "cpt" else task.job.selection.ratio,
        "scored_folder": task.job.data.folders[0], **several_teachers(task.job), "steps": summary.steps, "tokens_trained": summary.tokens_trained,
        "train_seconds": round(summary.seconds, 1), "last_log": summary.last_log, **scores,
    }
    write_json_atomic(out / RESULT, result)
    return result


def several_teachers(job: TrainJobConfig) -> dict:
    """A several-teacher run's folders (in ``data.folders`` order) and how their losses combine;
    nothing for a one-folder run, so its result reads as before."""
    folders = list(job.data.folders)
    if len(folders) < 2:
        return {}
    return {"scored_folders": folders, "combine": job.alignment.combine,
            "teacher_weights": None if job.alignment.teacher_weights is None else list(job.alignment.teacher_weights)}


def _init_worker() -> None:
    import torch
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*pin_memory.*")


def run_pool(calls: dict[int, tuple], parallel: int, describe, on_result=None) -> dict[int, dict]:
    """``fn(*args)`` for each ``index: (fn, *args)`` of ``calls`` in spawned processes, ``parallel`` at
    a time, each with one torch thread (:func:`_init_worker`); results by index. ``on_result(index,
    result, done_count)`` as each finishes; a failure raises, naming ``describe(index)``."""
    results: dict[int, dict] = {}
    if not calls:
        return results
    with ProcessPoolExecutor(max_workers=max(1, parallel), mp_context=get_context("spawn"),
                             initializer=_init_worker) as pool:
        futures = {pool.submit(call[0], *call[1:]): i for i, call in calls.items()}
        for n, future in enumerate(as_completed(futures), start=1):
            i = futures[future]
            try:
                results[i] = future.result()
            except Exception as exc:
                raise RuntimeError(f"{describe(i)} failed: {exc}") from exc
            if on_result:
                on_result(i, results[i], n)
    return results


def run_tasks(tasks: list[RunTask], parallel: int, on_result=None, train: bool = True) -> list[dict]:
    """Every task's result (cached ones first, without starting a process), in task order;
    ``train=False``: only the cached ones."""
    results: dict[int, dict] = {}
    pending = []
    for i, task in enumerate(tasks):
        hit = cached_result(task)
        if hit is not None:
            results[i] = hit
            if on_result:
                on_result(hit, cached=True)
        else:
            pending.append(i)
    if pending and train:
        results.update(run_pool(
            {i: (train_and_evaluate, tasks[i]) for i in pending}, parallel,
            lambda i: f"repro run {tasks[i].arm} seed {tasks[i].seed} ({tasks[i].job.output_dir})",
            (lambda i, result, n: on_result(result, cached=False)) if on_result else None))
    return [results[i] for i in range(len(tasks)) if i in results]
