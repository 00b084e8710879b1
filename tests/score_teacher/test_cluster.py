"""Stage 1 on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head
and worker nodes, each its own raylet with one CPU and a custom ``scorer`` resource), driven from a
child process as a user's driver would be: the actors are spread over the nodes, run the code
shipped by the job's runtime environment, each marker names the node that scored its shard, and the
dataset equals the one-node run byte for byte. A node in its own mount namespace (``unshare``), which
does not see the driver's teacher folder and output folder, is refused before anything is scored."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.runtime.config import ConfigError, UserError
from pipeline.score_teacher.pool import PoolConfig, num_actors
from pipeline.score_teacher.ray_cluster import actors_per_node
from storage_schemas import read_manifest
from test_score_job import assert_same_dataset

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import json, subprocess, sys, time
import ray
from ray.cluster_utils import Cluster
from pipeline.runtime.config import UserError
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.ray_cluster import RayConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.job import run_score_job

c = json.loads(sys.argv[1])
node = {"num_cpus": 1, "resources": {"scorer": 1}}
cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
for _ in range(c["workers"]):
    cluster.add_node(**node)
extra = None
if c.get("isolated_node"):  # one more node, started by `ray start` in its own mount namespace
    extra = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                              c["isolated_node"].replace("GCS_ADDRESS", cluster.address)], start_new_session=True)
ray.init(address=cluster.address)
deadline = time.time() + 120
while len([n for n in ray.nodes() if n["Alive"]]) < 1 + c["workers"] + bool(extra) and time.time() < deadline:
    time.sleep(0.5)
node_ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
ray.shutdown()
job = ScoreJobConfig(teacher=TeacherConfig(name="micro", model=c["teacher"]),
                     corpus=CorpusConfig(name="owm-micro", files=c["files"], rows_per_shard=40),
                     scorer=ScorerConfig(max_batch_tokens=2048), output_dir=c["output_dir"],
                     ray=RayConfig(address=cluster.address), pool=PoolConfig(num_cpus=1, resources={"scorer": 1}),
                     progress=False)
try:
    summary = run_score_job(job)
    result = {"nodes": node_ids, "complete": summary.complete, "actors": summary.actors}
except UserError as exc:
    result = {"nodes": node_ids, "user_error": str(exc)}
finally:
    if extra is not None:
        import os, signal
        os.killpg(extra.pid, signal.SIGTERM)
        extra.wait(timeout=60)
    cluster.shutdown()
print("RESULT " + json.dumps(result))
"""


def _drive(micro_teacher, micro_corpus, out: Path, workers: int, isolated_node: str | None = None) -> dict:
    payload = {"teacher": str(micro_teacher), "files": [str(f) for f in micro_corpus], "output_dir": str(out),
               "workers": workers, "isolated_node": isolated_node}
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(payload)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


# ---------------------------------------------------------------------------------------------
# How many actors a cluster holds (hand-worked)

NODES = [{"Resources": {"CPU": 8.0, "GPU": 2.0}}, {"Resources": {"CPU": 2.0, "GPU": 4.0}},
         {"Resources": {"CPU": 16.0, "scorer": 1.0}}]


def test_actor_count_is_summed_node_by_node_over_gpus_cpus_and_resources():
    # GPU actors of 2 CPUs: node 1 holds min(8/2, 2/1) = 2, node 2 min(2/2, 4/1) = 1, node 3 none:
    # 3, where the cluster's totals (6 GPUs, 26 CPUs) would say 6 and leave 3 waiting forever.
    assert num_actors(PoolConfig(num_gpus=1, num_cpus=2), NODES) == 3
    assert num_actors(PoolConfig(num_gpus=0.5, num_cpus=1), NODES) == 4 + 2  # half a GPU each
    assert num_actors(PoolConfig(num_cpus=3), NODES) == 2 + 0 + 5  # not 26 // 3 = 8
    assert num_actors(PoolConfig(num_cpus=1, resources={"scorer": 1}), NODES) == 1
    assert num_actors(PoolConfig(num_gpus=1, num_cpus=2, num_actors=2), NODES) == 2
    assert num_actors(PoolConfig(num_gpus=1, num_cpus=2, num_actors=10), NODES) == 3  # capped, with a warning
    assert actors_per_node({"CPU": 4.0}, {}) == 1
    with pytest.raises(ConfigError, match="no node of the Ray cluster has that much") as err:
        num_actors(PoolConfig(num_gpus=1, num_cpus=1, resources={"scorer": 1}), NODES)
    assert isinstance(err.value, UserError) and "GPU=1" in str(err.value) and "scorer=1" in str(err.value)


# ---------------------------------------------------------------------------------------------
# A real cluster


@pytest.mark.slow
def test_three_node_cluster_puts_an_actor_on_each_node_records_nodes_and_equals_one_node_run(
        micro_teacher, micro_corpus, micro_scored, tmp_path):
    out = tmp_path / "ds"
    result = _drive(micro_teacher, micro_corpus, out, workers=2)
    assert result["complete"] and len(result["nodes"]) == 3
    actors = result["actors"]
    assert sorted(a["node_id"] for a in actors) == result["nodes"], "one actor on each node"
    for actor in actors:  # the code the actors ran came with the job, not from this checkout
        assert not actor["code"].startswith(str(REPO)) and "runtime_resources" in actor["code"], actor["code"]
    manifest = read_manifest(out)
    scored_by = {e["index"]: e["scored_by"] for e in manifest["shards"]}
    assert sorted(scored_by) == [0, 1, 2, 3]
    # Shards go to whichever actor is free first, so on a loaded machine an actor that loads late may
    # score none of the 4: each shard names a node whose actor ran, not necessarily every node.
    assert {s["node_id"] for s in scored_by.values()} <= set(result["nodes"]), "a shard names a node of the cluster"
    assert all(s["node_ip"] and s["hostname"] and s["attempt"] == 1 for s in scored_by.values())
    assert_same_dataset(out, micro_scored)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_node_that_does_not_see_the_local_paths_is_refused_before_scoring(micro_teacher, micro_corpus, tmp_path):
    """The extra node runs in a mount namespace where the teacher folder and the output folder's
    parent are empty tmpfs mounts: a node with its own disks, as on a cluster sharing nothing."""
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            f"mount -t tmpfs tmpfs {tmp_path}"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a new mount namespace here: {probe.stderr.strip()}")
    out = tmp_path / "outputs" / "ds"
    out.parent.mkdir()
    ray_bin = Path(sys.executable).with_name("ray")
    node = (f"mount -t tmpfs tmpfs {micro_teacher} && mount -t tmpfs tmpfs {out.parent} && "
            f"exec {ray_bin} start --address=GCS_ADDRESS --num-cpus=1 --resources='{{\"scorer\": 1}}' "
            "--disable-usage-stats --block")
    result = _drive(micro_teacher, micro_corpus, out, workers=1, isolated_node=node)
    assert len(result["nodes"]) == 3, result
    message = result["user_error"]
    n_files = len([p for p in micro_teacher.iterdir() if p.is_file()])
    assert "do not all see the local files" in message and f"{micro_teacher}: {n_files} of the driver's files missing" in message
    assert f"{out} (the output folder" in message and "s3://" in message
    problem_lines = [ln for ln in message.splitlines() if ln.startswith("  node ")]
    assert len(problem_lines) == 1, "only the isolated node is named"
    assert not list(out.glob("shard-*")), "nothing was scored"
