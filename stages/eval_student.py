"""Evaluation entry point: ``python -m stages.eval_student checkpoint=<dir or hub id> [key=value ...]``
(``make eval-student ARGS="..."``). Configuration: ``conf/eval_student.yaml``.

Steps: compose and check the config (every problem at once: missing task files, held-out text files,
a scored folder that is not a dataset, shards the run trained on), read the task files, exemplars
and held-out documents, load the checkpoint, generate greedily with few-shot chain-of-thought
prompts and score, measure held-out bits per byte, write ``eval.json``, ``samples.jsonl`` and
``eval.md`` to ``<eval_root>/<label>`` (or ``out_dir``), print the tables. A missing or malformed
input file ends with one line naming the file and line, and exit status 2.
"""

from __future__ import annotations

import re
import sys
from dataclasses import fields, replace
from pathlib import Path

from hydra.utils import to_absolute_path
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from pipeline.runtime.config import defaults
from pipeline.evaluation.generation import GenerationConfig, GenerationSettings
from pipeline.evaluation.held_out import BitsPerByteSettings, resolve
from pipeline.evaluation.run import (
    EvalJobConfig,
    EvalSettings,
    TaskInput,
    bits_per_byte_lines,
    identity_summary,
    run_evaluation,
)
from pipeline.evaluation.tasks import TASKS
from pipeline.folders.model_source import local_model_problem
from pipeline.folders.output_folder import check_writable, overlap_problem
from stages.common import build, entry_point, plain, quiet_libraries, raise_if
from storage_schemas import filesystem as sfs

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def job_config(cfg: DictConfig) -> EvalJobConfig:
    """The typed job; every problem of the configuration is reported at once."""
    problems: list[str] = []
    values = plain(cfg)
    settings = build(EvalSettings, values, "", problems, drop=("hydra",))
    checkpoint = _checkpoint(values.get("checkpoint"), problems)  # from the values as written: every problem at once
    held_out_settings = settings.bits_per_byte if settings else build(
        BitsPerByteSettings, values.get("bits_per_byte"), "bits_per_byte", [])  # its own problems are listed already
    held_out = resolve(_absolute(held_out_settings), checkpoint, problems) if held_out_settings else None
    tasks = _task_inputs(values, problems, bits_per_byte=bool(held_out_settings and held_out_settings.asked))
    raise_if(problems)
    generation = GenerationConfig(**{f.name: getattr(settings.generation, f.name) for f in fields(GenerationSettings)},
                                  model=checkpoint, revision=settings.revision)
    label = settings.label or run_name(checkpoint)
    out_dir = to_absolute_path(settings.out_dir) if settings.out_dir else to_absolute_path(str(Path(settings.eval_root) / label))
    inputs = [("checkpoint", checkpoint), ("bits_per_byte.scored", held_out.scored if held_out else None),
              *(("bits_per_byte.texts", t) for t in (held_out.text_files if held_out else ())),
              *((f"data_files.{t.name}", t.data_file) for t in tasks)]
    raise_if([p for p in [overlap_problem(out_dir, inputs, setting="out_dir")] if p])
    return EvalJobConfig(generation=generation, tasks=tasks, output_dir=out_dir, num_fewshot=settings.num_fewshot,
                         fewshot_source=settings.fewshot_source, limit=settings.limit, label=label,
                         progress=settings.progress, bits_per_byte=held_out, overwrite=settings.overwrite)


def _checkpoint(checkpoint: str | None, problems: list[str]) -> str:
    """A local folder becomes an absolute path; anything shaped like a hub id stays as it is."""
    if not checkpoint:
        problems.append("checkpoint: required (a local checkpoint folder or a hub id)")
        return ""
    local = Path(to_absolute_path(str(checkpoint)))
    if local.is_dir():
        problem = local_model_problem("checkpoint", str(local))  # a run folder instead of its final/, a dataset
        if problem:
            problems.append(problem)
        return str(local)
    if not HUB_ID.fullmatch(str(checkpoint)):
        problems.append(f"checkpoint: {checkpoint} is not a folder (and not a hub id)")
    return str(checkpoint)


