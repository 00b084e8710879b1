"""The fault policy of stage 1 in a real Ray job: transient errors are retried, a shard that keeps
failing stops the job or is skipped and recorded, and a rerun scores it. The faults are injected on
purpose (``VOCAGNO_INJECT_FAULTS``, :mod:`pipeline.score_teacher.faults`) inside the real scorer
actors; everything else is real (Ray, the micro teacher, Parquet). The reference is the session's
uninterrupted dataset of the same corpus and teacher (``micro_scored``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.runtime.config import UserError
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.faults import FAULTS_ENV
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.job import run_score_job
from pipeline.score_teacher.pool import ShardFailedError
from storage_schemas import file_sha256, read_manifest
from test_score_job import assert_same_dataset

REPO = Path(__file__).resolve().parents[2]


def _config(micro_teacher, micro_corpus, out: Path, **pool) -> ScoreJobConfig:
    """The micro_scored fixture's job (same identity, so the same shard bytes), one actor."""
    return ScoreJobConfig(
        teacher=TeacherConfig(name="micro", model=str(micro_teacher)),
        corpus=CorpusConfig(name="owm-micro", files=[str(f) for f in micro_corpus], rows_per_shard=40),
        scorer=ScorerConfig(max_batch_tokens=2048),
        output_dir=str(out),
        pool=PoolConfig(num_actors=1, num_cpus=1, **pool),
        progress=False,
    )


def _inject(monkeypatch, counters: Path, **shards) -> None:
    """Fail the first ``times`` tries at the given shards: ``_inject(..., s1=("oom", 2))``."""
    plan = {"counter_dir": str(counters), "shards": {k[1:]: {"error": e, "times": n} for k, (e, n) in shards.items()}}
    monkeypatch.setenv(FAULTS_ENV, json.dumps(plan))


def _tries(counters: Path, index: int) -> int:
    return len(list(counters.glob(f"shard-{index}.try-*")))


def _markers(out: Path) -> dict[int, dict]:
    return {int(p.name[6:12]): json.loads(p.read_text()) for p in out.glob("shard-*.done.json")}


@pytest.mark.long
def test_transient_faults_are_retried_and_the_dataset_is_unchanged(micro_teacher, micro_corpus, micro_scored,
                                                                    ray_local, tmp_path, monkeypatch):
    """CUDA out of memory twice on shard 1, a read error on shard 3, the actor's process exiting on
    shard 2 (Ray's own restarts are off): each shard is tried again (a fresh actor replaces the dead
    one) and the dataset equals the uninterrupted one byte for byte."""
    counters = tmp_path / "tries"
    _inject(monkeypatch, counters, s1=("oom", 2), s2=("die", 1), s3=("read", 1))
    out = tmp_path / "ds"
    summary = run_score_job(_config(micro_teacher, micro_corpus, out, shard_retries=2))
    assert summary.complete and summary.shards_scored == 4 and summary.failed == []
    assert [_tries(counters, i) for i in range(4)] == [0, 3, 2, 2]
    assert {i: m["scored_by"]["attempt"] for i, m in _markers(out).items()} == {0: 1, 1: 3, 2: 2, 3: 2}
    assert read_manifest(out)["failed"] == []
    assert_same_dataset(out, micro_scored)


@pytest.mark.long
def test_a_shard_that_keeps_failing_stops_the_job_by_default(micro_teacher, micro_corpus, ray_local, tmp_path,
                                                             monkeypatch):
    counters = tmp_path / "tries"
    _inject(monkeypatch, counters, s2=("read", 99))
    out = tmp_path / "ds"
    with pytest.raises(ShardFailedError, match="shard 2 failed after 2 tries") as err:
        run_score_job(_config(micro_teacher, micro_corpus, out, shard_retries=1))
    assert not isinstance(err.value, UserError), "a failing shard is not a user error: it keeps its traceback"
    assert "injected fault (read) at shard 2" in str(err.value)
    assert _tries(counters, 2) == 2
    manifest = read_manifest(out)
    assert not manifest["complete"] and 2 not in _markers(out)
    [failed] = manifest["failed"]
    assert failed["index"] == 2 and failed["attempts"] == 2 and "Input/output error" in failed["error"]


