"""Stage 1 under faults: the driver SIGKILLed at random moments and rerun, a scorer actor killed
mid-shard, an unwritable output folder. Real processes, real Ray, real signals."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.job import PoolConfig, ScoreJobConfig, TeacherConfig, run_score_job
from pipeline.score_teacher.backends.base import ScorerConfig
from storage_schemas import read_manifest
from test_score_job import assert_same_dataset

DRIVER = """
import json, sys
from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.job import PoolConfig, RayConfig, ScoreJobConfig, TeacherConfig, run_score_job
from pipeline.score_teacher.backends.base import ScorerConfig
c = json.loads(sys.argv[1])
run_score_job(ScoreJobConfig(teacher=TeacherConfig(**c["teacher"]), corpus=CorpusConfig(**c["corpus"]),
    scorer=ScorerConfig(**c["scorer"]), pool=PoolConfig(**c["pool"]), ray=RayConfig(num_cpus=2),
    output_dir=c["output_dir"], progress=False, manifest_every_s=0.0))
"""


def _config(micro_teacher, micro_corpus, out: Path) -> ScoreJobConfig:
    return ScoreJobConfig(
        teacher=TeacherConfig(name="micro", model=str(micro_teacher)),
        corpus=CorpusConfig(name="micro", files=[str(f) for f in micro_corpus], rows_per_shard=10),
        scorer=ScorerConfig(max_batch_tokens=2048),
        output_dir=str(out),
        pool=PoolConfig(num_actors=1, num_cpus=1),
        progress=False,
    )


def _spawn(cfg: ScoreJobConfig) -> subprocess.Popen:
    payload = json.dumps({"teacher": asdict(cfg.teacher), "corpus": asdict(cfg.corpus), "scorer": asdict(cfg.scorer),
                          "pool": asdict(cfg.pool), "output_dir": cfg.output_dir})
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", DRIVER, payload], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and everything it started (its local Ray cluster included)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _kill_rerun_loop(micro_teacher, micro_corpus, tmp_path, kills: int, seed: int):
    reference = tmp_path / "reference"
    ref_cfg = _config(micro_teacher, micro_corpus, reference)
    proc = _spawn(ref_cfg)
    assert proc.wait(timeout=600) == 0
    out = tmp_path / "killed"
    cfg = _config(micro_teacher, micro_corpus, out)
    rng = random.Random(seed)
    seen_partial = 0
    for _ in range(kills):
        proc = _spawn(cfg)
        time.sleep(rng.uniform(1.0, 9.0))
        _kill_group(proc)
        if out.exists():
            # readers never see a partial shard: every listed shard matches its checksum
            manifest = read_manifest(out)
            seen_partial += not manifest["complete"]
    proc = _spawn(cfg)
    assert proc.wait(timeout=600) == 0
    manifest = read_manifest(out)
    assert manifest["complete"] and not list(out.glob(".*tmp*"))
    assert_same_dataset(out, reference)
    return seen_partial


def test_driver_killed_and_rerun_gives_the_uninterrupted_dataset(micro_teacher, micro_corpus, tmp_path):
    """The short version CI runs: 3 kills at random moments."""
    _kill_rerun_loop(micro_teacher, micro_corpus, tmp_path, kills=3, seed=0)


@pytest.mark.slow
def test_driver_killed_twenty_times(micro_teacher, micro_corpus, tmp_path):
    partial = _kill_rerun_loop(micro_teacher, micro_corpus, tmp_path, kills=20, seed=1)
    assert partial > 0, "the kills must land while the job is running"


def test_actor_killed_mid_shard_is_restarted_and_the_shard_redone(micro_teacher, micro_corpus, ray_local, tmp_path):
    import psutil

    cfg = _config(micro_teacher, micro_corpus, tmp_path / "ds")
    killed = []

    def kill_first_scorer():
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            # only this test's own Ray cluster: processes descended from this test process
            for p in psutil.Process(os.getpid()).children(recursive=True):
                try:
                    title = " ".join(p.cmdline()) + " " + p.name()
                except psutil.Error:
                    continue
                if "ShardScorer" in title:
                    if any((tmp_path / "ds").glob("shard-*.done.json")):  # mid-job, after a first shard
                        p.send_signal(signal.SIGKILL)
                        killed.append(p.pid)
                        return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_first_scorer)
    killer.start()
    summary = run_score_job(cfg)
    killer.join()
    assert killed, "the scorer actor was never seen"
    assert summary.complete and summary.shards_scored == summary.shards_planned
    assert_same_dataset(tmp_path / "ds", _reference(micro_teacher, micro_corpus, tmp_path))


def _reference(micro_teacher, micro_corpus, tmp_path) -> Path:
    out = tmp_path / "reference"
    run_score_job(_config(micro_teacher, micro_corpus, out))
    return out


@pytest.fixture
def tiny_filesystem(tmp_path):
    """Mount a small tmpfs (needs root and mount rights; skipped where they are missing)."""
    mounted = []

    def mount(size_kb: int, read_only: bool = False) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        options = f"size={size_kb}k" + (",ro" if read_only else "")
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_disk_full_is_a_clear_error_and_no_shard_looks_complete(micro_teacher, micro_corpus, ray_local, tiny_filesystem):
    out = tiny_filesystem(300) / "ds"
    with pytest.raises(RuntimeError, match="No space left on device"):
        run_score_job(_config(micro_teacher, micro_corpus, out))
    markers = {p.name.split(".")[0] for p in out.glob("shard-*.done.json")}
    shards = {p.name.split(".")[0] for p in out.glob("shard-*.parquet")}
    assert markers == shards, "every shard file on disk is a finished one with its marker"
    assert not list(out.glob(".*tmp*")), "no half-written temporary file is left"
    manifest = read_manifest(out)
    assert not manifest["complete"] and len(manifest["shards"]) == len(markers)


def test_read_only_output_folder_is_a_clear_error(micro_teacher, micro_corpus, ray_local, tiny_filesystem):
    out = tiny_filesystem(64, read_only=True) / "ds"
    with pytest.raises(OSError, match="Read-only file system"):
        run_score_job(_config(micro_teacher, micro_corpus, out))
