"""How many threads torch may use on this machine's CPUs.

torch's own default is the machine's physical cores, whatever this process may run on: in a
container with a CPU quota, or in one of several processes on one machine (Ray actors, data-parallel
ranks), that is more threads than cores, and CPU work then runs several times slower, as OpenMP
threads wait on each other for cores others hold. Here the threads are those a process was given
(a Ray actor's CPUs, a training setting), never more than :func:`usable_cores`.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Iterator

import psutil


CGROUP = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """The cores this process may run on: the CPUs of its affinity, counted as physical cores (two
    threads on one core's hyperthreads slow each other down; torch's own default counts physical
    cores too), lowered by a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    logical = psutil.cpu_count() or cpus
    cores = cpus * (psutil.cpu_count(logical=False) or logical) // logical
    quota = cgroup_quota(CGROUP)
    return max(1, min(cores, quota) if quota else cores)


def cgroup_quota(root: Path) -> int | None:
    """Whole cores of the CPU quota of the cgroup mounted at ``root`` (cgroup v2 ``cpu.max``, or
    v1's CFS quota), rounded up; None where there is none."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else math.ceil(quota / period)
    except (OSError, ValueError):
        return None


def threads_for(cpus: float | None = None, sharing: int = 1) -> int:
    """torch intra-op threads for work given ``cpus`` CPUs (None: the usable cores), run by
    ``sharing`` processes of this machine at once: never more than their share of the usable cores, at least 1."""
    share = max(1, usable_cores() // max(1, sharing))
    return max(1, min(share, int(cpus) if cpus else share))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """``torch.set_num_threads(n)`` while this lasts."""
    import torch  # lazy: seconds to import; a config error is refused first
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
