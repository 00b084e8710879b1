"""Both stages and the export against an object store that throttles and drops: moto's S3 server
behind the faulty proxy (local_s3/faults.py: 503 SlowDown to 10% of requests, 2% of connections
reset halfway through the answer, 2% of answers 2 s late), each stage in a process of its own, as a
user runs it, with real Ray, the micro teacher and corpus and a tiny real student.

Stage 1 writes to s3:// through the proxy; the store goes down once the first shard is marked, and
the job must end with one line (exit 75) leaving nothing half-written listed; once the store is back
the same job finishes, through the faults, with the dataset of a local scoring without faults, byte
for byte. Its summary counts the S3 client's retries, and they are exactly the faults the proxy
injected into its requests. Stage 2 and the export read that dataset through the faults and equal
runs on the local copy without any.

The objects are checked with boto3 against the server itself, not through the proxy and not with the
pyarrow file systems the code under test uses."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage_schemas import dataset_dir, marker_of, read_manifest

pytest.importorskip("moto.server", reason="moto[server] is not installed")

REPO = Path(__file__).resolve().parents[1]
FAULTS = dict(slowdown=0.10, reset=0.02, delay=0.02, delay_s=2.0)
# Seeds whose first 20 draws hold at least two throttled requests and a dropped one (the k-th request
# gets the k-th draw, whichever process sends it), so every run below meets both faults.
SEEDS = {"score": 20, "train": 9, "export": 12}
OUTAGE_ATTEMPTS = "3"  # AWS_MAX_ATTEMPTS while the store is down: the job gives up after a few seconds

def job(a: dict):
    """The run function and job of one stage for the arguments ``a`` (the same in a child process)."""
    if a["stage"] == "score":
        from pipeline.score_teacher.backends.base import ScorerConfig
        from pipeline.score_teacher.corpus import CorpusConfig
        from pipeline.score_teacher.pool import PoolConfig
        from pipeline.score_teacher.ray_cluster import RayConfig
        from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
        from pipeline.score_teacher.job import run_score_job
        return run_score_job, ScoreJobConfig(
            teacher=TeacherConfig(name="micro", model=a["teacher"]),
            corpus=CorpusConfig(name="owm-micro", files=a["corpus"], rows_per_shard=40),
            scorer=ScorerConfig(max_batch_tokens=2048), output_dir=a["out"], ray=RayConfig(num_cpus=2),
            pool=PoolConfig(num_actors=1, num_cpus=1), progress=False, manifest_every_s=0.0)
    if a["stage"] == "train":
        from pipeline.train_student.config import DataConfig, StudentConfig, TrainConfig, TrainJobConfig
        from pipeline.train_student.run import run_training
        return run_training, TrainJobConfig(
            student=StudentConfig(name="t", model=a["student"], seq_len=32),
            data=DataConfig(folders=[a["scored"]], cache_dir=a["cache"], num_workers=a["workers"]),
            train=TrainConfig(micro_batch_size=4, gradient_accumulation_steps=2, max_steps=3, learning_rate=3e-3,
                              min_learning_rate=3e-4, warmup_steps=1, logging_steps=1, save_steps=3, report_to=[],
                              progress=False, use_cpu=True, cpu_threads=1),
            output_dir=a["out"])
    from pipeline.export_student.config import DataConfig, ExportConfig, ExportJobConfig, StudentConfig
    from pipeline.export_student.job import run_export
    return run_export, ExportJobConfig(
        student=StudentConfig(name="t", model=a["student"], seq_len=32),
        data=DataConfig(folders=[a["scored"]], cache_dir=a["cache"]),
        export=ExportConfig(rows_per_shard=16, progress=False, formats=["parquet", "megatron"]),
        output_dir=a["out"])


# One stage run as the entry points run it (stages.common.exit_on_user_error), its summary printed last.
RUNNER = """
import json, sys
sys.path.insert(0, "tests")
from stages.common import exit_on_user_error
from test_object_store_faults import job

@exit_on_user_error
def main():
    run, config = job(json.loads(sys.argv[1]))
    print("SUMMARY " + json.dumps(run(config).__dict__, default=str))

