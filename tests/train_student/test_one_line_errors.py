"""Mistakes with paths and lengths end in one line naming the setting, the problem and the fix,
exit status 2, before any data is read (through train-student's real command line, and its and
export-student's configuration checks; the scored folders here are stand-ins, read only once the
configuration is valid)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.runtime.config import ConfigError
from pipeline.export_student.config import export_job_config
from pipeline.student_data.settings import AlignmentConfig, resolve_alignment
from pipeline.method.tokenization import load_tokenizer
from pipeline.train_student.config import DataConfig, StudentConfig, TrainConfig, TrainJobConfig, train_job_config
from pipeline.train_student.run import run_training

REPO = Path(__file__).resolve().parents[2]


def cli(stage: str, tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"stages.{stage}", f"hydra.run.dir={tmp_path / 'logs'}",
                           f"artifacts_dir={tmp_path / 'artifacts'}", f"output_dir={tmp_path / 'out'}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1", **(env or {})})


def refused(result, *words: str) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.startswith("error: "), result.stderr[-3000:]
    assert all(w in result.stderr for w in words), (words, result.stderr)
    return result.stderr


def stand_in_scored(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    return folder


def test_a_run_folder_for_the_embedded_student_and_a_corpus_folder_without_v1(tiny_student, tmp_path):
    run = tmp_path / "students" / "run"
    shutil.copytree(tiny_student, run / "final")
    scored = stand_in_scored(tmp_path / "scored" / "owm-sample" / "tiny" / "v1")
    result = cli("train_student", tmp_path, f"student.model={run}", f"data.folders=[{scored.parents[1]}]")
    refused(result, "invalid configuration (2 problems)",
            f"student.model: {run} is not the embedded tiny student", "add student.embedded=false",
            f"data.folders: {scored.parents[1]} holds no scored dataset (no manifest.json); the dataset(s) inside it: "
            f"{scored}; e.g. data.folders=[{scored}]")
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "out").exists()


def test_a_run_folder_a_missing_relative_path_and_a_scored_folder_given_as_the_model(tiny_student, tmp_path):
    run = tmp_path / "students" / "run"
    shutil.copytree(tiny_student, run / "final")
    scored = stand_in_scored(tmp_path / "scored")
    line = refused(cli("train_student", tmp_path, "student.embedded=false", f"student.model={run}",
                       f"data.folders=[{scored}]"),
                   f"error: student.model: {run} is a train-student run folder, not a model; its final model is "
                   f"student.model={run / 'final'}\n")
    assert line.count("\n") == 1 and not (tmp_path / "out").exists()
    # the same configuration checks as the command lines run them (their one-line path is the one above)
    values = {"student": {"name": "t", "model": "outputs/students/x/run/finall"}, "data": {"folders": [str(scored)]},
              "output_dir": str(tmp_path / "out")}
    with pytest.raises(ConfigError, match="^student.model: no such local file or folder: outputs/students/x/run/finall$"):
        train_job_config({**values, "train": {}, "loss": {}}, check_files=True)
    with pytest.raises(ConfigError, match=f"^student.model: {scored} is a scored dataset or an export "
                                          r"\(it holds a manifest.json\), not a model$"):
        export_job_config({**values, "student": {"name": "t", "model": str(scored)}, "export": {}, "loss": {}},
                          check_files=True)


def test_a_sequence_longer_than_the_students_positions_is_the_first_error(tiny_student, tmp_path):
    """Before the data is opened or counted: the step and token checks would otherwise refuse first
    (the stand-in scored folder is not even a dataset)."""
    scored = stand_in_scored(tmp_path / "scored")
    job = TrainJobConfig(student=StudentConfig(name="t", model=str(tiny_student), seq_len=100000),
                         data=DataConfig(folders=[str(scored)]), train=TrainConfig(max_steps=20, use_cpu=True),
                         output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError) as refusal:
        run_training(job)
    assert str(refusal.value) == (f"student.seq_len: 100000 exceeds the 64 positions of {tiny_student}; "
                                  "set student.seq_len <= 64")
    assert not (tmp_path / "out").exists()


def test_a_negative_number_of_data_loader_workers_is_refused_before_any_work(tmp_path):
    scored = stand_in_scored(tmp_path / "scored")
    result = cli("train_student", tmp_path, f"data.folders=[{scored}]", "data.num_workers=-1")
    assert refused(result) == "error: data.num_workers: -1 must be >= 0\n"
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "out").exists()
    values = {"student": {"name": "t", "model": "org/model"}, "data": {"folders": [str(scored)], "num_workers": 0},
              "train": {}, "loss": {}, "output_dir": str(tmp_path / "out")}
    assert train_job_config(values).data.num_workers == 0  # the data loaded in the training process


def test_a_hub_student_that_cannot_be_had_offline_is_one_line_before_any_work(tiny_student, tmp_path):
    """The paper's student offline with an empty cache, and a hub tokenizer beside a local student:
    one line each, exit 2, before the data is read or anything built (as stage 1's teacher check)."""
    scored = stand_in_scored(tmp_path / "scored")  # not a dataset: read only after the check
    hub = tmp_path / "hf" / "hub"
    offline = {"HF_HOME": str(tmp_path / "hf")}
    model = "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"  # conf/student/tinyllama-1.1b.yaml
    line = refused(cli("train_student", tmp_path, "student=tinyllama-1.1b", f"data.folders=[{scored}]", env=offline))
    assert line.count("\n") == 1, line
    assert line.startswith(f"error: student.model ({model}): {model} is not in the Hugging Face cache ({hub}) and "
                           "HF_HUB_OFFLINE is set; ways out: a local folder or file (student.model=/path/to/folder), "
                           f"or the Hugging Face cache (download once where there is network: hf download {model};"), line
    line = refused(cli("train_student", tmp_path, "student.embedded=false", f"student.model={tiny_student}",
                       "student.tokenizer=org/student-tokenizer", f"data.folders=[{scored}]", env=offline))
    assert line.count("\n") == 1, line
    assert line.startswith("error: student.tokenizer (org/student-tokenizer): org/student-tokenizer is not in the "
                           f"Hugging Face cache ({hub}) and HF_HUB_OFFLINE is set; ways out: a local folder or file "
                           "(student.tokenizer=/path/to/tokenizer)"), line
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "out").exists()


