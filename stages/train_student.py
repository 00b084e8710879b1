"""Stage 2 entry point: ``python -m stages.train_student [hydra overrides]`` (``make train-student``).

Reads as a list of steps: compose and check the config (every problem at once, files included),
build the embedded student if it is the one chosen, check that a hub student can be had, train
(:mod:`pipeline.train_student.run`), print the summary. The defaults are the typed configs';
``conf/train_student.yaml`` only overrides them.
Several processes (``torchrun`` / ``accelerate launch``) run the same steps; only the first writes
the run folder and prints. The plan and the run (torch, transformers' Trainer) are imported in
:func:`main`, after the check: a mistyped key is refused within seconds.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from pipeline.embedded.tiny_student import TinyStudentSpec, ensure_tiny_student, tiny_student_dir
from pipeline.folders.output_folder import check_writable
from pipeline.train_student.checkpoints import TENSORBOARD_NAME
from pipeline.train_student.config import (
    TrainJobConfig,
    check_student_source,
    config_defaults,
    launch_problems,
    run_names,
    train_job_config,
)
from stages.common import (
    ConfigError,
    duration,
    entry_point,
    plain,
    quiet_libraries,
    raise_if,
    same_path,
    show_summary,
    store_row,
    with_problems,
)
from storage_schemas import write_json_atomic

if TYPE_CHECKING:  # the plan and the run import torch and transformers: main imports them after the check
    from pipeline.train_student.plan import TrainPlan
    from pipeline.train_student.run import TrainSummary

log = logging.getLogger("train_student")


def register_run_name_resolvers() -> None:
    """``${run_corpus:${data.corpus},${data.teacher},${data.mixture},${data.folders}}`` and
    ``${run_teacher:...}`` (the same arguments; ``null`` for a config without a mixture): the
    folder parts :func:`run_names` gives, for conf/train_student.yaml and conf/export_student.yaml."""
    OmegaConf.register_new_resolver("run_corpus", lambda *a: run_names(*a)[0], replace=True)
    OmegaConf.register_new_resolver("run_teacher", lambda *a: run_names(*a)[1], replace=True)


register_run_name_resolvers()  # ${run_corpus:...} and ${run_teacher:...} in conf/train_student.yaml


def job_config(cfg: DictConfig, check_files: bool = False) -> TrainJobConfig:
    """The typed job; every problem in the config is reported at once (:func:`train_job_config`),
    with ``check_files`` also missing scored folders, a missing local student and trackers this machine lacks."""
    return with_problems(embedded_problems(cfg), lambda: train_job_config(plain(cfg), check_files=check_files,
                                                                           check_installed=check_files))


def embedded_problems(cfg: DictConfig) -> list[str]:
    """A ``student.model`` given while the embedded tiny student is chosen (it would be ignored)."""
    s = cfg.get("student") or {}
    if not s.get("embedded") or not s.get("build"):
        return []
    built = tiny_student_dir(cfg.artifacts_dir, s.build.corpus_docs, s.build.seed)
    if s.get("model") and not same_path(s.model, built):
        return [f"student.model: {s.model} is not the embedded tiny student (built at {built}); to train that "
                "model, add student.embedded=false"]
    return []


def build_embedded(cfg: DictConfig) -> None:
    """Build (or find cached) the tiny student when the config uses it."""
    if not cfg.student.get("embedded"):
        return

    b = cfg.student.build
    artifacts = to_absolute_path(cfg.artifacts_dir)
    Path(artifacts).mkdir(parents=True, exist_ok=True)
    with FileLock(str(Path(artifacts) / ".tiny-student.lock")):  # several processes of one launch
        built = ensure_tiny_student(artifacts, corpus_docs=b.corpus_docs, seed=b.seed,
                                    spec=TinyStudentSpec(vocab_size=b.vocab_size, seed=b.seed))
    if Path(built).resolve() != Path(to_absolute_path(cfg.student.model)).resolve():
        raise ConfigError(f"student.model {cfg.student.model} is not where the tiny student is built ({built})")


def check_folders(cfg: DictConfig, output_dir: str | None, cache_dir: str | None) -> None:
    """One line each (:func:`pipeline.folders.output_folder.check_writable`) for a folder the command
    would write that cannot be made or written: the run's (or export's) folder, the length cache and,
    for the embedded student, ``artifacts_dir``. On global rank 0 only: the ranks would race making
    and removing the same probe, and the launcher ends the others when rank 0 stops."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    check_writable({"output_dir": output_dir, "data.cache_dir": cache_dir,
                    "artifacts_dir": to_absolute_path(cfg.artifacts_dir) if cfg.student.get("embedded") else None})


