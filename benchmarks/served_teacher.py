"""A served teacher (``scorer.backend=server``) against the in-process engine, on the same windows.

Both need vLLM, which lives in its own environment (``make setup-vllm``): the case runs a child
process with that environment's Python (``python``; where it is missing the case is skipped with a
note). In the child, the first ``n_docs`` documents of the sample corpus are tokenized with the
embedded tiny teacher's tokenizer and windowed as stage 1 does it (windows of ``window``, stride
``stride``); then

* vLLM's OpenAI-compatible server of the tiny teacher is started on 127.0.0.1 (the CPU flags of
  docs/served-teacher.md) and its start-up timed; the windows go through the stage-1 client
  (:class:`pipeline.score_teacher.backends.server.ServerScorer`, one request per window) with each
  number of requests in flight in ``concurrency``;
* the in-process engine (:class:`pipeline.score_teacher.backends.vllm.VLLMScorer`) scores the same
  windows in the same process;
* ``repeats`` passes of every side, interleaved (A B C ..., then reversed), by wall time: tokens/s
  of the median pass. The concurrency that saturates the server is the smallest whose tokens/s is
  within ``saturation`` of the best.

Figures (information, no target): served tokens/s at the saturating concurrency / in-process
tokens/s; the saturating concurrency. The losses of both are compared (max |difference|) so that a
fast wrong answer shows. The client runs on the same two cores as the server here; on a fleet it
does not.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.inputs import corpus_windows, run_in_vllm_env
from benchmarks.results import figure
from pipeline.runtime.config import check_at_least

REPO = Path(__file__).resolve().parents[1]
MEASURES = {
    "ratio": ("served_vs_in_process", "served teacher / in-process vLLM engine, tokens/s at saturation (CPU)"),
    "saturation": ("served_saturation", "requests in flight that saturate the vLLM server (tiny teacher, CPU)"),
}


@dataclass(frozen=True)
class ServedTeacherBenchConfig:
    python: str = ".venv-vllm/bin/python"  # vLLM's environment (make setup-vllm); missing: skipped
    n_docs: int = 40  # documents of the sample corpus
    window: int = 511  # the server's max_model_len 512 less the output token (the in-process engine's too)
    stride: int = 384
    repeats: int = 3
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])  # requests in flight
    saturation: float = 0.95  # within this share of the best tokens/s

    def problems(self) -> list[str]:
        found: list[str] = []
        for key in ("n_docs", "repeats"):
            check_at_least(found, key, getattr(self, key), 1)
        check_at_least(found, "window", self.window, 2)
        if not self.concurrency or min(self.concurrency) < 1:
            found.append(f"concurrency: {self.concurrency} must list numbers >= 1")
        if not 0 < self.saturation <= 1:
            found.append(f"saturation: {self.saturation} must be in (0, 1]")
        return found


def run(cfg: ServedTeacherBenchConfig, work_dir: str | os.PathLike, teacher: str | os.PathLike,
        corpus: list[str]) -> dict:
    """The child of ``cfg.python`` on ``teacher`` and the first ``n_docs`` of ``corpus``."""
    work = Path(work_dir) / "served-teacher"
    result = run_in_vllm_env("benchmarks.served_teacher", cfg, work, teacher, corpus, MEASURES, timeout_s=3000,
                             log=str(work / "server.log"))
    return result if "skipped" in result else {**result, "figures": figures(result)}


def figures(r: dict) -> list[dict]:
    served, engine = r["served_tokens_per_s"], r["in_process_tokens_per_s"]
    c = r["saturating_concurrency"]
    common = (f"{r['tokens']:,} tokens in {r['windows']} windows of <= {r['window']} ({r['documents']} docs), float32, "
              f"median of {r['repeats']} interleaved passes, wall")
    per_c = ", ".join(f"{k}: {v:,.0f}" for k, v in served.items())
    return [
        figure(*MEASURES["ratio"], served[str(c)] / engine, unit="x", note=(
            f"{served[str(c)]:,.0f} tokens/s served with {c} requests in flight vs {engine:,.0f} in process; {common}; "
            f"server start-up {r['server_start_s']:.0f} s, engine {r['in_process_start_s']:.0f} s; losses differ by "
            f"<= {r['max_abs_difference']:.1e} nats")),
        figure(*MEASURES["saturation"], float(c), unit="requests", note=(
            f"tokens/s by requests in flight: {per_c}; saturating: the fewest within {r['saturation']:.0%} of the "
            f"best; client and server share the machine's {os.cpu_count()} cores")),
    ]


# ---------------------------------------------------------------------------------------------
# The child (runs in vLLM's environment)



def _start_server(teacher: str, window: int, log: str) -> tuple[subprocess.Popen, str, float]:
    """vLLM's OpenAI-compatible server of ``teacher`` in its own process group; waits for /health."""
    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", teacher, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", str(window + 1),
           "--kv-cache-memory-bytes", "256M", "--enforce-eager", "--no-enable-prefix-caching"]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        process = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < 600:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited {process.returncode}; its log: {log}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return process, url, time.perf_counter() - t0
        except requests.RequestException:
            pass
        time.sleep(0.25)
    _stop(process)
    raise RuntimeError(f"the vLLM server did not answer in 600 s; its log: {log}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its engine processes too), SIGKILL after 60 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def _child(task_path: str) -> None:
    import numpy as np

    from benchmarks.measure import interleaved
    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.server import ServerScorer
    from pipeline.score_teacher.backends.vllm import VLLMScorer

    task = json.loads(Path(task_path).read_text())
    cfg = task["cfg"]
    texts, windows = corpus_windows(task)
    tokens = int(sum(len(w) for w in windows))
    process, url, server_start = _start_server(task["teacher"], cfg["window"], task["log"])
    try:
        served = {c: ServerScorer(ScorerConfig(backend="server", url=url, served_model=task["teacher"],
                                               window=cfg["window"], in_flight_per_actor=c))
                  for c in cfg["concurrency"]}
        served_losses = served[max(served)].score(windows)  # also the server's warm-up
        t0 = time.perf_counter()
        engine = VLLMScorer(ScorerConfig(backend="vllm", model=task["teacher"], window=cfg["window"], dtype="float32"))
        engine_start = time.perf_counter() - t0
        engine_losses = engine.score(windows)
        diff = max(float(np.nanmax(np.abs(a - b))) for a, b in zip(served_losses, engine_losses) if len(a) > 1)
        sides = {"in_process": lambda: engine.score(windows),
                 **{f"served_{c}": (lambda s=s: s.score(windows)) for c, s in served.items()}}
        samples = interleaved(sides, cfg["repeats"], warmup=0)
        getattr(engine, "close", lambda: None)()
    finally:
        _stop(process)
    rate = {name: tokens / sorted(s.wall)[len(s.wall) // 2] for name, s in samples.items()}
    served_rate = {str(c): rate[f"served_{c}"] for c in cfg["concurrency"]}
    best = max(served_rate.values())
    saturating = min(c for c in cfg["concurrency"] if served_rate[str(c)] >= cfg["saturation"] * best)
    result = {"documents": len(texts), "windows": len(windows), "tokens": tokens, "window": cfg["window"],
              "repeats": cfg["repeats"], "saturation": cfg["saturation"], "server_start_s": server_start,
              "in_process_start_s": engine_start, "max_abs_difference": diff,
              "in_process_tokens_per_s": rate["in_process"], "served_tokens_per_s": served_rate,
              "saturating_concurrency": saturating,
              "pass_s": {name: s.wall for name, s in samples.items()}}
    Path(task["out"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    _child(sys.argv[1])
