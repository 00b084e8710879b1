"""Threads on a shared CPU: a training step of the embedded tiny teacher's shape (random weights,
its ~2,100-token vocabulary, a batch of 8 x 256) in one torch thread and in ``threads`` (default:
every usable core), the two alternating, first on the machine as it is and then beside a busy
second process (a child that spins while the second half runs).

The project trains its tiny models in one thread and gives each Ray actor one thread per CPU it
was given, never more than the cores (:mod:`pipeline.runtime.cpu_threads`). The figures say what that
costs and saves: the many-thread step's wall time over the one-thread step's, without and with the
busy neighbour (above 1: one thread is faster). Multi-threaded, so wall time; the load average
before each half is recorded, since the machine's other work changes both figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from benchmarks.measure import interleaved, ratio
from benchmarks.results import figure
from pipeline.runtime.config import check_at_least

SPIN = "while True: pass"


@dataclass(frozen=True)
class ThreadsBenchConfig:
    threads: int | None = None  # the many-thread side (None: the usable cores)
    vocab_size: int = 2100  # the tiny teacher's tokenizer on the sample corpus: 2,096 tokens
    batch_size: int = 8
    block: int = 256
    repeats: int = 6  # steps per side and half
    warmup: int = 1
    target_busy: float = 1.0  # beside a busy process, the many-thread step takes at least the one-thread step's time

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("vocab_size", "batch_size", "block", "repeats"):
            check_at_least(problems, name, getattr(self, name), 1)
        check_at_least(problems, "threads", self.threads, 1)
        check_at_least(problems, "warmup", self.warmup, 0)
        return problems


def run(cfg: ThreadsBenchConfig) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.runtime.cpu_threads import torch_threads, usable_cores
    from pipeline.embedded.tiny_teacher import TinyTeacherSpec

    many = cfg.threads or usable_cores()
    spec = TinyTeacherSpec()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=cfg.vocab_size, **spec.hf_config_args(), tie_word_embeddings=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block), generator=torch.Generator().manual_seed(0))

    def step(threads: int):
        with torch_threads(threads):
            model(input_ids=batch, labels=batch).loss.backward()  # (B, T) in, the mean loss out
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    sides = {"one_thread": lambda: step(1), "many_threads": lambda: step(many)}
    halves, load = {}, {}
    load["as_is"] = os.getloadavg()
    halves["as_is"] = interleaved(sides, cfg.repeats, cfg.warmup)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        load["busy"] = os.getloadavg()
        halves["busy"] = interleaved(sides, cfg.repeats, cfg.warmup)
    finally:
        spinner.kill()
        spinner.wait()
    ratios = {h: ratio(s["many_threads"].wall, s["one_thread"].wall) for h, s in halves.items()}
    step_ms = {h: {k: 1e3 * min(v.wall) for k, v in s.items()} for h, s in halves.items()}

    def note(half: str) -> str:
        r, ms = ratios[half], step_ms[half]
        return (f"wall time, tiny-teacher shape, batch {cfg.batch_size}x{cfg.block}, {many} threads / 1 thread"
                f"{' beside a process spinning on one core' if half == 'busy' else ''}; fastest steps "
                f"{ms['many_threads']:.0f} / {ms['one_thread']:.0f} ms; spread {r['min']:.2f}-{r['max']:.2f}; "
                f"load average {load[half][0]:.1f} on {usable_cores()} cores at the start")

    return {
        "threads": many, "usable_cores": usable_cores(), "load_average": load,
        "samples": {h: {k: v.to_dict() for k, v in s.items()} for h, s in halves.items()},
        "ratios": ratios, "fastest_step_ms": step_ms,
        "figures": [
            figure("threads_as_is", f"tiny-teacher training step, {many} threads / 1 thread (wall)",
                   ratios["as_is"]["median"], note=note("as_is")),
            figure("threads_busy", f"the same beside a busy process, {many} threads / 1 thread (wall)",
                   ratios["busy"]["median"], cfg.target_busy, ">=", note=note("busy")),
        ],
    }
