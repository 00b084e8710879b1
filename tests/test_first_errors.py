"""A new user's mistakes through the real commands: each comes back as one line that names the
problem and the fix, exit status 2, before any work (a mistyped teacher path, a list of labels
written as numbers, one teacher weighted twice, the progress key of another command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def command(module: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m <module> args`` from ``cwd`` (the project on PYTHONPATH), offline, no traceback."""
    return subprocess.run([sys.executable, "-m", module, f"hydra.run.dir={cwd / 'logs'}", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                               "HF_HOME": str(cwd / "hf"), "VOCAGNO_TRACEBACK": "", **(env or {})})


def only_line(result: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    return lines[0]


@pytest.fixture
def own_corpus(tmp_path) -> list[str]:
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text(json.dumps({"text": "1 + 1 = 2"}) + "\n")
    (tmp_path / "models" / "teacher-a").mkdir(parents=True)
    return ["data=open-web-math", "data.name=mine", "data.source=files", f"data.files=[{corpus}]",
            "teacher.embedded=false", "teacher.name=mine", f"output_root={tmp_path / 'scored'}",
            f"artifacts_dir={tmp_path / 'artifacts'}"]


def test_a_mistyped_teacher_path_written_as_a_path_names_the_nearest_existing_folder(tmp_path, own_corpus):
    result = command("stages.score_teacher", *own_corpus, "teacher.model=./models/teachr-a", cwd=tmp_path)
    assert only_line(result) == ("error: teacher.model: no such local file or folder: ./models/teachr-a; "
                                 "nearest existing: ./models/teacher-a")


def test_a_mistyped_teacher_path_read_as_a_hub_id_says_both_and_the_nearest_existing_folder(tmp_path, own_corpus):
    """``models/teachr-a`` has the shape of a hub id: the one line says it is in no cache, no local
    path either, how a relative path is written, and which folder is near; no second round trip."""
    result = command("stages.score_teacher", *own_corpus, "teacher.model=models/teachr-a", cwd=tmp_path)
    assert only_line(result) == (
        f"error: teacher 'mine' (models/teachr-a): models/teachr-a is not in the Hugging Face cache "
        f"({tmp_path / 'hf' / 'hub'}) and HF_HUB_OFFLINE is set; ways out: a local folder or file "
        "(teacher.model=/path/to/folder), or the Hugging Face cache (download once where there is network: "
        "hf download models/teachr-a; then run with the same HF_HOME, HF_HUB_OFFLINE=1 works); read as a hub id: "
        f"as a local path it does not exist ({tmp_path / 'models' / 'teachr-a'}), and a relative one is written "
        "./models/teachr-a; nearest existing: ./models/teacher-a")
    assert not (tmp_path / "scored").exists()


@pytest.mark.parametrize("stage", ["score_teacher", "train_student", "export_student", "eval_student", "inspect"])
def test_progress_is_one_key_in_every_command(stage, tmp_path):
    """``progress=false`` in every command (stage 2 and the export read it as ``train.progress`` and
    ``export.progress``, kept as aliases): beside a mistyped key only the mistyped key is refused."""
    result = command(f"stages.{stage}", "progress=false", "bogus_key=1", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    problems = [ln.strip(" -") for ln in result.stderr.splitlines() if ln.strip()]
    assert any(p.startswith(("error: bogus_key: unknown key (known: ", "bogus_key: unknown key (known: "))
               and ", progress, " in p for p in problems), problems
    assert not [p for p in problems if "progress:" in p or "progress'" in p], problems


def test_progress_sets_the_commands_own_key():
    from pipeline.runtime.config import lift_progress

    assert lift_progress({"progress": False, "train": {"max_steps": 3, "progress": True}}, "train") == {
        "train": {"max_steps": 3, "progress": False}}
    assert lift_progress({"progress": None, "export": {"progress": False}}, "export") == {"export": {"progress": False}}


HEAVY = ("torch", "transformers", "ray", "datasets", "polars")


def imported(stderr: str) -> set[str]:
    """The top-level packages ``python -X importtime`` reports as imported."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


# (entry point, its arguments with one mistyped key, the one line it answers)
MISTYPED = [
    ("compare_evals", ["runz=[a]", "runs=[a]"],
     "error: runz: unknown key; did you mean runs? (known: allow_mismatch, labels, out_dir, runs)"),
    ("score_teacher", ["nonsense_key=1"],
     "error: nonsense_key: unknown key (known: artifacts_dir, data, limit_shards, output_dir, output_root, overwrite, "
     "plan, plan_measure, plan_tokens_per_s, pool, progress, ray, rescore_shards, scorer, storage, teacher)"),
    ("convert_teacher", ["nonsense_key=1"], "error: nonsense_key: unknown key (known: artifacts_dir, out_dir, teacher)"),
    ("eval_student", ["checkpoint=org/model", "data_dir={tmp}", "nonsense_key=1"],  # {tmp} holds an empty gsm8k.jsonl
     "error: nonsense_key: unknown key (known: bits_per_byte, checkpoint, data_dir, data_files, eval_root, fewshot_dir, "
     "fewshot_files, fewshot_source, generation, label, limit, num_fewshot, out_dir, overwrite, progress, revision, tasks)"),
    ("train_student", ["nonsense_key=1"],
     "error: nonsense_key: unknown key (known: artifacts_dir, data, loss, output_dir, overwrite, plan, plan_measure, "
     "progress, run_name, scored_root, student, student_root, train)"),
    ("export_student", ["nonsense_key=1"],
     "error: nonsense_key: unknown key (known: artifacts_dir, data, export, export_root, loss, output_dir, overwrite, "
     "progress, scored_root, student)"),
    ("inspect", ["command=summary", "path=.", "hmtl=1"],
     "error: hmtl: unknown key; did you mean html? (known: align, command, compare, doc, html, other, out_dir, path, "
     "progress, student, summary, teacher, two_teachers, validate)"),
]


@pytest.mark.parametrize("stage, args, line", MISTYPED, ids=[m[0] for m in MISTYPED])
def test_a_mistyped_key_comes_back_without_importing_the_heavy_libraries(stage, args, line, tmp_path):
    """A mistyped key: the one-line refusal, exit 2, and none of torch, transformers, Ray, datasets
    or Polars (inspect: Polars is its reader) imported by then (``python -X importtime`` lists every module imported; the stages'
    modules import them in the functions that use them, after the config check). Speed itself is
    measured, not asserted (benchmarks)."""
    (tmp_path / "gsm8k.jsonl").write_text("")  # a task file for eval-student, whose check wants one
    args = [a.format(tmp=tmp_path) for a in args]
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", f"stages.{stage}", *args,
                             f"hydra.run.dir={tmp_path / 'logs'}"], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "VOCAGNO_TRACEBACK": ""})
    errors = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("import time:")]
    assert result.returncode == 2 and errors == [line], result.stderr[-3000:]
    heavy = set(HEAVY) - ({"polars"} if stage == "inspect" else set())  # inspect's own reader of the shards
    assert not imported(result.stderr) & heavy, sorted(imported(result.stderr) & heavy)