main()
"""


def spawn(env: dict | None = None, **args) -> subprocess.Popen:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "VOCAGNO_TRACEBACK": "", **(env or {})}
    return subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(args)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, dict | None, str]:
    out, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("SUMMARY ")]
    return proc.returncode, json.loads(lines[-1][len("SUMMARY "):]) if lines else None, err


def objects(folder: str, endpoint: str) -> dict[str, bytes]:
    """Every object directly under ``folder`` by name, read with boto3 from the server itself."""
    import boto3

    bucket, prefix = folder[len("s3://"):].split("/", 1)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1:]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
            for o in listed if "/" not in o["Key"][len(prefix) + 1:] and not o["Key"].endswith("/")}


def metrics(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s")} for r in records if "loss_kept" in r]


@pytest.fixture(scope="module")
def faulty_scoring(s3_server, micro_teacher, micro_corpus, tmp_path_factory):
    """Stage 1 into s3 through the faults: a first run whose actor holds shard 1 (an injected hang)
    until shard 0 is marked and listed, the store is down and the hang released, so that the actor's
    write of shard 1 meets the outage; then the same job. Returns the dataset URI, the server's
    address, what the first run left and did, and the second's results."""
    from local_s3.faults import Faults, faulty_s3
    from pipeline.score_teacher.faults import FAULTS_ENV

    server = os.environ["AWS_ENDPOINT_URL"]
    out = dataset_dir(f"{s3_server()}/scored", "owm-micro", "micro")
    args = dict(stage="score", teacher=str(micro_teacher), corpus=[str(f) for f in micro_corpus], out=out)
    tries, release = tmp_path_factory.mktemp("tries"), tmp_path_factory.mktemp("hang") / "release"
    hang = {"counter_dir": str(tries), "shards": {"1": {"error": "hang", "times": 1, "release": str(release)}}}
    with faulty_s3(Faults(**FAULTS, seed=1)) as proxy:
        first = spawn({"AWS_MAX_ATTEMPTS": OUTAGE_ATTEMPTS, FAULTS_ENV: json.dumps(hang)}, **args)
        deadline = time.monotonic() + 600
        while "manifest.json" not in (left := objects(out, server)) or not json.loads(left["manifest.json"])["shards"]:
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "no shard listed within 600 s"
            time.sleep(0.2)
        proxy.down()
        release.touch()
        t_down = time.monotonic()
        code, summary, err = finish(first)
        outage = {"code": code, "summary": summary, "stderr": err, "seconds": time.monotonic() - t_down,
                  "left": objects(out, server), "tries_of_shard_1": len(list(tries.glob("shard-1.try-*")))}
    with faulty_s3(Faults(**FAULTS, seed=SEEDS["score"])) as proxy:  # the store is back, still throttling
        code, summary, err = finish(spawn(**args))
        assert code == 0, err[-3000:]
        injected = proxy.counts()
    return out, server, outage, summary, injected


@pytest.mark.long
def test_a_store_down_past_the_retries_ends_the_job_in_one_line_with_nothing_half_written(faulty_scoring):
    out, _, outage, _, _ = faulty_scoring
    assert outage["code"] == 75 and outage["summary"] is None
    err = outage["stderr"]
    assert "Traceback" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: the object store did not answer within {OUTAGE_ATTEMPTS} attempts per request"), err[-3000:]
    assert "SLOW_DOWN" in errors[0] or "HTTP status 503" in errors[0], errors[0]  # the store's own words
    assert errors[0].endswith("run the same command once the store answers"), errors[0]
    # the actor's write of shard 1 met it; the pool did not try the shard again (the client had)
    assert "shard 1: " in errors[0] and outage["tries_of_shard_1"] == 1, (errors[0], outage["tries_of_shard_1"])
    assert outage["seconds"] < 120  # a few attempts' backoff per request, not the default budget
    # Nothing half-written is taken for done: every marker names an object of its size and sha256,
    # a manifest (if one was written) lists only marked shards and says the dataset is incomplete.
    left = outage["left"]
    markers = {n: json.loads(b) for n, b in left.items() if n.endswith(".done.json")}
    assert [m["index"] for m in markers.values()] == [0]
    for name, entry in markers.items():
        assert marker_of(entry["file"]) == name and entry["file"] in left
        assert len(left[entry["file"]]) == entry["bytes"]
        assert hashlib.sha256(left[entry["file"]]).hexdigest() == entry["sha256"]
    if "manifest.json" in left:
        manifest = json.loads(left["manifest.json"])
        assert not manifest["complete"]
        assert {e["file"] for e in manifest["shards"]} <= {m["file"] for m in markers.values()}


