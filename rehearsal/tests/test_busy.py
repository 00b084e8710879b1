"""The rehearsal flags a part's figures when other work shared the machine, not when its own
processes were what kept the cores busy; its own CPU includes the steps it waited for."""

from __future__ import annotations

import subprocess
import sys

from rehearsal.__main__ import busy_note, cpu_seconds


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


def test_the_cpu_of_a_step_waited_for_is_counted():
    before = cpu_seconds()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"],
                   check=True)
    assert cpu_seconds() - before >= 0.55
