"""Measuring one step of a rehearsal: a command run as a child process (its own session, so it can
be SIGKILLed with everything it started), watched from here.

* **CPU seconds**: the child's own and those of every descendant it waited for, from ``wait4``'s
  resource usage (exact for processes that end: the Ray cluster a stage starts is shut down and
  reaped by it); the sum over the process tree sampled every ``interval`` s is kept beside it,
  and the larger of the two is the figure (a SIGKILLed tree is reaped by no one but ``init``).
* **Peak RSS of every process** of the tree (the driver, Ray's ``raylet`` and ``gcs_server``, each
  scorer actor, data-loader and length-count workers), sampled; grouped by role.
* **Ray's object store**: its high-water mark read as resident shared memory (``RssShmem``), the
  largest in any process of the tree: the plasma store's pages are mapped from ``/dev/shm`` into the
  raylet and into each worker that writes or reads an object, and stay resident once touched;
  objects small enough to travel inline never reach it.
* **Files and bytes written**: the output folders listed after the step.
* **Events**: the moment a watched file first appears (a shard marker, the first line of
  ``metrics.jsonl``), relative to the start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

MIB = 2**20
STEPS_CPU_S = [0.0]  # the CPU seconds of every step measured in this process so far (run_step adds to it)


def role_of(cmdline: list[str], root_cmdline: list[str], parent_is_root: bool) -> str:
    """A process's part in a step, from its command line (Ray retitles its workers ``ray::<Actor>``
    once they hold an actor; until then they are ``ray worker``)."""
    text = " ".join(cmdline)
    exe = os.path.basename(cmdline[0]) if cmdline else ""
    if text.startswith("ray::"):
        name = text.split()[0].removeprefix("ray::").split(".")[0]
        return "scorer actor" if name == "ShardScorer" else "ray worker" if name in ("IDLE", "") else f"ray {name}"
    if exe in ("raylet", "gcs_server"):
        return exe
    for marker, role in (("default_worker.py", "ray worker"), ("dashboard", "ray dashboard"),
                         ("log_monitor", "ray log monitor"), ("ray/_private", "ray helper"),
                         ("ray/autoscaler", "ray helper"), ("multiprocessing.spawn", "spawned worker"),
                         ("multiprocessing.resource_tracker", "mp helper")):
        if marker in text:
            return role
    if cmdline == root_cmdline and parent_is_root:
        return "forked worker"  # torch's data-loader workers fork the driver
    return "other"


@dataclass
class ProcessPeak:
    pid: int
    role: str
    command: str
    peak_rss_mib: float = 0.0
    cpu_s: float = 0.0  # cumulative user + system, last seen
    peak_shmem_mib: float = 0.0


def relabel(peak: ProcessPeak, cmdline: list[str], root_cmdline: list[str], parent_is_root: bool) -> None:
    """Give a process seen again the role its command line says now. An empty command line says
    nothing: a process being torn down (a killed actor freeing its memory, the raylet at shutdown)
    reads empty before it is a zombie, and one just forked may too; it keeps the role it had."""
    if not "".join(cmdline).strip():
        return
    peak.role = role_of(cmdline, root_cmdline, parent_is_root)
    peak.command = " ".join(cmdline)[:160]


@dataclass
class StepResult:
    name: str
    command: list[str]
    returncode: int | None
    wall_s: float
    cpu_s: float  # max(waited-for resource usage, sampled tree sum)
    cpu_rusage_s: float
    cpu_sampled_s: float
    peak_tree_rss_mib: float
    roles: dict  # role -> {"processes", "peak_rss_mib" (largest single process), "cpu_s"}
    object_store_peak_mib: float
    files_written: int = 0
    bytes_written: int = 0
    events: dict = field(default_factory=dict)  # name -> seconds after start
    killed_at_s: float | None = None
    stdout_tail: str = ""
    samples: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _shmem_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class TreeMonitor:
    """Samples every process under ``pid`` (and ``pid`` itself) every ``interval`` s: RSS, CPU,
    the raylet's shared memory; checks the ``watch`` files for the events."""

    def __init__(self, pid: int, interval: float, watch: dict[str, Callable[[], bool]], t0: float):
        import psutil

        self.root = psutil.Process(pid)
        self.root_cmdline = self.root.cmdline()
        self.interval, self.watch, self.t0 = interval, dict(watch), t0
        self.procs: dict[int, ProcessPeak] = {}
        self.peak_tree = 0.0
        self.events: dict[str, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "TreeMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        import psutil

        try:
            tree = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            tree = []
        total = 0.0
        for p in tree:
            try:
                with p.oneshot():
                    rss = p.memory_info().rss / MIB
                    times = p.cpu_times()
                    if p.pid not in self.procs:
                        cmd = p.cmdline()
                        parent_is_root = p.ppid() == self.root.pid
                        self.procs[p.pid] = ProcessPeak(p.pid, "driver" if p.pid == self.root.pid else
                                                        role_of(cmd, self.root_cmdline, parent_is_root),
                                                        " ".join(cmd)[:160])
            except psutil.Error:
                continue
            peak = self.procs[p.pid]
            if peak.role != "driver":  # a worker forked by the raylet is exec'd, then retitled as an actor
                try:
                    relabel(peak, p.cmdline(), self.root_cmdline, p.ppid() == self.root.pid)
                except psutil.Error:
                    pass
            peak.peak_rss_mib = max(peak.peak_rss_mib, rss)
            peak.cpu_s = max(peak.cpu_s, times.user + times.system)
            peak.peak_shmem_mib = max(peak.peak_shmem_mib, _shmem_mib(p.pid))
            total += rss
        self.peak_tree = max(self.peak_tree, total)
        now = time.perf_counter() - self.t0
        for name, seen in list(self.watch.items()):
            try:
                if seen():
                    self.events[name] = now
                    del self.watch[name]
            except OSError:
                pass
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def roles(self) -> dict:
        out: dict[str, dict] = {}
        for p in self.procs.values():
            r = out.setdefault(p.role, {"processes": 0, "peak_rss_mib": 0.0, "cpu_s": 0.0})
            r["processes"] += 1
            r["peak_rss_mib"] = max(r["peak_rss_mib"], p.peak_rss_mib)
            r["cpu_s"] += p.cpu_s
        return out


def folder_size(paths: list[str]) -> tuple[int, int]:
    """Files and bytes under local folders or object-store prefixes."""
    import pyarrow.fs as pafs

    from storage_schemas import filesystem as sfs

    files = size = 0
    for location in paths:
        fs, path = sfs.resolve(location)
        for info in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)):
            if info.type == pafs.FileType.File:
                files += 1
                size += info.size
    return files, size


