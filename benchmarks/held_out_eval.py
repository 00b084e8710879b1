"""Held-out bits per byte: its speed against a bare forward pass, and what evaluating while training
(``train.eval_every``) costs at the embedded recipe's settings.

Both parts use the embedded tiny student (built as ``student=tiny`` builds it, under the bench's
``artifacts_dir``) and held-out documents taken from the last shard of the bench's scored dataset,
as the embedded recipe holds its last shard out.

* ``speed``: :func:`pipeline.method.bits_per_byte.text_losses` over the documents (tokenization, blocks,
  padding, float32 log-softmax, sums: everything ``make eval-student`` and ``train.eval_every``
  do) against a bare forward (``model(input_ids).logits``) of the very same padded batches, made
  beforehand. Single-threaded, interleaved, compared by process CPU time; the figure is the
  throughput ratio (the same tokens on both sides, so the ratio of times), target >= 0.8.
* ``cost``: one run of stage 2 with the embedded recipe's settings, read from
  ``conf/train_student.yaml`` (schedule, batch, learning rates, ``eval_every``,
  ``eval_max_documents``, ``cpu_threads``, saves), on the bench's scored dataset. The evaluation's
  documents are those of ``speed``, given as a text file (so a scored dataset of one shard serves
  too). The wall time of every evaluation is the trainer's own ``eval_runtime``; the training's is
  the Trainer's ``train_runtime`` less the evaluations. The figure is the evaluations' share of
  the training at the recipe's length and evaluation steps: ``evaluations x mean evaluation time /
  (steps x mean step time)``, target <= 0.10; with ``train_steps`` unset the run is the recipe's
  own, and the directly measured share is reported beside it (a shorter run, as in ``quick=true``,
  scales the warm-up with its length).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from benchmarks.measure import interleaved, ratio
from benchmarks.results import figure
from pipeline.runtime.config import check_at_least

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class HeldOutEvalBenchConfig:
    n_docs: int | None = None  # held-out documents (None: the embedded recipe's train.eval_max_documents)
    batch_size: int | None = None  # blocks per forward (None: the recipe's train.eval_batch_size)
    repeats: int = 5
    warmup: int = 1
    threads: int = 1
    train_steps: int | None = None  # None: the recipe's train.max_steps
    eval_every: int | None = None  # None: the recipe's train.eval_every
    target: float = 0.8  # bits per byte tokens/s over a bare forward's, at least
    cost_target: float = 0.10  # evaluation time over training time at the recipe's settings, at most

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("n_docs", "batch_size", "repeats", "threads", "train_steps", "eval_every"):
            check_at_least(problems, name, getattr(self, name), 1)
        check_at_least(problems, "warmup", self.warmup, 0)
        return problems


def embedded_recipe() -> dict:
    """The embedded recipe's student, data and train settings as ``conf/train_student.yaml`` and
    ``conf/student/tiny.yaml`` write them (the values only: their interpolations are left alone)."""
    from omegaconf import OmegaConf

    main = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "train_student.yaml"), resolve=False)
    student = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "student" / "tiny.yaml"), resolve=False)
    return {"student": student, "data": main["data"], "train": main["train"]}


def held_out_documents(dataset: str | os.PathLike, n: int) -> list[str]:
    """The first ``n`` non-empty documents of the last shard of ``dataset``."""
    from pipeline.method.bits_per_byte import shard_documents
    from storage_schemas import filesystem as sfs
    from storage_schemas.reader import ScoredDataset

    opened = ScoredDataset.open(dataset)
    return shard_documents(opened, [sfs.name(opened.shards[-1].path)], n)


def run(cfg: HeldOutEvalBenchConfig, work_dir: str | os.PathLike, artifacts_dir: str | os.PathLike,
        dataset: str | os.PathLike) -> dict:
    from pipeline.embedded.tiny_student import TinyStudentSpec, ensure_tiny_student

    recipe = embedded_recipe()
    build = recipe["student"]["build"]
    student = ensure_tiny_student(artifacts_dir, corpus_docs=build["corpus_docs"], seed=build["seed"],
                                  spec=TinyStudentSpec(vocab_size=build["vocab_size"], seed=build["seed"]))
    texts = held_out_documents(dataset, cfg.n_docs or recipe["train"]["eval_max_documents"])
    work = Path(work_dir) / "held_out_eval"
    work.mkdir(parents=True, exist_ok=True)
    speed = measure_speed(cfg, student, texts, cfg.batch_size or recipe["train"].get("eval_batch_size", 8))
    cost = measure_cost(cfg, recipe, student, texts, dataset, work)
    result = {"student": str(student), "documents": len(texts), "speed": speed, "cost": cost}
    result["figures"] = [speed.pop("figure"), cost.pop("figure")]
    return result


def measure_speed(cfg: HeldOutEvalBenchConfig, student: Path, texts: list[str], batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.method.bits_per_byte import blocks, default_window, first_token, text_losses
    from pipeline.method.tokenization import load_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        tokenizer = load_tokenizer(str(student))
        model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
        window = default_window(model)
        encoded = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        work = sorted((b for ids in encoded for b in blocks(ids, first_token(tokenizer), window)), key=len)
        batches = []
        for i in range(0, len(work), batch_size):
            rows = work[i: i + batch_size]
            x = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
            for r, b in enumerate(rows):
                x[r, : len(b)] = torch.tensor(b)
            batches.append(x)
        tokens = sum(len(b) - 1 for b in work)

        def bare_forward():
            with torch.inference_mode():
                for x in batches:
                    model(input_ids=x).logits

        samples = interleaved({"bare_forward": bare_forward,
                               "bits_per_byte": lambda: text_losses(model, tokenizer, texts, window, batch_size)},
                              cfg.repeats, cfg.warmup)
    finally:
        torch.set_num_threads(threads)
    r = ratio(samples["bare_forward"].cpu, samples["bits_per_byte"].cpu)  # same tokens: time ratio = throughput ratio
    per_s = {k: tokens / v.to_dict()["median_cpu_s"] for k, v in samples.items()}
    note = (f"CPU time, {cfg.threads} thread(s), the embedded tiny student, {len(texts)} held-out documents, {tokens:,} "
            f"predicted tokens in {len(batches)} batches of <= {batch_size} blocks (window {window}): bits per byte "
            f"{per_s['bits_per_byte']:,.0f} tokens/s, bare forward {per_s['bare_forward']:,.0f} tokens/s (spread "
            f"{r['min']:.2f}-{r['max']:.2f}, ratio of minima {r['of_minima']:.2f})")
    return {"tokens": tokens, "window": window, "batch_size": batch_size, "tokens_per_cpu_s": per_s,
            "samples": {k: v.to_dict() for k, v in samples.items()}, "ratio": r,
            "figure": figure("held_out_eval_speed", "held-out bits per byte / bare forward (tokens/s)", r["median"],
                             cfg.target, ">=", note=note)}


def measure_cost(cfg: HeldOutEvalBenchConfig, recipe: dict, student: Path, texts: list[str],
                 dataset: str | os.PathLike, work: Path) -> dict:
    from pipeline.train_student.config import train_job_config
    from pipeline.train_student.run import run_training

    held = work / "held-out.jsonl"
    held.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    t = recipe["train"]
    steps, every = cfg.train_steps or t["max_steps"], cfg.eval_every or t["eval_every"]
    job = train_job_config({
        "student": {"name": "tiny", "model": str(student), "seq_len": recipe["student"]["seq_len"]},
        "data": {"folders": [str(dataset)], "cache_dir": str(work / "lengths")},
        "train": {**t, "max_steps": steps, "warmup_steps": t["warmup_steps"] * steps // t["max_steps"],
                  "eval_every": every, "eval_texts": [str(held)],
                  "eval_max_documents": len(texts), "report_to": [], "progress": False},
        "output_dir": str(work / "run"), "overwrite": True,
    })
    run_training(job)
    logs = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_runtime"] for r in logs if "eval_runtime" in r]
    train_s = next(r["train_runtime"] for r in logs if "train_runtime" in r) - sum(evals)
    per_eval, per_step = sum(evals) / len(evals), train_s / steps
    recipe_evals = math.ceil(t["max_steps"] / t["eval_every"])  # at every eval_every steps and after the last
    share = recipe_evals * per_eval / (t["max_steps"] * per_step)
    note = (f"wall time, one run of {steps} steps of the embedded recipe (evaluation every {every}: {len(evals)} "
            f"evaluations of {len(texts)} documents, {per_eval:.2f} s each; {per_step * 1e3:.0f} ms per training step, "
            f"saves included): at the recipe's {t['max_steps']} steps and {recipe_evals} evaluations the evaluations "
            f"cost {100 * share:.1f}% of the training; measured in this run: {100 * sum(evals) / train_s:.1f}%")
    return {"steps": steps, "eval_every": every, "eval_seconds": evals, "train_seconds_without_eval": train_s,
            "per_eval_s": per_eval, "per_step_s": per_step, "recipe_steps": t["max_steps"],
            "recipe_evaluations": recipe_evals, "share_at_recipe": share, "share_measured": sum(evals) / train_s,
            "figure": figure("held_out_eval_cost", "evaluation while training / training time (embedded recipe)",
                             share, cfg.cost_target, "<=", note=note)}
