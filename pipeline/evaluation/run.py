"""One evaluation: a checkpoint on several tasks and, if asked, held-out bits per byte, written as
``eval.json``, ``samples.jsonl`` and ``eval.md`` in the output folder.

Steps: read every task's records and exemplars and the held-out documents (any bad input fails
before a model loads), load the model once, per task build the prompts, generate, cut at the stop
sequence, extract and score; measure bits per byte on the held-out documents
(:mod:`pipeline.method.bits_per_byte`); then write the results. ``eval.json`` records what makes
two evaluations comparable (per task: the data file's sha256, the number of problems, the shot
count, the exemplars' sha256, the prompt template, ``max_new_tokens``; for bits per byte: the
held-out text's digest, documents and bytes) and the checkpoint's identity (sha256 of its config
and weights files for a local folder; hub id and revision otherwise).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.method.bits_per_byte import summarize, text_losses
from pipeline.runtime.config import ConfigError, MissingPathError, UserError, check_at_least, check_choice
from pipeline.evaluation.generation import (
    GenerationConfig,
    GenerationSettings,
    Generator,
    LoadedModel,
    load_model,
    make_generator,
)
from pipeline.evaluation.held_out import BitsPerByteSettings, HeldOutText, read_documents, text_digest
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
from pipeline.folders.provenance import WEIGHT_SUFFIXES, code_version, digest_files
from storage_schemas import file_sha256, iter_identity_differences, write_json_atomic

log = logging.getLogger(__name__)

EVAL_FORMAT = 1
FEWSHOT_SOURCES = ("auto", "file", "lm_eval")


class ResultExistsError(UserError, FileExistsError):
    """The output folder holds the result of an evaluation with other settings."""


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
    bits_per_byte: BitsPerByteSettings = field(default_factory=BitsPerByteSettings)  # held-out text (tasks=[] for it alone)
    eval_root: str = "outputs/eval"
    out_dir: str | None = None  # None: <eval_root>/<label or a name derived from the checkpoint>
    overwrite: bool = False  # replace a result of other settings in the output folder (when the new one is written)
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
    bits_per_byte: HeldOutText | None = None  # None: not measured
    overwrite: bool = False  # replace a result of other settings in output_dir


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
    held_out = read_documents(job.bits_per_byte) if job.bits_per_byte else None
    if held_out is not None and not held_out[0]:
        raise ConfigError("bits_per_byte: the held-out text holds no document (every text empty, or no shard chosen)")
    identity = checkpoint_identity(job.generation.model, job.generation.revision)
    request = request_of(job, prepared, held_out, identity)
    refuse_other_result(Path(job.output_dir), request, job.overwrite)  # before any model loads
    transformers = job.generation.backend == "transformers"
    loaded = load_model(job.generation) if held_out is not None and (transformers or not prepared) else None
    if prepared:
        generator = generator or make_generator(job.generation, loaded)
    results, samples = {}, []
    for task in prepared:
        result, task_samples = evaluate_task(task, generator, job.generation.max_new_tokens, job.progress)
        results[task.spec.name] = result
        samples += task_samples
    if held_out is not None and loaded is None:
        loaded = load_model(job.generation)  # vLLM generated: bits per byte needs the transformers model
    described = generator.describe() if prepared else loaded.describe()
    record = {
        "format": EVAL_FORMAT,
        "label": job.label,
        "checkpoint": job.generation.model,
        "identity": identity,
        "settings": {**described, "batch_size": job.generation.batch_size, "seed": job.generation.seed,
                     "max_new_tokens": job.generation.max_new_tokens, "limit": job.limit},
        "tasks": results,
        "truncated_prompts": generator.truncated_prompts if prepared else 0,
        "request": request,
    }
    if held_out is not None:
        record["bits_per_byte"] = measure_held_out(job.bits_per_byte, *held_out, loaded, job.progress)
    record.update(seconds=round(time.perf_counter() - t0, 2), code_version=code_version())
    write_outputs(Path(job.output_dir), record, samples)
    return record


def request_of(job: EvalJobConfig, prepared: list[PreparedTask], held_out, identity: dict) -> dict:
    """What an evaluation measures, known before any model loads: the checkpoint, each task's
    comparable settings, the held-out text, and how the model runs. Two results with different
    requests are different results, and never replace each other (:func:`refuse_other_result`)."""
    g = job.generation
    request = {
        "checkpoint": identity,
        "tasks": {t.spec.name: t.settings(g.max_new_tokens) for t in prepared},
        "bits_per_byte": None,
        "generation": {"backend": g.backend, "dtype": g.dtype, "batch_size": g.batch_size, "seed": g.seed},
        "limit": job.limit,
    }
    if held_out is not None:
        texts, _ = held_out
        request["bits_per_byte"] = {"text_sha256": text_digest(texts), "documents": len(texts),
                                    "window": job.bits_per_byte.window, "batch_size": job.bits_per_byte.batch_size}
    return json.loads(json.dumps(request))  # as eval.json stores it


def refuse_other_result(out: Path, request: dict, overwrite: bool) -> None:
    """A folder holding the result of another request is not written over unless ``overwrite``
    (which replaces its eval.json, eval.md and samples.jsonl only once the new result is written)."""
    path = out / "eval.json"
    if overwrite or not path.is_file():
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = {}
    recorded = old.get("request") if isinstance(old, dict) else None
    if recorded is None:  # written before requests were recorded: compare what the record holds
        held = (old.get("bits_per_byte") or {}).get("comparable") or {}
        recorded = {"checkpoint": old.get("identity"), "held_out_text": held.get("text_sha256"),
                    "tasks": {n: r.get("comparable") for n, r in (old.get("tasks") or {}).items()}}
        current = {"checkpoint": request["checkpoint"], "tasks": request["tasks"],
                   "held_out_text": (request["bits_per_byte"] or {}).get("text_sha256")}
        differences = list(iter_identity_differences(recorded, current))
    else:
        differences = list(iter_identity_differences(recorded, request))
    if differences:
        cut = [d if len(d) <= 100 else d[:97] + "..." for d in differences[:4]]
        shown = "; ".join(cut) + (f"; and {len(differences) - 4} more" if len(differences) > 4 else "")
        raise ResultExistsError(
            f"{out} holds the result of another evaluation ({shown}); results of other settings are kept apart: "
            "give this one its own folder, label=<a name> (or out_dir=<a folder>), or pass overwrite=true to "
            "replace that one's eval.json, eval.md and samples.jsonl once this result is written")


def measure_held_out(held: HeldOutText, texts: list[str], sources: list[dict], loaded: LoadedModel,
                     progress: bool) -> dict:
    """Bits per byte of ``loaded`` on the held-out ``texts``: the statistics of
    :func:`pipeline.method.bits_per_byte.summarize`, the settings, the sources and what must
    match for two results to be compared (the text's digest, documents and bytes)."""
    t0 = time.perf_counter()
    context = getattr(loaded.model.config, "max_position_embeddings", None)
    window = held.window or (context - 1 if context else 1024)
    if context and window > context - 1:
        raise ConfigError(f"bits_per_byte.window: {window} does not fit the model's context {context} "
                          f"(at most {context - 1}: a block is the window plus the token before it)")
    if progress:
        log.info("bits per byte: %d documents, window %d", len(texts), window)
    totals = summarize(text_losses(loaded.model, loaded.tokenizer, texts, window=window, batch_size=held.batch_size))
    return {
        **totals, "window": window, "batch_size": held.batch_size, **loaded.describe(),
        "sources": sources, "seconds": round(time.perf_counter() - t0, 2),
        "comparable": {"text_sha256": text_digest(texts), "documents": totals["documents"], "bytes": totals["bytes"]},
    }


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
    ]
    if record["tasks"]:
        lines += [
            f"- generation: {s['backend']} on {s['device']}, {s['dtype']}, greedy, max_new_tokens "
            f"{s['max_new_tokens']}, batch size {s['batch_size']}",
            f"- prompts cut to fit the context: {record['truncated_prompts']}",
            "",
            "| task | shots | n | correct | accuracy | no answer |",
            "|---|---:|---:|---:|---:|---:|",
        ]
    for name, r in record["tasks"].items():
        lines.append(f"| {name} | {r['comparable']['num_fewshot']} | {r['n']} | {r['correct']} | "
                     f"{100 * r['accuracy']:.1f}% | {r['no_answer']} |")
    if "bits_per_byte" in record:
        b = record["bits_per_byte"]
        lines += ["", f"- bits per byte: {b['backend']} on {b['device']}, {b['dtype']}, batch size {b['batch_size']}",
                  "", *bits_per_byte_lines(b)]
    return "\n".join(lines) + "\n"


def bits_per_byte_lines(b: dict) -> list[str]:
    """The held-out measure as markdown: the statistics, then where the documents came from."""
    lines = [
        "Held-out bits per byte (total bits / total bytes; per document: mean and "
        f"{round(100 * b['level'])}% t interval over documents):",
        "",
        "| bits/byte | per-document mean [CI] | nats/token | documents | bytes | tokens | window |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {b['bits_per_byte']:.4f} | {document_interval(b)} | {b['nats_per_token']:.4f} | {b['documents']} | "
        f"{b['bytes']} | {b['tokens']} | {b['window']} |",
        "",
    ]
    for s in b["sources"]:
        if s["kind"] == "text_file":
            lines.append(f"- `{s['path']}`: {s['documents']} document(s)")
        else:
            lines.append(f"- `{s['folder']}` shards {', '.join(s['shards'])}: {s['documents']} document(s); "
                         f"trained on: {s['trained_on']}")
    return lines


def document_interval(b: dict) -> str:
    ci = b.get("document_ci")
    return f"{b['document_mean']:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")


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