def _absolute(held_out: BitsPerByteSettings) -> BitsPerByteSettings:
    """Local paths made absolute (Hydra may change the working folder); object-store URIs kept."""
    scored = held_out.scored
    return replace(held_out, texts=tuple(to_absolute_path(str(t)) for t in held_out.texts),
                   scored=scored if scored is None or sfs.is_remote(scored) else to_absolute_path(str(scored)))


def _task_inputs(values: dict, problems: list[str], bits_per_byte: bool) -> list[TaskInput]:
    names = [str(t) for t in values.get("tasks") or []]
    data_files, fewshot_files = values.get("data_files") or {}, values.get("fewshot_files") or {}
    unknown = [t for t in names if t not in TASKS]
    if not names and not bits_per_byte:
        problems.append("tasks: give at least one task, or held-out text for bits per byte "
                        "(bits_per_byte.texts=[...] or bits_per_byte.scored=<folder>)")
    if unknown:
        problems.append(f"tasks: unknown {', '.join(map(str, unknown))} (known: {', '.join(TASKS)})")
    if len(set(names)) != len(names):
        problems.append(f"tasks: {names} repeats a task")
    inputs = []
    for name in (t for t in dict.fromkeys(names) if t in TASKS):
        data = _task_file(data_files.get(name), values.get("data_dir"), name)
        fewshot = _task_file(fewshot_files.get(name), values.get("fewshot_dir"), name)
        if data is None:
            problems.append(f"{name}: no task file (data_files.{name}=<file.jsonl> or data_dir=<dir with {name}.jsonl>)")
        elif not Path(data).is_file():
            problems.append(f"{name}: task file not found: {data}")
        if fewshot is not None and not Path(fewshot).is_file():
            if fewshot_files.get(name) is not None:
                problems.append(f"{name}: few-shot file not found: {fewshot}")
            else:
                fewshot = None  # fewshot_dir need not hold every task
        inputs.append(TaskInput(name=name, data_file=data or "", fewshot_file=fewshot))
    return inputs


def _task_file(explicit: str | None, folder: str | None, task: str) -> str | None:
    if explicit:
        return to_absolute_path(explicit)
    return to_absolute_path(str(Path(folder) / f"{task}.jsonl")) if folder else None


def run_name(checkpoint: str) -> str:
    """A folder name for a checkpoint: ``<run>-final`` / ``<run>-checkpoint-N`` for train-student's
    folders, the folder name otherwise, ``owner--name`` for a hub id."""
    path = Path(checkpoint)
    if path.is_dir():
        last = path.name
        return f"{path.parent.name}-{last}" if last == "final" or last.startswith("checkpoint-") else last
    return checkpoint.replace("/", "--")


def print_result(record: dict, out_dir: str) -> None:
    table = Table(title=f"eval-student: {record['label']}", title_justify="left")
    for col in ("task", "shots", "n", "correct", "accuracy", "no answer"):
        table.add_column(col, justify="left" if col == "task" else "right")
    for name, r in record["tasks"].items():
        table.add_row(name, str(r["comparable"]["num_fewshot"]), str(r["n"]), str(r["correct"]),
                      f"{100 * r['accuracy']:.1f}%", str(r["no_answer"]))
    console = Console()
    if record["tasks"]:
        console.print(table)
    if "bits_per_byte" in record:
        console.print("\n".join(bits_per_byte_lines(record["bits_per_byte"])), markup=False, highlight=False,
                      soft_wrap=True)
    s = record["settings"]
    console.print(f"checkpoint {record['checkpoint']} ({identity_summary(record['identity'])}); {s['backend']} on "
                  f"{s['device']}, {s['dtype']}; {record['truncated_prompts']} prompt(s) cut to fit the context; "
                  f"{record['seconds']:.1f}s", markup=False, highlight=False, soft_wrap=True)
    # paths whole on their line (copyable), whatever the terminal's width
    console.print(f"Wrote {Path(out_dir) / 'eval.json'}, eval.md, samples.jsonl", markup=False, highlight=False,
                  soft_wrap=True)


@entry_point("eval_student", defaults(EvalSettings), check=job_config)
def main(cfg: DictConfig) -> None:
    quiet_libraries()
    job = job_config(cfg)
    check_writable({"out_dir" if cfg.get("out_dir") else "eval_root": job.output_dir})  # before the checkpoint loads
    record = run_evaluation(job)
    print_result(record, job.output_dir)


if __name__ == "__main__":
    sys.exit(main())