def test_one_to_one_alignment_with_another_tokenizer_is_refused_before_the_data_is_counted(
        micro_scored, micro_teacher, tiny_student, tmp_path):
    """The tiny student's tokenizer is not the micro teacher's: one line saying one_to_one needs the
    same tokenizer and what to use instead, before the token count (no length cache) or any run folder."""
    from transformers import AutoTokenizer

    result = cli("train_student", tmp_path, "student.embedded=false", f"student.model={tiny_student}",
                 "student.seq_len=32", f"data.folders=[{micro_scored}]", f"data.cache_dir={tmp_path / 'lengths'}",
                 "train.max_steps=4", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1",
                 "train.progress=false", "loss.alignment=one_to_one")
    identity = json.loads((micro_scored / "manifest.json").read_text())["identity"]["teacher"]
    student = hashlib.sha256(AutoTokenizer.from_pretrained(tiny_student).backend_tokenizer.to_str().encode()).hexdigest()
    assert refused(result) == (
        "error: loss.alignment: one_to_one needs the same tokenizer for student and teacher (it pairs student token i "
        f"with teacher token i), and these differ (the student's tokenizer sha256 {student[:12]}, teacher micro's "
        f"{identity['tokenizer_sha256'][:12]}); use loss.alignment=token (the default: it aligns by character spans "
        "across tokenizers, and is one-to-one by itself where they are the same) or loss.alignment=chunk\n")
    assert not (tmp_path / "lengths").exists() and not (tmp_path / "out").exists()
    # the teacher's own tokenizer: one_to_one as asked
    same = resolve_alignment(AlignmentConfig(method="one_to_one"), load_tokenizer(str(micro_teacher)), {"teacher": identity})
    assert same.method == "one_to_one"


def test_two_weights_for_one_teacher_are_refused_before_the_data_is_counted(micro_scored, tiny_student, tmp_path):
    """``loss.combine=weighted loss.teacher_weights=[0.7,0.3]`` with one teacher's folder: it was
    accepted and the weights ignored; now one line, exit 2, before the token count or any run folder."""
    result = cli("train_student", tmp_path, "student.embedded=false", f"student.model={tiny_student}",
                 "student.seq_len=32", f"data.folders=[{micro_scored}]", f"data.cache_dir={tmp_path / 'lengths'}",
                 "train.max_steps=4", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1",
                 "train.progress=false", "loss.combine=weighted", "loss.teacher_weights=[0.7,0.3]")
    assert refused(result) == (
        "error: loss.teacher_weights has 2 weights for one teacher (micro; data.folders of one teacher are one "
        "teacher): weights combine several teachers, so with one leave out loss.combine and loss.teacher_weights, "
        "or add the other teachers' folders to data.folders\n")
    assert not (tmp_path / "lengths").exists() and not (tmp_path / "out").exists()


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(("stage", "where"), [("train_student", "under a file"), ("train_student", "under /proc"),
                                               ("export_student", "under /proc"), ("eval_student", "under a file")])
def test_an_output_folder_that_cannot_be_made_is_one_line_before_any_work(stage, where, tiny_student, tmp_path):
    """train-student's and export-student's ``output_dir``, eval-student's ``out_dir``, under a
    regular file or under ``/proc``: the line of :func:`pipeline.folders.output_folder.unwritable_problem`
    (whose verdict its own test holds against the system's), exit status 2, before the student, the
    data or the checkpoint is read (the scored folder is a stand-in); nothing made but Hydra's logs."""
    from pipeline.folders.output_folder import unwritable_problem

    scored = stand_in_scored(tmp_path / "scored")  # not a dataset: read only after the check
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder\n")
    out = notes / "out" if where == "under a file" else Path("/proc/vocagno-out")
    held = tmp_path / "held.txt"
    held.write_text("a held-out sentence of plain text.\n")
    args = {
        "train_student": ["student.embedded=false", f"student.model={tiny_student}", "student.seq_len=32",
                          f"data.folders=[{scored}]", f"data.cache_dir={tmp_path / 'lengths'}", "train.max_steps=2",
                          "train.use_cpu=true", f"output_dir={out}"],
        "export_student": ["student.embedded=false", "student.name=t", f"student.model={tiny_student}",
                           "student.seq_len=32", f"data.folders=[{scored}]", f"data.cache_dir={tmp_path / 'lengths'}",
                           f"output_dir={out}"],
        "eval_student": [f"checkpoint={tiny_student}", "tasks=[]", f"bits_per_byte.texts=[{held}]", f"out_dir={out}"],
    }[stage]
    setting = "out_dir" if stage == "eval_student" else "output_dir"
    before = files(tmp_path)
    result = subprocess.run([sys.executable, "-m", f"stages.{stage}", f"hydra.run.dir={tmp_path / 'logs'}", *args],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0] == f"error: {unwritable_problem(out, setting)}"
    assert lines[0].startswith(f"error: {setting} {out}: cannot be made")
    assert [f for f in files(tmp_path) if not f.startswith("logs")] == before, "nothing built, counted or written"
