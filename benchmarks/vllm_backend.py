"""The vLLM backend against the transformers backend, on the same windows in one run.

vLLM lives in its own environment (``make setup-vllm``), so the case runs a child process with that
environment's Python (``python``; where it is missing the case is skipped with a note). In the child,
the embedded tiny teacher scores the first ``n_docs`` documents of the sample corpus, tokenized and
windowed as stage 1 does it (windows of ``window``, the longest vLLM takes from the teacher's 512
positions, so that both backends compute the same thing), with both backends:

* **start-up**: transformers: loading the model; vLLM: importing it, starting the engine's processes
  and its first window. Each backend's first pass over all windows is timed apart too.
* **steady state**: ``repeats`` passes over all windows per backend, interleaved (A B, B A, ...),
  by wall time (the engine computes in its own process); tokens/s of the median pass.
* **peak memory**: the resident set of the child and all its descendants (vLLM's engine and worker
  processes), sampled every 50 ms: above the child's baseline while the transformers model is loaded
  and scores, then how much more the vLLM engine adds while it starts and scores.

The losses of both are compared (max |difference|) so that a fast wrong answer shows. Figures are
information, not targets: which backend wins on a CPU is what is measured.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.inputs import corpus_windows, run_in_vllm_env
from benchmarks.results import figure
from pipeline.runtime.config import check_at_least

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class VLLMBackendBenchConfig:
    python: str = ".venv-vllm/bin/python"  # vLLM's environment (make setup-vllm); missing: skipped
    teacher: str | None = None  # a model folder to run instead of the embedded tiny teacher (a real one:
    # the folder convert-teacher writes of SmolLM2-135M, with window=2048 stride=1024)
    n_docs: int = 40  # documents of the sample corpus
    window: int = 511  # what vLLM takes from the tiny teacher's 512 positions
    stride: int = 384
    repeats: int = 3
    threads: int = 1  # torch threads of the transformers side: vLLM's CPU worker computes on one core of two
    max_batch_tokens: int = 16384  # the transformers backend's default

    def problems(self) -> list[str]:
        found: list[str] = []
        for key in ("n_docs", "repeats", "threads"):
            check_at_least(found, key, getattr(self, key), 1)
        check_at_least(found, "window", self.window, 2)
        return found


MEASURES = {
    "steady": ("vllm_vs_transformers", "vLLM backend / transformers backend, steady-state tokens/s (CPU)"),
    "start": ("vllm_startup", "vLLM backend start-up (import, engine processes, first window) vs transformers load"),
    "memory": ("vllm_memory", "vLLM backend peak memory added vs transformers backend peak (RSS, process tree)"),
}


def run(cfg: VLLMBackendBenchConfig, work_dir: str | os.PathLike, teacher: str | os.PathLike,
        corpus: list[str]) -> dict:
    """Both backends in a child of ``cfg.python`` on ``teacher`` and the first ``n_docs`` of ``corpus``."""
    result = run_in_vllm_env("benchmarks.vllm_backend", cfg, Path(work_dir) / "vllm-backend", teacher, corpus,
                             MEASURES, timeout_s=1800)
    return result if "skipped" in result else {**result, "figures": figures(result)}


def figures(r: dict) -> list[dict]:
    hf, vl = r["transformers"], r["vllm"]
    steady = vl["steady_tokens_per_s"] / hf["steady_tokens_per_s"]
    common = f"{r['tokens']:,} tokens in {r['windows']} windows of <= {r['window']} ({r['documents']} docs), float32"
    return [
        figure(*MEASURES["steady"], steady, unit="x", note=(
            f"{vl['steady_tokens_per_s']:,.0f} vs {hf['steady_tokens_per_s']:,.0f} tokens/s, median of {r['repeats']} "
            f"interleaved passes, wall; {common}; transformers on {r['threads']} torch thread(s), vLLM's worker on its "
            f"own; losses differ by <= {r['max_abs_difference']:.1e} nats")),
        figure(*MEASURES["start"], vl["start_s"], unit="s", note=(
            f"vLLM {vl['start_s']:.1f} s (import {vl['import_s']:.1f} s), first pass {vl['first_pass_s']:.2f} s; "
            f"transformers load {hf['start_s']:.1f} s, first pass {hf['first_pass_s']:.2f} s; "
            + (f"vLLM's start-up pays off from about {breakeven(hf, vl):,.0f} tokens per engine start"
               if vl["steady_tokens_per_s"] > hf["steady_tokens_per_s"] else "vLLM is not faster in steady state"))),
        figure(*MEASURES["memory"], vl["peak_added_mib"], unit="MiB", note=(
            f"vLLM engine adds {vl['peak_added_mib']:,.0f} MiB (KV cache {vl['kv_cache_mib']:,.0f} MiB); transformers "
            f"model and scoring {hf['peak_added_mib']:,.0f} MiB above the child's {r['baseline_mib']:,.0f} MiB")),
    ]


def breakeven(hf: dict, vl: dict) -> float:
    """Tokens at which both backends take as long, start-up included: ``s_v + N / r_v = s_h + N / r_h``."""
    return (vl["start_s"] - hf["start_s"]) / (1 / hf["steady_tokens_per_s"] - 1 / vl["steady_tokens_per_s"])


# ---------------------------------------------------------------------------------------------
# The child (runs in vLLM's environment)



def _child(task_path: str) -> None:
    import numpy as np
    import psutil
    import torch

    from benchmarks.measure import TreeRssSampler, interleaved
    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer

    task = json.loads(Path(task_path).read_text())
    cfg = task["cfg"]
    torch.set_num_threads(cfg["threads"])
    texts, windows = corpus_windows(task)
    tokens = int(sum(len(w) for w in windows))
    me = psutil.Process()
    mib = 1 << 20
    baseline = me.memory_info().rss
    scorer_cfg = ScorerConfig(model=task["teacher"], window=cfg["window"], dtype="float32",
                              max_batch_tokens=cfg["max_batch_tokens"])
    side: dict[str, dict] = {"transformers": {}, "vllm": {}}
    with TreeRssSampler(os.getpid()) as rss:
        t0 = time.perf_counter()
        hf = TransformersScorer(scorer_cfg)
        side["transformers"]["start_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_losses = hf.score(windows)
        side["transformers"]["first_pass_s"] = time.perf_counter() - t0
    side["transformers"]["peak_added_mib"] = (rss.peak_tree - baseline) / mib
    before = sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])
    with TreeRssSampler(os.getpid()) as rss:
        t0 = time.perf_counter()
        from pipeline.score_teacher.backends.vllm import VLLMScorer, _import_vllm

        _import_vllm()
        side["vllm"]["import_s"] = time.perf_counter() - t0
        vl = VLLMScorer(ScorerConfig(**{**asdict(scorer_cfg), "backend": "vllm"}))
        side["vllm"]["start_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        vl_losses = vl.score(windows)
        side["vllm"]["first_pass_s"] = time.perf_counter() - t0
    side["vllm"]["peak_added_mib"] = (rss.peak_tree - before) / mib
    side["vllm"]["kv_cache_mib"] = vl.args.get("kv_cache_memory_bytes", 0) / mib
    diff = max(float(np.nanmax(np.abs(a - b))) for a, b in zip(hf_losses, vl_losses) if len(a) > 1)
    samples = interleaved({"transformers": lambda: hf.score(windows), "vllm": lambda: vl.score(windows)},
                          cfg["repeats"], warmup=0)
    for name, s in samples.items():
        side[name]["pass_s"] = s.wall
        side[name]["steady_tokens_per_s"] = tokens / sorted(s.wall)[len(s.wall) // 2]
    vl.close()
    result = {"documents": len(texts), "windows": len(windows), "tokens": tokens, "window": cfg["window"],
              "repeats": cfg["repeats"], "threads": cfg["threads"], "baseline_mib": baseline / mib,
              "max_abs_difference": diff, "engine": vl.engine, "transformers": side["transformers"],
              "vllm": side["vllm"]}
    Path(task["out"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    _child(sys.argv[1])
