"""The rehearsal's process roles: a real process tree sampled by ``TreeMonitor``, and a process read
while it is torn down (its command line empty before it is a zombie) keeping the role it had."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from rehearsal.measure import ProcessPeak, TreeMonitor, relabel, role_of

ROOT = ["python", "-m", "stages.score_teacher"]


def test_an_empty_command_line_keeps_the_role_a_process_had():
    actor = ProcessPeak(7, "scorer actor", "ray::ShardScorer.score_shard")
    for torn_down in ([], [""], ["", ""]):
        relabel(actor, torn_down, ROOT, parent_is_root=False)
        assert (actor.role, actor.command) == ("scorer actor", "ray::ShardScorer.score_shard")
    worker = ProcessPeak(8, "ray worker", "ray::IDLE")
    relabel(worker, ["ray::ShardScorer.load", "", ""], ROOT, parent_is_root=False)
    assert worker.role == "scorer actor"
    relabel(worker, ["ray::ShardScorer"], ROOT, parent_is_root=False)
    assert worker.role == "scorer actor"


def test_roles_from_command_lines():
    assert role_of(["ray::IDLE"], ROOT, False) == "ray worker"
    assert role_of(["ray::DashboardAgent"], ROOT, False) == "ray DashboardAgent"
    assert role_of(["/x/ray/core/src/ray/raylet/raylet", "--flag"], ROOT, False) == "raylet"
    assert role_of(ROOT, ROOT, True) == "forked worker"
    assert role_of(ROOT, ROOT, False) == "other"  # the driver's command line, but not its child
    assert role_of([], ROOT, False) == "other"


def test_a_real_tree_is_sampled_by_role(tmp_path):
    """A parent that spawns two workers (multiprocessing's spawn) and forks one child of its own."""
    script = textwrap.dedent("""
        import multiprocessing as mp, os, time
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            workers = [ctx.Process(target=time.sleep, args=(4,)) for _ in range(2)]
            for w in workers:
                w.start()
            if os.fork() == 0:
                time.sleep(4)
                os._exit(0)
            os.wait()
            for w in workers:
                w.join()
    """)
    (tmp_path / "tree.py").write_text(script)
    child = subprocess.Popen([sys.executable, str(tmp_path / "tree.py")])
    t0 = time.perf_counter()
    with TreeMonitor(child.pid, 0.05, {"started": lambda: True}, t0) as monitor:
        assert child.wait(timeout=60) == 0
    roles = monitor.roles()
    assert roles["driver"]["processes"] == 1 and roles["spawned worker"]["processes"] == 2, roles
    assert roles["forked worker"]["processes"] == 1, roles
    assert roles["spawned worker"]["peak_rss_mib"] > 1 and monitor.samples > 10
    assert set(monitor.events) == {"started"}
