"""A run folder is never lost: refused when it holds what the run reads, set aside (not deleted) by
``overwrite=true`` until the new run has saved a checkpoint, and given back whole when the new run
fails before that. The reference is the folder as it was, read back byte for byte first."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import TrainerCallback

from pipeline.runtime.config import ConfigError
from pipeline.train_student.checkpoints import RunMismatchError
from pipeline.train_student.config import train_job_config
from pipeline.train_student.run import run_training
from test_train_student import make_job, metrics

REPO = Path(__file__).resolve().parents[2]


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def finished_run_folder(folder: Path, student: Path) -> dict[str, str]:
    """A finished run as train-student leaves it (final/ a real model; the rest stand-ins of the
    right names): what overwrite=true used to delete."""
    shutil.copytree(student, folder / "final")
    (folder / "checkpoint-200").mkdir()
    (folder / "checkpoint-200" / "model.safetensors").write_bytes(b"weights")
    (folder / "metrics.jsonl").write_text('{"step": 200}\n')
    (folder / "runs").mkdir()
    (folder / "runs" / "events.out").write_bytes(b"tb")
    (folder / "run.json").write_text("{}")
    return tree(folder)


def test_overwrite_into_the_folder_of_the_model_it_trains_from_is_refused_and_deletes_nothing(tiny_student, tmp_path):
    """The new user's command: train longer from a run's final/ under the same run name, overwrite=true."""
    run = tmp_path / "students" / "owm-sample" / "copyrun"
    before = finished_run_folder(run, tiny_student)
    (tmp_path / "scored").mkdir()
    (tmp_path / "scored" / "manifest.json").write_text("{}")  # read only once the config is valid
    args = ["student.embedded=false", f"student.model={run / 'final'}", "run_name=copyrun", "overwrite=true",
            "train.max_steps=20", f"student_root={tmp_path / 'students'}", "data.corpus=owm-sample",
            f"data.folders=[{tmp_path / 'scored'}]", f"hydra.run.dir={tmp_path / 'logs'}"]
    result = subprocess.run([sys.executable, "-m", "stages.train_student", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "VOCAGNO_TRACEBACK": ""})
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error: output_dir {run} holds student.model ({run / 'final'})"), lines[0]
    assert "whatever overwrite says" in lines[0] and "run_name=<a new name>" in lines[0]
    assert tree(run) == before, "nothing of the run was deleted or added"
    assert not (tmp_path / "logs" / "summary.json").exists()


def test_overwrite_cannot_set_aside_the_checkpoint_it_resumes_from(tiny_student, tmp_path):
    run = tmp_path / "run"
    finished_run_folder(run, tiny_student)
    (tmp_path / "scored").mkdir()
    (tmp_path / "scored" / "manifest.json").write_text("{}")  # read only once the config is valid
    values = {"student": {"name": "t", "model": str(tiny_student)}, "data": {"folders": [str(tmp_path / "scored")]},
              "train": {"resume": str(run / "checkpoint-200")}, "loss": {}, "output_dir": str(run)}
    train_job_config(values, check_files=True)  # resuming a run's own checkpoint is what resume is for
    with pytest.raises(ConfigError, match=r"holds train.resume \(.*checkpoint-200\)"):
        train_job_config({**values, "overwrite": True}, check_files=True)


def test_a_run_folder_inside_an_export_or_a_mixture_corpus_is_refused(tiny_student, tmp_path):
    """The run's other inputs count too: the export it trains from and each mixture corpus."""
    for name in ("export", "web", "math"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    base = {"student": {"name": "t", "model": str(tiny_student)}, "train": {}, "loss": {}}
    export = {**base, "data": {"folders": [], "export": str(tmp_path / "export")},
              "output_dir": str(tmp_path / "export" / "run")}
    with pytest.raises(ConfigError, match=r"lies inside data.export"):
        train_job_config(export, check_files=True)
    mixture = {**base, "data": {"folders": [], "mixture": [{"name": "web", "weight": 1.0, "folders": [str(tmp_path / "web")]},
                                            {"name": "math", "weight": 1.0, "folders": [str(tmp_path / "math")]}]},
               "output_dir": str(tmp_path / "math")}
    with pytest.raises(ConfigError, match=r"data.mixture\[1\].folders\[0\]"):
        train_job_config(mixture, check_files=True)


class Watch(TrainerCallback):
    """Records, at each optimizer step and save, whether the old run is still set aside; fails at
    ``fail_at`` (a crash after every check and load has passed)."""

    def __init__(self, folder: Path, fail_at: int | None = None):
        self.folder, self.fail_at, self.seen = folder, fail_at, []

    def aside(self) -> bool:
        return any(p.name.startswith(".replaced-") for p in self.folder.iterdir())

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(("step", state.global_step, self.aside()))
        if state.global_step == self.fail_at:
            raise RuntimeError(f"crash at step {self.fail_at}")

    def on_save(self, args, state, control, **kwargs):
        self.seen.append(("save", state.global_step, self.aside()))


def test_overwrite_sets_the_old_run_aside_until_the_first_checkpoint_and_a_crash_before_loses_nothing(
        tiny_student, micro_scored, tmp_path):
    out = tmp_path / "run"
    old = make_job(tiny_student, micro_scored, out, steps=4)  # checkpoints at 2 and 4, then final/
    run_training(old)
    before = tree(out)

    with pytest.raises(RunMismatchError) as longer:
        run_training(replace(old, train=replace(old.train, max_steps=6)))
    for words in (f"student.model={out / 'final'} student.embedded=false run_name=<a new name>",
                  "Or use another run name (run_name=<a new name>)",
                  "overwrite=true starts this run afresh: it deletes this run's checkpoints, stable/, final/, metrics.jsonl",
                  "once the new run has saved its first checkpoint"):
        assert words in str(longer.value), str(longer.value)
    assert tree(out) == before

    other = replace(old, selection=replace(old.selection, ratio=0.3), overwrite=True)
    crash = Watch(out, fail_at=1)
    with pytest.raises(RuntimeError, match="crash at step 1"):
        run_training(other, callbacks=[crash])
    assert crash.seen == [("step", 1, True)], "the old run was out of the way, not deleted"
    assert tree(out) == before, "the crash after every check gave the old run back whole"
    assert not [p for p in out.iterdir() if p.name.startswith(".replac")]

    watch = Watch(out)
    done = run_training(other, callbacks=[watch])
    assert done.steps == 4 and done.resumed_from is None
    assert watch.seen[:3] == [("step", 1, True), ("step", 2, True), ("save", 2, False)], \
        "deleted once the first checkpoint was complete, not before"
    assert not any(p.name.startswith(".") and p.name != ".lock" for p in out.iterdir())
    assert json.loads((out / "run.json").read_text())["recipe"]["loss"]["ratio"] == 0.3
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4], "the new run's metrics only"
