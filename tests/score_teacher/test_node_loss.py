"""Stage 1 when the Ray cluster loses or gains nodes mid-job, on a real multi-node cluster on this
machine (``ray.cluster_utils.Cluster``: a head without CPUs, so it holds no actor, and worker nodes
of one CPU each), driven from a child process as a user's driver would be. Nodes are removed the
hard way (``allow_graceful=False``) at a fixed point: after the first shard's marker, while another
shard hangs on purpose (``VOCAGNO_INJECT_FAULTS`` ``hang``) on the node that goes. The reference is
the session's one-node run of the same corpus and teacher (``micro_scored``, 4 shards)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.runtime.config import UserError
from pipeline.score_teacher.faults import FAULTS_ENV
from pipeline.score_teacher.pool import ActorStartError, PoolConfig, ResourcesUnavailableError, run_shards
from storage_schemas import file_sha256, read_manifest
from test_score_job import assert_same_dataset

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import glob, json, logging, os, shutil, signal, subprocess, sys, threading, time
from ray.cluster_utils import Cluster
from pipeline.runtime.config import UserError
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.ray_cluster import RayConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.job import run_score_job

c = json.loads(sys.argv[1])
logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(name)s: %(message)s")
# A node the GCS stops hearing from is declared dead after ~3 s instead of ~15 s (Ray's defaults).
fast = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                        "_system_config": fast})
workers = [cluster.add_node(num_cpus=1) for _ in range(c["workers"])]
cluster.wait_for_nodes()
out, tries = c["output_dir"], c["counter_dir"]
events = {"nodes": [w.node_id for w in workers]}
extra = []  # nodes started by `ray start`

def until(test, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not test():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)

def markers():
    return [json.load(open(p)) for p in glob.glob(os.path.join(out, "shard-*.done.json"))]

def scenario():
    until(lambda: markers() and os.path.exists(os.path.join(tries, "shard-1.try-1")), "a first marker and shard 1 hanging")
    hung_on = open(os.path.join(tries, "shard-1.try-1")).read()
    events["hung_on"] = hung_on
    if c["scenario"] == "lose_one":
        cluster.remove_node(next(w for w in workers if w.node_id == hung_on), allow_graceful=False)
    elif c["scenario"] == "lose_all":
        for w in workers:
            cluster.remove_node(w, allow_graceful=False)
        events["removed_with"] = sorted(m["index"] for m in markers())
    elif c["scenario"] == "add_one":  # by `ray start`: Cluster.add_node works from the main thread only
        extra.append(subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start",
                                       "--address=" + cluster.address, "--num-cpus=1", "--disable-usage-stats",
                                       "--block"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
        def new_nodes():
            return {m["scored_by"]["node_id"] for m in markers()} - set(events["nodes"])
        until(new_nodes, "a shard scored on the new node")
        events["added"] = new_nodes().pop()
        open(c["release"], "w").close()

def run():
    job = ScoreJobConfig(teacher=TeacherConfig(name="micro", model=c["teacher"]),
                         corpus=CorpusConfig(name="owm-micro", files=c["files"], rows_per_shard=40),
                         scorer=ScorerConfig(max_batch_tokens=2048), output_dir=out,
                         ray=RayConfig(address=cluster.address), pool=PoolConfig(**c["pool"]), progress=False)
    try:
        s = run_score_job(job)
        return {"complete": s.complete, "scored": s.shards_scored, "done_before": s.shards_done_before,
                "actors": [a["node_id"] for a in s.actors]}
    except UserError as exc:
        return {"user_error": str(exc)}

thread = threading.Thread(target=scenario, daemon=True)
thread.start()
result = {"first": run()}
thread.join(timeout=5)
result["events"] = events
if c["scenario"] == "lose_all":
    result["markers_after_error"] = sorted(m["index"] for m in markers())
    shutil.copytree(out, out + "-after-error")  # the folder as the failed run left it
    events["back"] = cluster.add_node(num_cpus=1).node_id
    cluster.wait_for_nodes()
    result["rerun"] = run()
for proc in extra:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
cluster.shutdown()
print("RESULT " + json.dumps(result))
"""