@pytest.mark.long
def test_skip_records_the_bad_shards_and_a_rerun_scores_them(micro_teacher, micro_corpus, micro_scored, ray_local,
                                                              tmp_path, monkeypatch):
    """on_bad_shard=skip: a shard failing on every try (read errors) is given up after 1 + shard_retries
    tries, one failing with a bug (TypeError, not transient) after one try; the others are scored.
    Without the faults, the rerun scores exactly the two and the dataset is the uninterrupted one."""
    counters = tmp_path / "tries"
    _inject(monkeypatch, counters, s0=("bug", 1), s2=("read", 99))
    out = tmp_path / "ds"
    cfg = _config(micro_teacher, micro_corpus, out, shard_retries=2, on_bad_shard="skip")
    summary = run_score_job(cfg)
    assert not summary.complete and summary.shards_scored == 2 and summary.shards_complete == 2
    assert [(f["index"], f["attempts"]) for f in summary.failed] == [(0, 1), (2, 3)]
    assert _tries(counters, 0) == 1 and _tries(counters, 2) == 3
    manifest = read_manifest(out)
    assert [(f["index"], f["attempts"]) for f in manifest["failed"]] == [(0, 1), (2, 3)]
    assert "TypeError" in manifest["failed"][0]["error"] or "injected fault (bug)" in manifest["failed"][0]["error"]
    assert sorted(e["index"] for e in manifest["shards"]) == [1, 3] and not manifest["complete"]
    for name in ("shard-000001.parquet", "shard-000003.parquet"):
        assert file_sha256(out / name) == file_sha256(micro_scored / name)

    monkeypatch.delenv(FAULTS_ENV)
    again = run_score_job(cfg)
    assert again.complete and again.shards_scored == 2 and again.shards_done_before == 2 and again.failed == []
    assert read_manifest(out)["failed"] == []
    assert_same_dataset(out, micro_scored)


def _stage(micro_teacher, micro_corpus, tmp_path: Path, *overrides: str, env: dict | None = None):
    """Stage 1's entry point on the micro teacher and corpus, its own local Ray of one CPU."""
    args = [sys.executable, "-m", "stages.score_teacher", "teacher=tiny", "teacher.embedded=false",
            "teacher.name=micro", f"teacher.model={micro_teacher}", "teacher.num_cpus=1", "teacher.stride=null",
            "data=sample", "data.embedded=false", f"data.files=[{','.join(map(str, micro_corpus))}]",
            "data.rows_per_shard=40", "ray.num_cpus=1", "pool.num_actors=1", "progress=false",
            f"output_dir={tmp_path / 'out'}", f"artifacts_dir={tmp_path / 'artifacts'}",
            f"hydra.run.dir={tmp_path / 'logs'}", *overrides]
    full_env = {**os.environ, "VOCAGNO_TRACEBACK": "", **(env or {})}
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600, env=full_env)


def test_stage_cli_user_errors_are_one_line_and_other_errors_keep_their_traceback(micro_teacher, micro_corpus,
                                                                                   tmp_path):
    """Through ``python -m stages.score_teacher``: a bad setting is the project's user error (one
    line, exit 2); CUDA running out of memory on every try (injected in the real actor) is not,
    and ends with its traceback and another exit code."""
    bad = _stage(micro_teacher, micro_corpus, tmp_path, "pool.on_bad_shard=sometimes")
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert bad.stderr.strip().splitlines() == ["error: pool.on_bad_shard: 'sometimes' is not one of stop, skip"]

    plan = {"counter_dir": str(tmp_path / "tries"), "shards": {"0": {"error": "oom", "times": 99}}}
    oom = _stage(micro_teacher, micro_corpus, tmp_path, "pool.shard_retries=1", env={FAULTS_ENV: json.dumps(plan)})
    assert oom.returncode not in (0, 2), oom.stderr[-3000:]
    assert "Traceback" in oom.stderr and "OutOfMemoryError" in oom.stderr, oom.stderr[-3000:]
    assert "shard 0 failed after 2 tries" in oom.stderr
    assert _tries(tmp_path / "tries", 0) == 2
    assert read_manifest(tmp_path / "out")["failed"][0]["index"] == 0