def run_step(name: str, command: list[str], *, outputs: list[str] = (), env: dict | None = None,
             cwd: str | Path | None = None, watch: dict[str, Callable[[], bool]] | None = None,
             kill_when: Callable[[float], bool] | None = None, interval: float = 0.2,
             timeout_s: float = 3600) -> StepResult:
    """Run ``command`` and measure it (module docstring). ``kill_when(elapsed)`` returning True
    SIGKILLs the child's whole session (``killed_at_s`` records when)."""
    out_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"rehearse-{os.getpid()}-{time.monotonic_ns()}.log"
    t0 = time.perf_counter()
    with open(out_file, "wb") as log:
        child = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        killed_at = None
        rusage = None
        with TreeMonitor(child.pid, interval, watch or {}, t0) as monitor:
            while True:
                pid, status, usage = os.wait4(child.pid, os.WNOHANG)
                if pid:
                    rusage, returncode = usage, os.waitstatus_to_exitcode(status)
                    child.returncode = returncode
                    break
                elapsed = time.perf_counter() - t0
                if killed_at is None and kill_when is not None and kill_when(elapsed):
                    monitor.sample()  # the last view of the tree before it goes
                    killed_at = elapsed
                    try:
                        os.killpg(child.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if elapsed > timeout_s and killed_at is None:
                    os.killpg(child.pid, signal.SIGKILL)
                    killed_at = elapsed
                time.sleep(0.02)
        wall = time.perf_counter() - t0
    if killed_at is not None:
        _reap_session(child.pid)
    files, size = folder_size(list(outputs)) if outputs else (0, 0)
    cpu_rusage = rusage.ru_utime + rusage.ru_stime if rusage else 0.0
    cpu_sampled = sum(p.cpu_s for p in monitor.procs.values())
    shared = [p.peak_shmem_mib for p in monitor.procs.values()]
    tail = out_file.read_bytes()[-4000:].decode("utf-8", "replace")
    out_file.unlink(missing_ok=True)
    cpu = max(cpu_rusage, cpu_sampled)
    STEPS_CPU_S[0] += cpu
    return StepResult(name=name, command=command, returncode=child.returncode, wall_s=wall,
                      cpu_s=cpu, cpu_rusage_s=cpu_rusage, cpu_sampled_s=cpu_sampled,
                      peak_tree_rss_mib=monitor.peak_tree, roles=monitor.roles(),
                      object_store_peak_mib=max(shared, default=0.0), files_written=files, bytes_written=size,
                      events=monitor.events, killed_at_s=killed_at, stdout_tail=tail, samples=monitor.samples)


def _reap_session(sid: int, timeout_s: float = 30.0) -> None:
    """Wait until no process of the killed session is left (a SIGKILLed Ray cluster's processes are
    adopted by init and vanish within moments)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getsid(p.pid) == sid:
                    left.append(p)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        if not left:
            return
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        time.sleep(0.2)