def _drive(micro_teacher, micro_corpus, tmp_path: Path, scenario: str, workers: int, hang: dict,
           timeout: float = 300, **pool) -> tuple[dict, str]:
    """Run the driver in its own process group (killed whole when it overruns ``timeout``); returns
    its result and its log. ``hang`` maps shard indexes to how their first try hangs (shard 1's is
    where the scenario acts)."""
    counters = tmp_path / "tries"
    payload = {"teacher": str(micro_teacher), "files": [str(f) for f in micro_corpus],
               "output_dir": str(tmp_path / "ds"), "counter_dir": str(counters), "release": str(tmp_path / "release"),
               "workers": workers, "scenario": scenario, "pool": {"num_cpus": 1, **pool}}
    plan = {"counter_dir": str(counters), "shards": {str(i): {"error": "hang", "times": 1, **h} for i, h in hang.items()}}
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", FAULTS_ENV: json.dumps(plan),
           "RAY_memory_monitor_refresh_ms": "0"}  # no OOM kills when other work on the machine takes memory
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(payload)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its cluster's processes
        output, _ = proc.communicate()
        raise AssertionError(f"the job did not finish within {timeout} s:\n{output[-6000:]}") from None
    lines = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, output[-6000:]
    return json.loads(lines[-1][len("RESULT "):]), output


def _markers(out: Path) -> dict[int, dict]:
    return {int(p.name[6:12]): json.loads(p.read_text()) for p in out.glob("shard-*.done.json")}


def _assert_marked_shards_intact(out: Path) -> dict:
    """Every marker names a file on disk of its recorded size and sha256; the manifest lists only
    marked shards. Returns the manifest."""
    manifest = read_manifest(out)
    markers = _markers(out)
    assert {e["index"] for e in manifest["shards"]} <= set(markers)
    for entry in markers.values():
        path = out / entry["file"]
        assert path.stat().st_size == entry["bytes"] and file_sha256(path) == entry["sha256"], entry["file"]
    return manifest


def test_pool_wait_settings_are_validated():
    assert PoolConfig().wait_for_resources_s == 600 and PoolConfig().wait_log_every_s == 60
    for bad in ({"wait_for_resources_s": 0}, {"wait_log_every_s": -1}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}: .* must be > 0"):
            PoolConfig(**bad)


def _toy_actor(ray, load_error: OSError | None = None, **options):
    """A stand-in scorer (defined here, so Ray ships it by value): placed, loads, scores nothing."""
    class Toy:
        def describe(self):
            return {"node_id": ray.get_runtime_context().get_node_id()}

        def load(self):
            if load_error is not None:
                raise load_error
            return self.describe()

        def score_shard(self, spec, attempt):
            return {"index": spec.index, "attempt": attempt}

    return ray.remote(Toy).options(max_restarts=0, **options)


def test_no_node_holding_an_actor_is_waited_for_visibly_then_named_in_one_line(ray_local, caplog):
    """On the local one-node cluster, actors that ask for a resource no node has: nothing is
    created, the wait is logged with what one actor asks for, and ends after the bound."""
    toy = _toy_actor(ray_local, num_cpus=1, resources={"tpu_slice": 1})
    pool = PoolConfig(num_cpus=1, resources={"tpu_slice": 1}, wait_for_resources_s=1, wait_log_every_s=0.5)
    statuses = []
    with caplog.at_level("WARNING", logger="pipeline.score_teacher.pool"):
        with pytest.raises(ResourcesUnavailableError) as err:
            run_shards(toy.remote, [SimpleNamespace(index=0)], pool, lambda *a: None, lambda *a: None,
                       on_status=statuses.append)
    message = str(err.value)
    assert isinstance(err.value, UserError) and len(message.splitlines()) == 1
    assert "one actor asks for CPU=1, tpu_slice=1" in message and "tpu_slice=0" in message
    assert statuses == ["waiting for resources (CPU=1, tpu_slice=1 per actor)"]
    assert any("waiting for resources since" in r.getMessage() and "0 placed, 1 shard left" in r.getMessage()
               for r in caplog.records)


def test_an_actor_that_cannot_load_the_teacher_stops_the_job(ray_local):
    """A load error that another try will not fix stops the job at once; a transient one is tried
    on a fresh actor, 1 + ``pool.shard_retries`` times in a row."""
    pool = PoolConfig(num_actors=1, num_cpus=1, shard_retries=1)
    gone = _toy_actor(ray_local, OSError(errno.ENOENT, "no such teacher folder"), num_cpus=1)
    with pytest.raises(ActorStartError, match=r"\(1 in a row\).*no such teacher folder"):
        run_shards(gone.remote, [SimpleNamespace(index=0)], pool, lambda *a: None, lambda *a: None)
    flaky = _toy_actor(ray_local, OSError(errno.EIO, "read error"), num_cpus=1)
    with pytest.raises(ActorStartError, match=r"\(2 in a row\).*read error"):
        run_shards(flaky.remote, [SimpleNamespace(index=0)], pool, lambda *a: None, lambda *a: None)
    fine = _toy_actor(ray_local, num_cpus=1)
    run = run_shards(fine.remote, [SimpleNamespace(index=i) for i in range(3)], pool, lambda *a: None, lambda *a: None)
    assert sorted(e["index"] for e in run.scored) == [0, 1, 2] and len(run.actors) == 1


