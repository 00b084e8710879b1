"""Memory growth: peak RSS of each stage, and of inspection, at 10x the corpus against 1x.

Every workload runs in its own process (``python -m benchmarks.memory <workload> <json>``),
so each peak is its own. The parent samples the resident set size of that process and of all its
descendants (a Ray job's raylet, GCS and scoring actor) every 50 ms
(:class:`benchmarks.measure.TreeRssSampler`); the child reports its own exact peak, the
kernel's high-water mark ``VmHWM`` of ``/proc/self/status`` (``ru_maxrss`` would not do: Linux
carries the parent's peak over ``fork`` and ``exec`` into it). Workloads, each at 1x and 10x documents of the sample corpus:

* ``stage1``: :func:`pipeline.score_teacher.job.run_score_job` with a small random-weight teacher
  (Mistral's 32k vocabulary), Ray started by the job;
* ``student_data``: :func:`pipeline.student_data.build.build_student_data` (student: the Llama-2
  tokenizer) over the stage-1 output, then every packed sample read;
* ``train``: :func:`pipeline.train_student.run.run_training` of a small random-weight student for a fixed
  number of steps (the data plan covers the whole corpus; the steps do not grow with it);
* ``inspect``: :func:`pipeline.inspection.summary.summarize` (lazy Polars scans) of the stage-1
  output.

The figure per workload is the largest of three ratios (10x/1x): the whole process tree, the
root process, and the largest single descendant.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.inputs import REAL_TOKENIZERS, RandomModelShape
from benchmarks.results import figure
from pipeline.runtime.config import check_at_least, check_choice

WORKLOADS = ("stage1", "student_data", "train", "inspect")


def _micro_shape() -> RandomModelShape:
    return RandomModelShape(hidden_size=64, num_layers=2, intermediate_size=128, num_heads=2, context=256)


@dataclass(frozen=True)
class MemoryBenchConfig:
    n_docs: int = 42  # 1x (includes one 20k-60k character page, doc 41, so 1x and 10x differ in size, not in kind)
    scale: int = 10  # the large corpus is scale * n_docs
    rows_per_shard: int = 20
    teacher: RandomModelShape = field(default_factory=_micro_shape)
    student: RandomModelShape = field(default_factory=_micro_shape)
    teacher_tokenizer: str = "mistral"
    student_tokenizer: str = "llama-spm"
    window: int = 256
    stride: int = 192
    seq_len: int = 256
    train_steps: int = 5
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    interval_s: float = 0.05
    timeout_s: float = 600.0
    target: float = 1.2

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("n_docs", "rows_per_shard", "window", "stride", "seq_len", "train_steps"):
            check_at_least(problems, name, getattr(self, name), 1)
        check_at_least(problems, "scale", self.scale, 2)
        check_choice(problems, "teacher_tokenizer", self.teacher_tokenizer, REAL_TOKENIZERS)
        check_choice(problems, "student_tokenizer", self.student_tokenizer, REAL_TOKENIZERS)
        problems += [f"workloads: {w!r} is not one of {', '.join(WORKLOADS)}" for w in self.workloads if w not in WORKLOADS]
        if self.interval_s <= 0 or self.timeout_s <= 0:
            problems.append(f"interval_s, timeout_s: {self.interval_s}, {self.timeout_s} must be > 0")
        return problems


def run(cfg: MemoryBenchConfig, work_dir: str | os.PathLike, teacher_tokenizer, student_tokenizer) -> dict:
    from benchmarks.inputs import random_causal_lm, sample_corpus

    work = Path(work_dir) / "memory"
    teacher_dir = random_causal_lm(work / "teacher", cfg.teacher, teacher_tokenizer)
    student_dir = random_causal_lm(work / "student", cfg.student, student_tokenizer)
    runs: dict[str, dict[str, dict]] = {w: {} for w in cfg.workloads}
    sizes = {"1x": cfg.n_docs, f"{cfg.scale}x": cfg.scale * cfg.n_docs}
    for label, n_docs in sizes.items():
        corpus = sample_corpus(work, n_docs)
        scored = work / f"scored-{label}"
        common = {"scored": str(scored)}
        args = {
            "stage1": {**common, "model": str(teacher_dir), "corpus": [str(f) for f in corpus],
                       "rows_per_shard": cfg.rows_per_shard, "window": cfg.window, "stride": cfg.stride},
            "student_data": {**common, "tokenizer": str(student_dir), "seq_len": cfg.seq_len,
                             "cache_dir": str(work / f"lengths-{label}")},
            "train": {**common, "model": str(student_dir), "seq_len": cfg.seq_len, "steps": cfg.train_steps,
                      "out": str(work / f"train-{label}")},
            "inspect": common,
        }
        for workload in cfg.workloads:
            if workload != "stage1" and not (scored / "manifest.json").is_file():
                runs[workload][label] = {"error": "no stage-1 output to read"}
                continue
            runs[workload][label] = measure_subprocess(workload, args[workload], cfg.interval_s, cfg.timeout_s)
            runs[workload][label]["documents"] = n_docs
    figures = [_figure(cfg, w, runs[w]) for w in cfg.workloads]
    shutil.rmtree(work / "train-1x", ignore_errors=True)
    shutil.rmtree(work / f"train-{cfg.scale}x", ignore_errors=True)
    return {"sizes": sizes, "runs": runs, "figures": figures}


def _figure(cfg: MemoryBenchConfig, workload: str, runs: dict) -> dict:
    x = f"{cfg.scale}x/1x"
    measure = {"stage1": f"memory growth, stage 1 score-teacher ({x} peak RSS)",
               "student_data": f"memory growth, stage 2 data pipeline ({x})",
               "train": f"memory growth, stage 2 training ({x})",
               "inspect": f"memory growth, inspection summary ({x})"}[workload]
    small, large = runs.get("1x", {}), runs.get(f"{cfg.scale}x", {})
    problem = small.get("error") or large.get("error")
    if problem:
        return figure(f"memory_{workload}", measure, None, cfg.target, "<=", note=f"not measured: {problem}"[:400])
    ratios = {k: large[k] / small[k] for k in ("peak_tree_mib", "root_hwm_mib", "peak_child_mib") if small.get(k)}
    worst = max(ratios, key=ratios.get)
    note = (f"{small['documents']} vs {large['documents']} docs; peak MiB 1x/{cfg.scale}x: tree {small['peak_tree_mib']:.0f}/"
            f"{large['peak_tree_mib']:.0f}, root {small['root_hwm_mib']:.0f}/{large['root_hwm_mib']:.0f}"
            + (f", largest child {small['peak_child_mib']:.0f}/{large['peak_child_mib']:.0f}"
               if small.get("peak_child_mib") else "")
            + f"; figure = the largest ratio ({worst.replace('_mib', '')}); "
            f"run time {small['seconds']:.0f}/{large['seconds']:.0f} s")
    return figure(f"memory_{workload}", measure, ratios[worst], cfg.target, "<=", note=note,
                  details={k.replace("_mib", ""): v for k, v in ratios.items()})


def measure_subprocess(workload: str, args: dict, interval: float = 0.05, timeout: float = 600.0,
                       module: str = "benchmarks.memory") -> dict:
    """Run one workload in a child process (``python -m <module> <workload> <args>``, whose ``main``
    prints ``BENCH_RESULT <json>``); its peak RSS (tree, root, largest descendant)."""
    from benchmarks.measure import TreeRssSampler

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", module, workload, json.dumps(args)]
    t0 = time.perf_counter()
    log_file = tempfile.TemporaryFile(mode="w+")  # not a pipe: a chatty child never blocks on it
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    with TreeRssSampler(proc.pid, interval) as sampler:
        deadline = time.monotonic() + timeout
        status = None
        while status is None:
            pid, status_ = os.waitpid(proc.pid, os.WNOHANG)
            if pid:
                status = status_
            elif time.monotonic() > deadline:
                proc.kill()
                _, status = os.waitpid(proc.pid, 0)
            else:
                time.sleep(interval)
    proc.returncode = os.waitstatus_to_exitcode(status)
    log_file.seek(0)
    output = log_file.read()
    log_file.close()
    result = {**sampler.to_dict(), "seconds": time.perf_counter() - t0, "returncode": proc.returncode}
    if proc.returncode != 0:
        result["error"] = f"{workload} exited with {proc.returncode}: " + output.strip()[-600:]
    else:
        lines = [ln for ln in output.splitlines() if ln.startswith("BENCH_RESULT ")]
        result["workload"] = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
        result["root_hwm_mib"] = result["workload"].pop("vm_hwm_mib", None) or result["peak_root_mib"]
    return result


# ------------------------------------------------------------------------------------------------
# The workloads (run in the child process)


def _stage1(a: dict) -> dict:
    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.corpus import CorpusConfig
    from pipeline.score_teacher.pool import PoolConfig
    from pipeline.score_teacher.ray_cluster import RayConfig
    from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
    from pipeline.score_teacher.job import run_score_job

    shutil.rmtree(a["scored"], ignore_errors=True)
    summary = run_score_job(ScoreJobConfig(
        teacher=TeacherConfig(name="bench-memory", model=a["model"], window=a["window"], stride=a["stride"]),
        corpus=CorpusConfig(name="bench-memory", files=a["corpus"], rows_per_shard=a["rows_per_shard"]),
        scorer=ScorerConfig(dtype="float32", device="cpu"),
        output_dir=a["scored"], ray=RayConfig(num_cpus=2), pool=PoolConfig(num_actors=1, num_cpus=2),
        progress=False,
    ))
    return {"tokens": summary.tokens, "documents": summary.documents, "shards": summary.shards_complete}


def _student_data(a: dict) -> dict:
    from pipeline.student_data.build import build_student_data
    from pipeline.student_data.settings import AlignmentConfig, PackingConfig
    from pipeline.method.tokenization import load_tokenizer
    from storage_schemas.reader import open_scored_dataset

    shutil.rmtree(a["cache_dir"], ignore_errors=True)
    tokenizer = load_tokenizer(a["tokenizer"])
    data = build_student_data(open_scored_dataset([a["scored"]]), tokenizer, PackingConfig(seq_len=a["seq_len"]),
                              AlignmentConfig(), cache_dir=a["cache_dir"])
    for k in range(len(data.dataset)):
        data.dataset[k]
    return {"samples": len(data.dataset), "alignment": data.alignment.method}


def _train(a: dict) -> dict:
    from pipeline.train_student import config as c
    from pipeline.train_student import run as t

    def build(cls, **values):  # only the fields this version of the config has
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    job = c.TrainJobConfig(
        student=build(c.StudentConfig, name="bench-memory", model=a["model"], seq_len=a["seq_len"]),
        data=build(c.DataConfig, folders=[a["scored"]], cache_dir=None, num_workers=0),
        train=build(c.TrainConfig, micro_batch_size=2, max_steps=a["steps"], logging_steps=1, save_steps=10**6,
                    report_to=[], use_cpu=True, progress=False, warmup_steps=0, learning_rate=1e-4,
                    min_learning_rate=1e-5, cpu_threads=2),
        output_dir=a["out"], overwrite=True,
    )
    summary = t.run_training(job)
    return {"steps": summary.steps, "tokens": summary.tokens_trained}


def _inspect(a: dict) -> dict:
    from pipeline.inspection.summary import summarize
    from storage_schemas.reader import ScoredDataset

    s = summarize(ScoredDataset.open(a["scored"]))
    return {"documents": s.documents, "tokens": s.tokens}


def vm_hwm_mib() -> float | None:
    """This process's peak resident set size (``VmHWM``), MiB; None where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def main(argv: list[str]) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    workload, args = argv[0], json.loads(argv[1])
    fn = {"stage1": _stage1, "student_data": _student_data, "train": _train, "inspect": _inspect}[workload]
    result = fn(args)
    print("BENCH_RESULT " + json.dumps({**result, "vm_hwm_mib": vm_hwm_mib()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
