"""One evaluation: a checkpoint on several tasks, written as ``eval.json``, ``samples.jsonl`` and
``eval.md`` in the output folder.

Steps: read every task's records and exemplars (any bad input fails before a model loads), load the
model once, per task build the prompts, generate, cut at the stop sequence, extract and score, then
write the results. ``eval.json`` records what makes two evaluations comparable (per task: the data
file's sha256, the number of problems, the shot count, the exemplars' sha256, the prompt template,
``max_new_tokens``) and the checkpoint's identity (sha256 of its config and weights files for a
local folder; hub id and revision otherwise).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import ConfigError, MissingPathError, check_at_least, check_choice
from pipeline.evaluation.generation import (
    GenerationConfig,
    GenerationSettings,
    Generator,
    make_generator,
)
from pipeline.evaluation.tasks import (
    TASKS,
    Exemplar,
    Record,
    TaskSpec,
    build_prompt,
    fewshot_prefix,
    lm_eval_exemplars,
    load_exemplars,
    load_records,
    score,
    sha256_text,
)
from pipeline.provenance import WEIGHT_SUFFIXES, code_version, digest_files
from storage_schemas import file_sha256, write_json_atomic

log = logging.getLogger(__name__)

EVAL_FORMAT = 1
FEWSHOT_SOURCES = ("auto", "file", "lm_eval")


@dataclass(frozen=True)
class TaskInput:
    name: str
    data_file: str
    fewshot_file: str | None = None


def _per_task() -> dict[str, str | None]:
    return {name: None for name in TASKS}


@dataclass(frozen=True)
class EvalSettings:
    """``make eval-student``'s settings as ``conf/eval_student.yaml`` lays them out (it overrides
    them); :class:`EvalJobConfig` is what the run gets. Task files are local JSONL,
    ``{"question": ..., "answer": ...}`` per line."""

    checkpoint: str | None = None  # a local checkpoint folder (train-student's final/ or checkpoint-N/) or a hub id
    revision: str | None = None  # hub revision
    label: str | None = None  # the name shown by make compare (None: derived from the checkpoint)
    tasks: tuple[str, ...] = ("gsm8k",)
    data_dir: str | None = None  # <data_dir>/<task>.jsonl for every task without a file in data_files
    data_files: dict[str, str | None] = field(default_factory=_per_task)  # one file per task; overrides data_dir
    num_fewshot: int | None = None  # None: each task's default (8 for GSM8K-like, 4 for the others); 0: zero-shot
    fewshot_source: str = "auto"  # auto: the few-shot file if given, else lm-evaluation-harness's exemplars | file | lm_eval
    fewshot_dir: str | None = None  # <fewshot_dir>/<task>.jsonl, same form as the task files
    fewshot_files: dict[str, str | None] = field(default_factory=_per_task)  # overrides fewshot_dir
    limit: int | None = None  # evaluate the first N problems of each task (None: all)
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    eval_root: str = "outputs/eval"
    out_dir: str | None = None  # None: <eval_root>/<label or a name derived from the checkpoint>
    progress: bool = True

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "fewshot_source", self.fewshot_source, FEWSHOT_SOURCES)
        check_at_least(found, "num_fewshot", self.num_fewshot, 0)
        check_at_least(found, "limit", self.limit, 1)
        for key in ("data_files", "fewshot_files"):
            unknown = sorted(set(getattr(self, key)) - set(TASKS))
            if unknown:
                found.append(f"{key}: unknown task(s) {', '.join(unknown)} (known: {', '.join(TASKS)})")
        return found


@dataclass(frozen=True)
class EvalJobConfig:
    generation: GenerationConfig
    tasks: list[TaskInput]
    output_dir: str
    num_fewshot: int | None = None  # None: each task's default
    fewshot_source: str = "auto"  # auto (the file if given, else lm_eval's standard exemplars) | file | lm_eval
    limit: int | None = None  # first N problems of each task
    label: str | None = None
    progress: bool = True


@dataclass
class PreparedTask:
    spec: TaskSpec
    input: TaskInput
    records: list[Record]
    shots: list[Exemplar]
    fewshot_source: str  # file:<path> | lm_eval:<name> | none

    def prefix(self) -> str:
        return fewshot_prefix(self.spec, self.shots)

    def settings(self, max_new_tokens: int) -> dict:
        """What must match for two results on this task to be comparable."""
        return {
            "data_sha256": file_sha256(self.input.data_file),
            "n": len(self.records),
            "num_fewshot": len(self.shots),
            "fewshot_sha256": sha256_text(self.prefix()),
            "template": self.spec.template.name,
            "stop": list(self.spec.template.stop),
            "answer_type": self.spec.answer_type,
            "max_new_tokens": max_new_tokens,
        }


def prepare_task(job: EvalJobConfig, task: TaskInput) -> PreparedTask:
    spec = TASKS[task.name]
    records = load_records(task.data_file, spec, limit=job.limit)
    k = spec.num_fewshot if job.num_fewshot is None else job.num_fewshot
    shots, source = choose_exemplars(job.fewshot_source, spec, task, k)
    return PreparedTask(spec=spec, input=task, records=records, shots=shots, fewshot_source=source)


def choose_exemplars(source: str, spec: TaskSpec, task: TaskInput, k: int) -> tuple[list[Exemplar], str]:
    """The first ``k`` exemplars of the few-shot file, or of lm-evaluation-harness's standard set."""
    if k == 0:
        return [], "none"
    if task.fewshot_file and source in ("auto", "file"):
        shots, origin = load_exemplars(task.fewshot_file, spec), f"file:{task.fewshot_file}"
    elif source == "file":
        raise MissingPathError(f"{task.name}: fewshot_source=file but no few-shot file "
                                f"(fewshot_dir=<dir with {task.name}.jsonl> or fewshot_files.{task.name}=<file>)")
    elif spec.lm_eval_exemplars is None:
        raise ConfigError(f"{task.name}: {k}-shot needs a few-shot file (fewshot_dir= or fewshot_files.{task.name}=): "
                         "lm-evaluation-harness has no chain-of-thought exemplars for it; or num_fewshot=0")
    else:
        shots, origin = lm_eval_exemplars(spec.lm_eval_exemplars), f"lm_eval:{spec.lm_eval_exemplars}"
    if len(shots) < k:
        raise ConfigError(f"{task.name}: num_fewshot={k} but {origin} has {len(shots)} exemplars")
    return shots[:k], origin


