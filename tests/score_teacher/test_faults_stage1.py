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

from pipeline.folders.output_folder import StorageError
from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.job import run_score_job
from pipeline.score_teacher.backends.base import ScorerConfig
from storage_schemas import file_sha256, read_manifest
from test_score_job import assert_same_dataset

DRIVER = """
import json, sys
from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.ray_cluster import RayConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.job import run_score_job
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


def _assert_listed_shards_intact(out: Path) -> dict:
    """Readers never see a partial shard: every shard the manifest lists, and every shard with a
    marker, is on disk with the size and sha256 recorded for it. Returns the manifest."""
    manifest = read_manifest(out)
    markers = {p.name: json.loads(p.read_text()) for p in out.glob("shard-*.done.json")}
    listed = {e["file"] for e in manifest["shards"]}
    assert listed <= {m["file"] for m in markers.values()}, "the manifest lists only marked shards"
    for entry in [*manifest["shards"], *markers.values()]:
        path = out / entry["file"]
        assert path.stat().st_size == entry["bytes"] and file_sha256(path) == entry["sha256"], entry["file"]
    return manifest


def _wait_for_markers(out: Path, count: int, proc: subprocess.Popen, timeout: float = 600) -> int:
    """Poll until at least ``count`` shards carry a completion marker; returns how many do."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = len(list(out.glob("shard-*.done.json"))) if out.exists() else 0
        if n >= count:
            return n
        assert proc.poll() is None, f"the job ended before {count} shards were marked"
        time.sleep(0.01)
    raise AssertionError(f"{count} marked shards not seen within {timeout} s")


def _kill_rerun_loop(micro_teacher, micro_corpus, tmp_path, kills: int, seed: int, early_kills: int = 0):
    """Kill the driver (and its Ray cluster) ``kills`` times and rerun it after each; the final
    dataset must equal an uninterrupted run's. The first ``early_kills`` land at a random moment of
    start-up; the others as soon as a chosen number of shards (more each time, never all) carry
    their marker, so later runs resume from partial output. Returns the marked shards at each kill."""
    reference = tmp_path / "reference"
    ref_cfg = _config(micro_teacher, micro_corpus, reference)
    proc = _spawn(ref_cfg)
    assert proc.wait(timeout=600) == 0
    planned = read_manifest(reference)["n_shards_planned"]
    out = tmp_path / "killed"
    cfg = _config(micro_teacher, micro_corpus, out)
    rng = random.Random(seed)
    late = kills - early_kills
    targets = sorted(rng.sample(range(1, planned), late))  # cumulative marked shards at each late kill
    marked_at_kill = []
    for k in range(kills):
        proc = _spawn(cfg)
        if k < early_kills:
            time.sleep(rng.uniform(0.5, 4.0))
        else:
            _wait_for_markers(out, targets[k - early_kills], proc)
        _kill_group(proc)
        marked = len(list(out.glob("shard-*.done.json"))) if out.exists() else 0
        assert marked < planned, "the kill must land before the last shard is marked"
        marked_at_kill.append(marked)
        if out.exists():
            assert not _assert_listed_shards_intact(out)["complete"]
    proc = _spawn(cfg)
    assert proc.wait(timeout=600) == 0
    manifest = _assert_listed_shards_intact(out)
    assert manifest["complete"] and len(manifest["shards"]) == planned and not list(out.glob(".*tmp*"))
    assert_same_dataset(out, reference)
    return marked_at_kill


@pytest.mark.slow
def test_driver_killed_and_rerun_gives_the_uninterrupted_dataset(micro_teacher, micro_corpus, tmp_path):
    """The short version: 3 SIGKILLs, each after more shards are marked, before the last. The
    default suite kills the driver once on s3 (test_object_store_e2e)."""
    marked = _kill_rerun_loop(micro_teacher, micro_corpus, tmp_path, kills=3, seed=0)
    print("marked shards at each kill:", marked)
    assert marked == sorted(marked) and marked[0] >= 1, marked


@pytest.mark.slow
def test_driver_killed_twenty_times(micro_teacher, micro_corpus, tmp_path):
    """5 kills during start-up, 15 after a growing number of marked shards."""
    marked = _kill_rerun_loop(micro_teacher, micro_corpus, tmp_path, kills=20, seed=1, early_kills=5)
    assert marked[5:] == sorted(marked[5:]) and marked[-1] < 16


@pytest.mark.long
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
    # whichever write meets the full disk first, a shard's or the manifest's periodic rewrite, says so in one line
    with pytest.raises(StorageError, match=r"(shard \d+|manifest\.json) could not be written: No space left on device"
                                           r".*free space there"):
        run_score_job(_config(micro_teacher, micro_corpus, out))
    markers = {p.name.split(".")[0] for p in out.glob("shard-*.done.json")}
    shards = {p.name.split(".")[0] for p in out.glob("shard-*.parquet")}
    assert markers == shards, "every shard file on disk is a finished one with its marker"
    assert not list(out.glob(".*tmp*")), "no half-written temporary file is left"
    manifest = read_manifest(out)
    # the manifest never lists a shard without its marker; with the disk full its last rewrite may fail
    # (a warning), so it can lag behind the markers, which hold the truth for the next run
    listed = {e["file"].split(".")[0] for e in manifest["shards"]}
    assert not manifest["complete"] and listed <= markers


def test_a_manifest_that_meets_a_full_disk_is_a_clear_error_and_the_old_one_stays(tiny_filesystem):
    """The manifest's rewrite (periodic, or at the end) on a disk that is full: the one-line storage
    error naming manifest.json, and the manifest written before is left whole (it was a bare OSError)."""
    from pipeline.score_teacher.writer import write_manifest

    out = tiny_filesystem(64) / "ds"
    out.mkdir()
    identity = {"corpus": {"n_shards": 2}}
    entry = {"index": 0, "file": "shard-00000.parquet", "rows": 1, "tokens": 5, "bytes": 9, "reasons": {}}
    write_manifest(out, identity, {0: entry}, 2)
    before = (out / "manifest.json").read_bytes()
    fd = os.open(out / "filler", os.O_WRONLY | os.O_CREAT)  # fill the disk to its last block, unbuffered
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    big = {i: {**entry, "index": i, "file": f"shard-{i:05d}.parquet", "reasons": {f"r{i}": 1}} for i in range(400)}
    with pytest.raises(StorageError, match=r"manifest\.json could not be written: No space left on device.*free space there"):
        write_manifest(out, identity, big, 400)
    assert (out / "manifest.json").read_bytes() == before
    assert not list(out.glob(".*tmp*")), "no half-written temporary file is left"


def test_read_only_output_folder_is_a_clear_error(micro_teacher, micro_corpus, ray_local, tiny_filesystem):
    out = tiny_filesystem(64, read_only=True) / "ds"
    with pytest.raises(OSError, match="Read-only file system"):
        run_score_job(_config(micro_teacher, micro_corpus, out))
