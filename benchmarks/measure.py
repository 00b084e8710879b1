"""Timing and memory primitives shared by the bench cases.

* :func:`interleaved` runs several named sides in an alternating order (``A B``, then ``B A``, ...)
  for a number of repetitions, after untimed warm-up calls, and records wall and process CPU time
  of each call: whatever disturbs the machine at one moment disturbs both sides of a repetition.
* :func:`ratio` turns two sides' samples into a figure: the median of the per-repetition ratios
  (each numerator paired with the denominator of the same repetition), their min and max, and as
  cross-checks the ratio of the medians and the ratio of the minima (the least disturbed run of
  each side: on a busy machine, interference only ever adds time, so the minimum is the closest
  to the work's own cost).
* :func:`machine_info` records what the figures were measured on.
* :class:`TreeRssSampler` samples the resident set size of a process and all its descendants
  (a Ray job's raylet and actors included) from a background thread.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

CLOCKS = ("wall", "cpu")


@dataclass
class Samples:
    """Per-repetition measurements of one side: seconds of wall and CPU time, and what it returned."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    results: list = field(default_factory=list)

    def of(self, clock: str) -> list[float]:
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        return self.wall if clock == "wall" else self.cpu

    def to_dict(self) -> dict:
        return {"wall_s": self.wall, "cpu_s": self.cpu,
                "median_wall_s": _median(self.wall), "median_cpu_s": _median(self.cpu)}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """``(wall seconds, process CPU seconds, result)`` of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - w0, time.process_time() - c0, result


def interleaved(sides: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1,
                keep_results: bool = False) -> dict[str, Samples]:
    """Run every side ``warmup`` times untimed, then ``repeats`` times each, alternating the order.

    Repetition ``r`` runs the sides in their given order when ``r`` is even and reversed when odd
    (A B, B A, A B, ...), so a slow drift of the machine does not favour one side. What each call
    returns is kept (``Samples.results``) only with ``keep_results``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name]()
    out = {name: Samples() for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            wall, cpu, result = timed(sides[name])
            out[name].wall.append(wall)
            out[name].cpu.append(cpu)
            if keep_results:
                out[name].results.append(result)
    return out


def ratio(numerator: list[float], denominator: list[float]) -> dict:
    """Median of the paired ratios ``numerator[r] / denominator[r]``, with min, max and the ratio
    of the medians. Both lists hold one value per repetition."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("ratio needs two equally long, non-empty lists")
    paired = [n / d for n, d in zip(numerator, denominator)]
    return {
        "median": statistics.median(paired),
        "min": min(paired),
        "max": max(paired),
        "of_medians": statistics.median(numerator) / statistics.median(denominator),
        "of_minima": min(numerator) / min(denominator),
        "paired": paired,
        "repeats": len(paired),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """CPU, cores, memory, load and library versions: what the figures were measured on."""
    import numpy
    import pyarrow
    import torch
    import transformers

    info = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "pyarrow": pyarrow.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "env": {k: os.environ.get(k) for k in ("TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "RAY_USAGE_STATS_ENABLED")},
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        info["memory_gib"] = None
    for name in ("tokenizers", "ray", "polars"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


class TreeRssSampler:
    """Peak resident set size of a process and of all its descendants, sampled every ``interval`` s.

    Records the peak of the sum over the tree, the peak of the root process alone and the peak of
    the largest single descendant (for a Ray job: the scoring actor). Sampling can miss a spike
    shorter than the interval; the root's own peak is also available exactly from
    ``resource.getrusage`` of a finished child (see :mod:`benchmarks.memory`).
    """

    def __init__(self, pid: int, interval: float = 0.05):
        import psutil

        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak_tree = 0
        self.peak_root = 0
        self.peak_child = 0
        self.peak_child_name = ""
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "TreeRssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                root_rss = self.root.memory_info().rss
                children = self.root.children(recursive=True)
            except psutil.Error:
                break
            total = root_rss
            for child in children:
                try:
                    rss = child.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                if rss > self.peak_child:
                    self.peak_child = rss
                    try:
                        self.peak_child_name = " ".join(child.cmdline()[:2])[:80] or child.name()
                    except psutil.Error:
                        self.peak_child_name = "?"
            self.peak_root = max(self.peak_root, root_rss)
            self.peak_tree = max(self.peak_tree, total)
            self.samples += 1
            self._stop.wait(self.interval)

    def to_dict(self) -> dict:
        mib = 2**20
        return {"peak_tree_mib": self.peak_tree / mib, "peak_root_mib": self.peak_root / mib,
                "peak_child_mib": self.peak_child / mib, "peak_child": self.peak_child_name,
                "samples": self.samples, "interval_s": self.interval}


class TreeCpuSampler:
    """CPU seconds (user + system) used by a process and its descendants, sampled over time.

    Every ``interval`` s it records ``time.time()`` and each live process's cumulative CPU time, so
    that the CPU spent between two moments (e.g. two files appearing on disk) can be read off by
    :meth:`cpu_between`, for the whole tree or one process. A process's CPU after its last sample
    (at most ``interval`` before it exits) is not seen. Sampling itself costs the root process a
    little CPU: keep ``interval`` at a fraction of a second.
    """

    def __init__(self, pid: int, interval: float = 0.25):
        import psutil

        self.root = psutil.Process(pid)
        self.interval = interval
        self.times: list[float] = []
        self.series: dict[int, list[tuple[int, float]]] = {}  # pid -> [(sample index, cpu seconds)]
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "TreeCpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        import psutil

        k = len(self.times)
        self.times.append(time.time())
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            try:
                t = p.cpu_times()
                cpu = t.user + t.system
                self.names[p.pid] = " ".join(p.cmdline()[:2])[:80] or p.name()  # Ray retitles its workers
            except psutil.Error:
                continue
            self.series.setdefault(p.pid, []).append((k, cpu))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def _cpu_at(self, pid: int, t: float) -> float:
        """CPU seconds of ``pid`` at wall time ``t`` (linear between samples; 0 before its first)."""
        points = [(self.times[k], cpu) for k, cpu in self.series.get(pid, [])]
        if not points or t <= points[0][0]:
            return 0.0
        for (t0, c0), (t1, c1) in zip(points, points[1:]):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1
        return points[-1][1]

    def cpu_between(self, t0: float, t1: float, pid: int | None = None) -> float:
        pids = [pid] if pid is not None else list(self.series)
        return sum(self._cpu_at(p, t1) - self._cpu_at(p, t0) for p in pids)

    def busiest(self, t0: float, t1: float) -> tuple[int | None, str]:
        """The process that used the most CPU between ``t0`` and ``t1``, and its command line."""
        if not self.series:
            return None, ""
        pid = max(self.series, key=lambda p: self._cpu_at(p, t1) - self._cpu_at(p, t0))
        return pid, self.names.get(pid, "")


def profile_parts(fn: Callable[[], object], parts: Mapping[str, tuple[str, str]]) -> dict:
    """Run ``fn`` once under cProfile; the cumulative seconds of named functions and their share.

    ``parts`` maps a label to ``(file name ending, function name)``, e.g.
    ``("train_student/align.py", "align_document")``; builtins have file ``"~"``. Shares are of the profiled total
    (cProfile's per-call overhead inflates small, frequent calls: read shares, not absolutes).
    A part that matches no profiled call raises ``ValueError`` (a moved file would read as 0%).
    """
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items())
    out = {"total_s": total, "parts": {}}
    for label, (file_end, name) in parts.items():
        found = [ct for (file, _, func), (_, _, _, ct, _) in stats.items() if func == name and file.endswith(file_end)]
        if not found:  # a moved module or renamed function would otherwise read as 0%
            raise ValueError(f"profile part {label!r}: no call of {name} in a file ending {file_end!r}")
        cumulative = sum(found)
        out["parts"][label] = {"cumulative_s": cumulative, "share": cumulative / total if total else None}
    return out


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while a long run goes on (a daemon thread),
    so its report can say how busy the machine was throughout, not only at the start and the end."""

    def __init__(self, every: float = 30.0):
        self.samples: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._done.is_set():
            self.samples.append(os.getloadavg()[0])
            self._done.wait(every)

    def stop(self) -> dict:
        self._done.set()
        xs = self.samples or [os.getloadavg()[0]]
        return {"mean_1min": round(sum(xs) / len(xs), 2), "max_1min": round(max(xs), 2), "samples": len(xs),
                "every_s": 30.0}