def run_evaluation(job: EvalJobConfig, generator: Generator | None = None) -> dict:
    """Evaluate and write the output folder; returns the ``eval.json`` record."""
    t0 = time.perf_counter()
    prepared = [prepare_task(job, t) for t in job.tasks]
    identity = checkpoint_identity(job.generation.model, job.generation.revision)
    generator = generator or make_generator(job.generation)
    results, samples = {}, []
    for task in prepared:
        result, task_samples = evaluate_task(task, generator, job.generation.max_new_tokens, job.progress)
        results[task.spec.name] = result
        samples += task_samples
    record = {
        "format": EVAL_FORMAT,
        "label": job.label,
        "checkpoint": job.generation.model,
        "identity": identity,
        "settings": {**generator.describe(), "batch_size": job.generation.batch_size, "seed": job.generation.seed,
                     "max_new_tokens": job.generation.max_new_tokens, "limit": job.limit},
        "tasks": results,
        "truncated_prompts": generator.truncated_prompts,
        "seconds": round(time.perf_counter() - t0, 2),
        "code_version": code_version(),
    }
    write_outputs(Path(job.output_dir), record, samples)
    return record


def evaluate_task(task: PreparedTask, generator: Generator, max_new_tokens: int, progress: bool) -> tuple[dict, list[dict]]:
    spec, prefix = task.spec, task.prefix()
    prompts = [build_prompt(spec, prefix, r) for r in task.records]
    t0 = time.perf_counter()
    if progress:
        log.info("%s: %d problems, %d-shot", spec.name, len(prompts), len(task.shots))
    generations = generator.generate(prompts, spec.template.stop)
    samples = []
    for i, (r, text) in enumerate(zip(task.records, generations)):
        extracted, correct = score(spec, text, r)
        samples.append({"task": spec.name, "index": i, "line": r.line, "generation": text, "extracted": extracted,
                        "gold": r.gold, "correct": correct})
    n, correct = len(samples), sum(s["correct"] for s in samples)
    result = {
        "n": n, "correct": correct, "accuracy": correct / n, "no_answer": sum(s["extracted"] is None for s in samples),
        "data_file": str(task.input.data_file), "fewshot_source": task.fewshot_source,
        "seconds": round(time.perf_counter() - t0, 2), "example_prompt": prompts[0],
        "comparable": task.settings(max_new_tokens),
    }
    return result, samples


def write_outputs(out: Path, record: dict, samples: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".samples.jsonl.tmp-{os.getpid()}"
    with tmp.open("w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    os.replace(tmp, out / "samples.jsonl")
    (out / "eval.md").write_text(markdown_report(record), encoding="utf-8")
    write_json_atomic(out / "eval.json", record)  # last: its presence means the folder is complete


def markdown_report(record: dict) -> str:
    s, ident = record["settings"], record["identity"]
    lines = [
        f"# Evaluation: {record['label'] or record['checkpoint']}",
        "",
        f"- checkpoint: `{record['checkpoint']}` ({identity_summary(ident)})",
        f"- generation: {s['backend']} on {s['device']}, {s['dtype']}, greedy, max_new_tokens {s['max_new_tokens']}, "
        f"batch size {s['batch_size']}",
        f"- prompts cut to fit the context: {record['truncated_prompts']}",
        "",
        "| task | shots | n | correct | accuracy | no answer |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in record["tasks"].items():
        lines.append(f"| {name} | {r['comparable']['num_fewshot']} | {r['n']} | {r['correct']} | "
                     f"{100 * r['accuracy']:.1f}% | {r['no_answer']} |")
    return "\n".join(lines) + "\n"


def identity_summary(ident: dict) -> str:
    if ident["kind"] == "local":
        return f"weights sha256 {ident['weights_sha256'][:12]}"
    return f"hub {ident['id']}@{ident['revision'] or 'main'}"


# ---- checkpoint identity ---------------------------------------------------------------------


def checkpoint_identity(model: str, revision: str | None = None) -> dict:
    """A local folder: sha256 of ``config.json`` and of its weight files together (one digest over
    the sorted names and their digests); tokenizer files likewise. A hub id: the id and revision."""
    folder = Path(model)
    if not folder.is_dir():
        return {"kind": "hub", "id": model, "revision": revision}
    config = folder / "config.json"
    if not config.is_file():
        raise MissingPathError(f"{folder}: no config.json; not a Hugging Face checkpoint folder")
    weights = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not weights:
        raise MissingPathError(f"{folder}: no weight files (*.safetensors, *.bin)")
    tokenizer = sorted(p for p in folder.iterdir() if p.name.startswith(("tokenizer", "special_tokens")) and p.is_file())
    return {"kind": "local", "path": str(folder.resolve()), "config_sha256": file_sha256(config),
            "weights_sha256": digest_files(weights), "tokenizer_sha256": digest_files(tokenizer) if tokenizer else None}