def print_summary(s: TrainSummary, console: Console | None = None) -> None:
    d, last = s.data, s.last_log
    skipped = d["shards_skipped"]
    rows = [
        ("run", started(s)),
        ("data", f"{teachers(d)}: {d['shards_used']} shards, {d['n_documents']:,} documents, "
                 f"{d['student_tokens']:,} student tokens ({d['n_tokens']:,} stream tokens: BOS/EOS and every pass), "
                 f"{d['n_samples']:,} samples of {d['seq_len']}"),
        ("skipped", f"{len(skipped)} shard(s): " + ", ".join(Path(b['file']).name for b in skipped) if skipped
         else f"no shard; {d['n_empty']} empty document(s) left out"),
        ("alignment", f"{d['alignment']} ({d['aggregate']})"),
        ("steps", f"{s.steps} ({s.tokens_per_step:,} tokens each)" + (
            f"; train_loss {s.train_loss:.4g}, the mean over all {s.steps}" if s.train_loss is not None else "")),
        ("throughput", f"{s.tokens_per_s:,.0f} tokens/s over {s.seconds:.1f}s (this run, set-up included)"),
        ("non-finite", f"{len(s.nonfinite_steps)} step(s) skipped: " + ", ".join(map(str, s.nonfinite_steps[:20]))
         + (" ..." if len(s.nonfinite_steps) > 20 else "") if s.nonfinite_steps else "no step skipped"),
    ]
    if d.get("export"):
        rows.insert(2, ("export", f"{d['export']} (its rows as exported: nothing tokenized or aligned)"))
    if d.get("mixture"):  # the realised share of each corpus over the samples trained
        rows.insert(2, ("mixture", "; ".join(
            f"{m['name']} {m['share']:.3f} of the samples (weight {m['weight']:.3f}), {m['samples']:,} samples, "
            f"{m['passes']:.2f} of {m['epochs']} pass(es)" for m in d["mixture"])))
    rows += store_row(s.store_calls)
    if last:
        rows.append(("last log", ", ".join(f"{k} {last[k]:.4g}" for k in (
            "loss_kept", "loss_all", "kept_fraction", "mapped_fraction", "excess_loss", "learning_rate") if k in last)))
    if s.evaluations:
        rows.append(("held-out", ", ".join(f"step {r['step']}: {r['eval_bits_per_byte']:.4f}" for r in s.evaluations[-6:])
                     + " bits/byte" + (f" (last 6 of {len(s.evaluations)})" if len(s.evaluations) > 6 else "")))
    lines = [
        ("the run folder", str(s.output_dir)),
        ("the final model (AutoModelForCausalLM.from_pretrained)", str(s.final_model)),
        ("metrics, one JSON line per log", str(Path(s.output_dir) / "metrics.jsonl")),
    ]
    if "tensorboard" in s.trackers or list(s.trackers) == ["all"]:  # train.report_to
        lines.append(("TensorBoard", f"tensorboard --logdir {shlex.quote(str(Path(s.output_dir) / TENSORBOARD_NAME))}"))
    show_summary("train-student", rows, lines, console)


def teachers(d: dict) -> str:
    """The summary's teachers: one, or several with how their losses combine."""
    names = d.get("teachers") or [d["teacher"]]
    if len(names) == 1:
        return f"teacher {names[0]}"
    return f"{len(names)} teachers, {', '.join(map(str, names))} (loss.combine={d.get('combine')})"


