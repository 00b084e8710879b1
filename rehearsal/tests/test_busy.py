"""The rehearsal flags a part's figures when other work shared the machine, not when its own
processes were what kept the cores busy; its own CPU includes every process of its steps."""

from __future__ import annotations

import os
import sys

from rehearsal.__main__ import busy_note, cpu_seconds
from rehearsal.measure import run_step


def part(tag: str, mean: float, own: float | None = None) -> dict:
    load = {"mean_1min": mean, "max_1min": mean + 0.3}
    return {"tag": tag, "load": load if own is None else {**load, "own_cpu_rate": own}}


def test_own_load_is_not_others_work():
    # 1% of the corpus on 2 cores: a mean load of 1.52 while its own processes used 1.38 cores
    assert busy_note([part("1pct", 1.52, own=1.38), part("0.1pct", 1.38, own=1.30)], cores=2) is None
    note = busy_note([part("1pct", 1.52, own=0.40), part("0.1pct", 1.38, own=1.30)], cores=2)
    assert note.startswith("Other work shared the machine while 1pct ran") and "0.1pct" not in note


def test_parts_saved_without_their_own_rate_and_without_a_load():
    assert busy_note([part("0.01pct", 1.40)], cores=2) is None  # 1.40 <= 3/4 of 2 cores
    assert "0.01pct" in busy_note([part("0.01pct", 1.60)], cores=2)
    assert "markers" in busy_note([part("1pct", 1.0, own=1.0), {"operations": {}}], cores=2)


def test_the_cpu_of_a_step_counts_what_its_command_never_waits_for():
    """A step whose command starts a process it never waits for (as a stage's Ray cluster is): that
    process's CPU is the rehearsal's own too. The kernel's count for waited-for children misses it."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8: pass"
    command = [sys.executable, "-c", f"import subprocess, sys, time, os\nsubprocess.Popen([sys.executable, '-c', {burn!r}])\n"
               "time.sleep(2.0)\nos._exit(0)"]
    before, children = cpu_seconds(), os.times().children_user
    result = run_step("burn", command, interval=0.05)
    assert result.returncode == 0
    assert cpu_seconds() - before >= 0.6
    assert os.times().children_user - children < 0.5  # the kernel's count alone would have missed it
