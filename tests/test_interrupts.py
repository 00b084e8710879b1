"""Ctrl-C and SIGTERM through the real command line: each stage ends with one line (no traceback),
exit status 130 or 143, its folder's lock released (the ``.lock`` file gone), nothing half-written
marked complete, and the same command resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage_schemas import file_sha256, read_manifest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def stage1_args(micro_teacher, micro_corpus, out: Path, logs: Path) -> list[str]:
    files = ",".join(str(f) for f in micro_corpus)
    return ["teacher.embedded=false", "teacher.name=micro", f"teacher.model={micro_teacher}", "teacher.stride=null", "data.embedded=false",
            "data.name=owm-micro", f"data.files=[{files}]", "data.rows_per_shard=10", "scorer.max_batch_tokens=2048",
            "pool.num_actors=1", "pool.num_cpus=1", "ray.num_cpus=2", "progress=false", f"output_dir={out}",
            f"hydra.run.dir={logs}"]


def start(stage: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"stages.{stage}", *args], cwd=REPO, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the stage ended before the signal: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting for the stage to make progress"
        time.sleep(0.2)


def interrupt(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    """Send ``sig`` to the stage's main process only (as a terminal's Ctrl-C or a scheduler's
    SIGTERM reaches it); returns its exit status and standard error."""
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind (there should be nothing)
        except ProcessLookupError:
            pass
    return proc.returncode, err


def assert_one_line(err: str, sig: int) -> None:
    assert "Traceback" not in err, err[-3000:]
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert last.startswith(f"interrupted ({signal.Signals(sig).name})"), err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stage1_interrupted_keeps_what_is_finished_and_resumes(micro_teacher, micro_corpus, tmp_path, sig):
    out = tmp_path / "scored"
    args = stage1_args(micro_teacher, micro_corpus, out, tmp_path / "logs")
    proc = start("score_teacher", args)
    wait_for(lambda: any(out.glob("shard-*.done.json")), proc)
    status, err = interrupt(proc, sig)
    assert status == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], err[-3000:]
    assert_one_line(err, sig)
    assert not (out / ".lock").exists(), "the lock is released and its file removed"
    manifest = read_manifest(out)
    markers = [json.loads(p.read_text()) for p in out.glob("shard-*.done.json")]
    assert not manifest["complete"] and markers
    for entry in markers:  # only finished shards are marked, each whole
        path = out / entry["file"]
        assert path.stat().st_size == entry["bytes"] and file_sha256(path) == entry["sha256"]
    assert not list(out.glob(".*.tmp-*")), "no temporary file left"
    rerun = subprocess.run([sys.executable, "-m", "stages.score_teacher", *args], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    done = read_manifest(out)
    assert done["complete"] and done["totals"]["shards"] == done["n_shards_planned"]
    assert {e["file"] for e in markers} <= {e["file"] for e in done["shards"]}, "finished shards were kept"


@pytest.mark.slow
def test_stage2_sigterm_releases_the_run_folder_and_resumes(tiny_student, micro_scored, tmp_path):
    run = tmp_path / "run"
    args = ["student.embedded=false", f"student.model={tiny_student}", "student.seq_len=32",
            f"data.folders=[{micro_scored}]", f"data.cache_dir={tmp_path / 'lengths'}", "data.num_workers=0",
            "train.micro_batch_size=4", "train.global_batch_tokens=256", "train.max_steps=40", "train.warmup_steps=1",
            "train.logging_steps=1", "train.save_steps=2", "train.use_cpu=true", "train.report_to=[]",
            "train.progress=false", "train.cpu_threads=1", f"output_dir={run}", f"hydra.run.dir={tmp_path / 'logs'}"]
    proc = start("train_student", args)
    wait_for(lambda: any(run.glob("checkpoint-*")), proc)
    status, err = interrupt(proc, signal.SIGTERM)
    assert status == 143, err[-3000:]
    assert_one_line(err, signal.SIGTERM)
    assert not (run / ".lock").exists()
    assert not (run / "final").exists(), "an interrupted run is not marked finished"
    rerun = subprocess.run([sys.executable, "-m", "stages.train_student", *args], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from checkpoint-" in rerun.stdout and (run / "final").is_dir()


def test_a_signal_that_arrives_while_ray_waits_is_reported_as_itself(ray_local, capsys):
    """Ray replaces the exception our SIGTERM handler raises while ``ray.get`` waits with a plain
    KeyboardInterrupt; the entry point still reports the signal that came (a scheduler's SIGTERM:
    ``interrupted (SIGTERM)``, exit status 143), not SIGINT."""
    import threading

    from stages.common import exit_on_user_error

    @ray_local.remote(num_cpus=0)
    def wait() -> None:
        time.sleep(120)

    ref = wait.remote()

    @exit_on_user_error
    def main() -> None:
        threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        ray_local.get(ref)

    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:
        ray_local.cancel(ref, force=True)
    assert exited.value.code == 143
    assert capsys.readouterr().err.strip().startswith("interrupted (SIGTERM): stopped")