@pytest.mark.long
def test_stage1_through_the_faults_equals_the_local_scoring_and_counts_every_retry(faulty_scoring, micro_scored):
    out, server, _, summary, injected = faulty_scoring
    assert summary["complete"] and summary["shards_scored"] >= 1
    remote, local = read_manifest(out), read_manifest(micro_scored)
    assert remote["identity"] == local["identity"] and remote["totals"] == local["totals"]
    keys = ("index", "rows", "tokens", "bytes", "sha256", "source", "reasons", "skipped")
    assert [{k: e[k] for k in keys} for e in remote["shards"]] == [{k: e[k] for k in keys} for e in local["shards"]]
    stored = objects(out, server)
    for entry, local_entry in zip(remote["shards"], local["shards"]):
        assert stored[entry["file"]] == (Path(micro_scored) / local_entry["file"]).read_bytes()
    expected = sorted(["manifest.json", "README.md", *(e["file"] for e in remote["shards"]),
                       *(marker_of(e["file"]) for e in remote["shards"])])
    assert sorted(stored) == expected  # no attempt of either run left over, no lock

    # The faults hit this run, and its summary counts each retry the S3 client made: every request
    # the proxy throttled or dropped was tried again, and every other request was answered.
    assert_every_retry_counted(summary["store_calls"], injected)


def assert_every_retry_counted(calls: dict, injected: dict) -> None:
    """The run met throttled and dropped requests (SEEDS), the S3 client tried each of them again,
    and the summary counts exactly those retries, by reason; every other request was answered."""
    assert injected["requests"] >= 20 and injected["slowdown"] >= 2 and injected["reset"] >= 1, injected
    assert calls["counted"] and calls["gave_up"] == 0
    assert calls["retries"] == injected["slowdown"] + injected["reset"], (calls, injected)
    assert calls["requests"] + calls["retries"] == injected["requests"], (calls, injected)
    reasons = calls["failed_attempts"]
    assert reasons.get("connection", 0) == injected["reset"], (calls, injected)
    assert reasons.get("SlowDown", 0) + reasons.get("HTTP 503", 0) == injected["slowdown"], (calls, injected)


@pytest.mark.long
def test_stage2_and_the_export_read_through_the_faults_as_from_the_local_copy(faulty_scoring, micro_scored,
                                                                              tiny_student, tmp_path):
    """Each reads the s3 dataset through faults of its own, in a process of its own (stage 2 in a
    data-loader worker too; both at once), while this process runs the same jobs on the local copy
    without any; what they write is the same."""
    from local_s3.faults import Faults, FaultyS3

    out, server, _, _, _ = faulty_scoring
    stages = ("train", "export")
    where = {(stage, side): tmp_path / stage / side for stage in stages for side in ("s3", "local")}
    args = {key: dict(stage=key[0], student=str(tiny_student), cache=str(path / "cache"), out=str(path / "out"),
                      workers=1 if key[1] == "s3" else 0) for key, path in where.items()}
    proxies = {stage: FaultyS3(server, Faults(**FAULTS, seed=SEEDS[stage])) for stage in stages}
    try:
        remote = {stage: spawn({"AWS_ENDPOINT_URL": proxies[stage].endpoint}, **args[stage, "s3"], scored=out)
                  for stage in stages}
        local = {}
        for stage in stages:  # meanwhile, the same jobs here on the local copy
            run, config = job({**args[stage, "local"], "scored": str(micro_scored)})
            local[stage] = run(config)
        ran = {stage: finish(remote[stage]) for stage in stages}
    finally:
        for proxy in proxies.values():
            proxy.close()
    for stage in stages:
        code, summary, err = ran[stage]
        assert code == 0, (stage, err[-3000:])
        assert_every_retry_counted(summary["store_calls"], proxies[stage].counts())
        s3_out, local_out = where[stage, "s3"] / "out", where[stage, "local"] / "out"
        if stage == "train":  # every logged figure of every step but the clock's, and the model
            assert summary["steps"] == local[stage].steps == 3
            assert metrics(s3_out) == metrics(local_out) and [r["step"] for r in metrics(s3_out)] == [1, 2, 3]
            files = ["final/model.safetensors"]
        else:  # the export's shard list, and every file of it
            assert summary["complete"] and local[stage].complete
            entries = json.loads((s3_out / "manifest.json").read_text())["shards"]
            assert entries == json.loads((local_out / "manifest.json").read_text())["shards"]
            files = sorted(p.name for p in s3_out.iterdir() if p.name.startswith("shard-"))
            assert files == sorted(p.name for p in local_out.iterdir() if p.name.startswith("shard-"))
            assert {e["file"] for e in entries} <= set(files)
        for name in files:
            assert (s3_out / name).read_bytes() == (local_out / name).read_bytes(), (stage, name)