@pytest.mark.slow
def test_a_worker_node_lost_mid_job_the_job_finishes_on_the_other(micro_teacher, micro_corpus, micro_scored,
                                                                 tmp_path):
    """Two 1-CPU workers; the node where shard 1 hangs is removed after the first marker, while the
    other node's actor is held a few seconds more on shard 2. Shard 1 fails (actor unavailable) and
    goes to the surviving actor; no replacement can be placed (the surviving actor holds the only
    CPU), the pool shrinks to one actor, and the job ends on one node."""
    result, output = _drive(micro_teacher, micro_corpus, tmp_path, "lose_one", workers=2, num_actors=2,
                            hang={1: {}, 2: {"seconds": 8}})
    first, events = result["first"], result["events"]
    assert first.get("complete"), (first, output[-4000:])
    lost = events["hung_on"]
    survivor = next(n for n in events["nodes"] if n != lost)
    out = tmp_path / "ds"
    markers = _markers(out)
    assert sorted(markers) == [0, 1, 2, 3] and first["scored"] == 4, "every shard scored once in this run"
    assert markers[1]["scored_by"]["node_id"] == survivor and markers[1]["scored_by"]["attempt"] == 2
    assert {m["scored_by"]["node_id"] for i, m in markers.items() if i != 1} <= {lost, survivor}
    assert "shard 1 failed (try 1 of 3), trying again" in output
    assert "the alive nodes now hold 1 scorer actor of CPU=1 (were 2)" in output, "the pool shrank"
    assert read_manifest(out)["complete"]
    assert_same_dataset(out, micro_scored)


@pytest.mark.slow
def test_every_worker_node_lost_the_wait_ends_in_one_line_and_a_rerun_completes(micro_teacher, micro_corpus,
                                                                              micro_scored, tmp_path):
    """Both workers are removed after the first marker: no node can hold an actor. The pool says what
    it waits for every second (``pool.wait_log_every_s``) and stops after ``wait_for_resources_s``
    with one line naming the missing CPU; the finished shards stay complete; once a node is back a
    rerun scores only the rest and equals the one-node run."""
    result, output = _drive(micro_teacher, micro_corpus, tmp_path, "lose_all", workers=2, hang={1: {}}, num_actors=2,
                            wait_for_resources_s=8, wait_log_every_s=1)
    message = result["first"]["user_error"]
    assert len(message.splitlines()) == 1, message
    assert message.startswith("no scorer actor could be placed for ") and "(pool.wait_for_resources_s=8)" in message
    assert "one actor asks for CPU=1" in message and "no alive node has that much" in message and "CPU=0" in message
    assert "a rerun resumes" in message
    waits = [ln for ln in output.splitlines() if "waiting for resources since" in ln]
    assert waits and all("asks for CPU=1" in ln for ln in waits), output[-4000:]
    out, after_error = tmp_path / "ds", tmp_path / "ds-after-error"
    marked = result["markers_after_error"]
    assert marked and 1 not in marked, "shard 1 hung on a lost node"
    manifest = _assert_marked_shards_intact(after_error)
    assert not manifest["complete"] and sorted(e["index"] for e in manifest["shards"]) == marked
    for i in marked:  # kept by the rerun as they were
        assert _markers(out)[i]["sha256"] == _markers(after_error)[i]["sha256"]
    rerun = result["rerun"]
    assert rerun["complete"] and rerun["done_before"] == len(marked) and rerun["scored"] == 4 - len(marked)
    assert rerun["actors"] == [result["events"]["back"]]
    assert _markers(out)[1]["scored_by"]["attempt"] == 1, "a new run counts its own tries"
    assert_same_dataset(out, micro_scored)


@pytest.mark.slow
def test_a_node_added_mid_job_takes_work(micro_teacher, micro_corpus, micro_scored, tmp_path):
    """One 1-CPU worker; shard 1 hangs on it until a second node, added after the first marker, has
    scored a shard: the pool grows to the new node (``pool.num_actors`` unset: as many as the nodes
    hold) and its actor takes the shards left."""
    result, output = _drive(micro_teacher, micro_corpus, tmp_path, "add_one", workers=1,
                            hang={1: {"release": str(tmp_path / "release"), "seconds": 240}})
    first, events = result["first"], result["events"]
    assert first.get("complete"), (first, output[-4000:])
    out = tmp_path / "ds"
    nodes = {i: m["scored_by"]["node_id"] for i, m in _markers(out).items()}
    assert nodes[0] == nodes[1] == events["nodes"][0] and events["added"] in nodes.values()
    assert sorted(first["actors"]) == sorted([events["nodes"][0], events["added"]])
    assert first["scored"] == 4 and all(m["scored_by"]["attempt"] == 1 for m in _markers(out).values())
    assert_same_dataset(out, micro_scored)
