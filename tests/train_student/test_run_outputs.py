"""Where a student run is filed and what it says, through ``python -m stages.train_student``: a run
given only ``data.folders`` is filed under the corpus and teacher(s) its scored folders' manifests
name; the summary names every teacher and shows the TensorBoard command only when TensorBoard
is on; Ctrl-C names the checkpoint the same command resumes from, and that rerun says at its start
that it resumes, from which checkpoint. The trackers' local folders are out of git's way."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_faults_stage2 import complete_steps, wait_for_step
from test_multi_teacher import rewrite
from test_train_student import compose

REPO = Path(__file__).resolve().parents[2]
# What the micro scored folder's manifest names (the conftest fixture scores corpus owm-micro with teacher micro)
CORPUS, TEACHER = "owm-micro", "micro"


def stage(tmp_path: Path, *args: str) -> list[str]:
    """The stage with the tiny student of the tests, its runs under ``<tmp_path>/students``, no output_dir."""
    return [sys.executable, "-m", "stages.train_student", f"hydra.run.dir={tmp_path}/logs",
            f"student_root={tmp_path / 'students'}", "student.embedded=false", "student.seq_len=32",
            f"data.cache_dir={tmp_path}/lengths", "data.held_out_shards=0", "train.eval_every=null",
            "train.micro_batch_size=2", "train.gradient_accumulation_steps=1", "train.warmup_steps=0",
            "train.lr_scheduler=cosine", "train.use_cpu=true", "train.cpu_threads=1", "train.progress=false", *args]


ENV = {**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # the summary's rows unwrapped


def run_folders(root: Path) -> list[str]:
    return sorted(p.parent.relative_to(root).as_posix() for p in root.rglob("run.json"))


def test_scored_folders_name_the_run_folder(tiny_student, micro_scored, tmp_path):
    """The composed configuration (conf/train_student.yaml, as the command composes it): given only
    ``data.folders``, the run folder is ``<student_root>/<corpus>/<student>-<teacher>-<mode>`` with the
    corpus and teacher of the folder's manifest, not the quick start's ``owm-sample/tiny-tiny-guided``;
    a folder without a manifest leaves ``data.corpus`` and ``data.teacher``."""
    named = compose([f"data.folders=[{micro_scored}]", "student_root=students"])
    assert named.output_dir == f"students/{CORPUS}/tiny-{TEACHER}-guided"
    assert compose([f"data.folders=[{tmp_path}]", "student_root=students"]).output_dir == \
        "students/owm-sample/tiny-tiny-guided"
    assert compose(["student_root=students"]).output_dir == "students/owm-sample/tiny-tiny-guided"


def test_scored_folders_name_the_export_folder(micro_scored, tmp_path):
    """conf/export_student.yaml as the command composes it: an export of ``data.folders`` alone is
    filed under the manifest's corpus and teacher (``<export_root>/<corpus>/<teacher>/...``), not
    the quick start's ``owm-sample/tiny``."""
    from hydra import compose as hydra_compose, initialize_config_dir

    import stages.export_student  # noqa: F401  (registers the export's defaults and the folder resolvers)
    from stages.common import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        named = hydra_compose("export_student", [f"data.folders=[{micro_scored}]", "export_root=exports"])
        plain = hydra_compose("export_student", ["export_root=exports"])
    assert named.output_dir == f"exports/{CORPUS}/{TEACHER}/tiny-packed"
    assert plain.output_dir == "exports/owm-sample/tiny/tiny-packed"


@pytest.mark.long
def test_a_run_of_scored_folders_is_filed_under_their_corpus_and_names_every_teacher(tiny_student, micro_scored,
                                                                                     tmp_path):
    """One teacher's folder with TensorBoard off, then two teachers' folders (the same documents under
    another teacher name) with the default trackers: each run is filed under the folders' corpus and
    named after their teachers; the summary lists every teacher; the TensorBoard line only where it is on."""
    twin = rewrite(micro_scored, tmp_path / "twin" / "v1", "micro-twin")
    root = tmp_path / "students"
    one = subprocess.run(stage(tmp_path, f"student.model={tiny_student}", f"data.folders=[{micro_scored}]",
                               "train.max_steps=1", "train.report_to=[]"),
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    assert run_folders(root) == [f"{CORPUS}/tiny-{TEACHER}-guided"]
    assert f"teacher {TEACHER}: " in one.stdout and "TensorBoard" not in one.stdout, one.stdout

    two = subprocess.run(stage(tmp_path, f"student.model={tiny_student}", f"data.folders=[{micro_scored},{twin}]",
                               "train.max_steps=1", "loss.combine=min"),
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert two.returncode == 0, two.stderr[-3000:]
    run = f"{CORPUS}/tiny-{TEACHER}+micro-twin-guided"
    assert run_folders(root) == sorted([f"{CORPUS}/tiny-{TEACHER}-guided", run])
    assert f"2 teachers, {TEACHER}, micro-twin (loss.combine=min): " in two.stdout, two.stdout
    assert f"tensorboard --logdir {root / run / 'runs'}" in two.stdout and (root / run / "runs").is_dir()


@pytest.mark.long
def test_ctrl_c_names_the_checkpoint_and_the_rerun_says_it_resumes_from_it(tiny_student, micro_scored, tmp_path):
    """SIGINT to the stage and its data-loader worker (what Ctrl-C in a terminal sends) after step 3,
    with a checkpoint every 2 steps: exit status 130 and one line naming the step reached and the
    newest complete checkpoint; the same command says at its start that it resumes from it, and
    ends from it."""
    steps = 40
    command = stage(tmp_path, f"student.model={tiny_student}", f"data.folders=[{micro_scored}]", "data.num_workers=1",
                    f"train.max_steps={steps}", "train.save_steps=2", "train.logging_steps=1", "train.report_to=[]",
                    f"output_dir={tmp_path / 'run'}")
    run, log = tmp_path / "run", tmp_path / "run.log"
    started = time.time()
    with open(log, "wb") as f:
        proc = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for_step(run, 3, started, proc)
    assert proc.poll() is None, log.read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=300) == 130, log.read_text()[-3000:]
    newest = max(complete_steps(run))
    last = [ln for ln in log.read_text().splitlines() if ln.strip()][-1]
    found = re.fullmatch(rf"interrupted \(SIGINT\): stopped at step (\d+) of {steps}; the same command resumes from "
                         rf"checkpoint-{newest} \({re.escape(str(run / f'checkpoint-{newest}'))}\)", last)
    assert found and newest <= int(found.group(1)) < steps and newest >= 2, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()

    rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    said = rerun.stdout + rerun.stderr
    assert f"resuming {run} from {run / f'checkpoint-{newest}'} (step {newest} of {steps})" in said, said[-3000:]
    assert f"resumed from checkpoint-{newest}" in rerun.stdout


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout")
def test_the_trackers_local_folders_are_ignored_by_git():
    """What MLflow's file store (``MLFLOW_TRACKING_URI=file:$PWD/mlruns``, as configuration.md shows)
    and W&B (``./wandb``) write in the project folder: git ignores it (``git check-ignore``)."""
    paths = ["mlruns/0/meta.yaml", "mlruns/0/1a2b/metrics/loss", "wandb/offline-run-x/files/config.yaml"]
    result = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True)
    assert result.stdout.split() == paths, result.stdout + result.stderr