def started(s: TrainSummary) -> str:
    """Where the run started: from the start, a checkpoint of its own, or another run's (a continuation)."""
    if not s.resumed_from:
        return "from the start"
    start = Path(s.resumed_from)
    if start.parent.resolve() == Path(s.output_dir).resolve():
        return f"resumed from {start.name}"
    return f"continued from {start.parent} ({start.name}/, the end of its stable phase)"


def print_plan(p: TrainPlan, job: TrainJobConfig, measured: dict | None = None, why: str = "",
               console: Console | None = None) -> None:
    tokens = (f"{p.student_tokens:,} (the length cache holds every shard)" if p.counted else
              f"about {p.student_tokens:,} ± {p.student_tokens_error:.1%} (95%; {'; '.join(p.notes)})")
    asked = f"{p.steps:,} asked for" if p.steps is not None else "one pass (train.max_steps and max_tokens unset)"
    rows = [
        ("scored data", f"{p.folders} folder(s), {p.shards:,} shards, {p.documents:,} documents, "
                        f"{p.teacher_tokens:,} teacher tokens"),
        ("student tokens", tokens),
        ("samples", f"{p.samples:,} of {job.student.seq_len:,} tokens ({p.stream_tokens:,} stream tokens, "
                    f"BOS/EOS and {job.data.epochs} pass(es) included)"),
        ("steps", f"{p.steps_available:,} available of {p.samples_per_step:,} samples ({p.tokens_per_step:,} tokens) "
                  f"each; {asked}"),
    ]
    if p.count_seconds is not None:
        rows.append(("first token count", f"about {p.count_seconds / 60:,.1f} min with data.length_workers="
                                          f"{job.data.length_workers} (this machine's speed on the sample)"))
    rows.append(("wall time", wall_time(p, measured, why)))
    show_summary("train-student: the bill before the run (nothing was trained)", rows, [
        ("run it", "the same command without plan=true")], console)


def wall_time(p: TrainPlan, measured: dict | None, why: str) -> str:
    """The training's wall time from the student's measured step (:func:`measure_steps`), or why there is none."""
    steps = p.steps if p.steps is not None else p.steps_available
    if not measured:
        return f"not measured ({why}); plan_measure=true times a few steps of the student here"
    m = measured
    return (f"about {duration(steps * m['step_s'])} for {steps:,} steps at {m['step_s']:.3g} s per step, measured over "
            f"{m['steps']} steps of the student on {m['device']} ({m['precision']}, {m['threads']} thread(s)) after one "
            "untimed, on random tokens: the token count, data loading, evaluation and checkpoints not included; " + why)


@entry_point("train_student", config_defaults(), check=job_config)
def main(cfg: DictConfig) -> None:
    from pipeline.train_student.plan import measure_decision, measure_steps, plan_training  # heavy: after the check
    from pipeline.train_student.run import run_training  # heavy: torch, transformers' Trainer; after the check

    quiet_libraries()
    job = job_config(cfg, check_files=True)
    raise_if(launch_problems())  # before the embedded student is built
    check_folders(cfg, None if cfg.get("plan") else job.output_dir, job.data.cache_dir)  # plan=true writes no run
    build_embedded(cfg)
    check_student_source(job.student)  # one clear line, before any work, if a hub student cannot be had
    if cfg.get("plan"):  # the bill only: the manifests, a sample of documents, the student's tokenizer
        world = int(os.environ.get("WORLD_SIZE", "1"))
        plan = plan_training(job, world_size=world)
        measure, why = measure_decision(job, cfg.get("plan_measure"), world)
        print_plan(plan, job, measure_steps(job) if measure else None, why)
        return
    summary = run_training(job)
    if not _is_main_process():
        return
    if summary.already_complete:  # its files stay as they were, summary.json included
        print(f"train-student: {summary.output_dir} is already complete ({summary.steps} steps, its final model in "
              f"{summary.final_model}); nothing was trained or written (overwrite=true trains it again)")
        return
    print_summary(summary)
    record = {k: v for k, v in summary.__dict__.items() if k != "already_complete"}
    record = json.loads(json.dumps({**record, "tokens_per_s": summary.tokens_per_s}, default=str))
    write_json_atomic(Path(job.output_dir) / "summary.json", record)


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


if __name__ == "__main__":
    sys.exit(main())
