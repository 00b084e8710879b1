"""The inspection examples of docs/storage-schema.md name only what a user's clone has: folders the
embedded build and stage 1 make (where the configs put them), the paper's hub ids, placeholders.
Two of them run as written in a project folder whose artifacts/ and outputs/ hold the micro models
and scored data in those places."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

import stages.score_teacher  # noqa: F401  (each registers the defaults its YAML overrides)
import stages.train_student  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "storage-schema.md"


def examples() -> list[list[str]]:
    """The ``make <target> ARGS="..."`` lines of the Inspecting section, as (target, settings...)."""
    section = DOC.read_text().split("## Inspecting", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r'^make ([\w-]+) ARGS="([^"]*)"', section, re.M)
    assert len(found) >= 8, found
    return [[target, *(f"{k}={v}" for k, v in re.findall(r"([\w.]+)=(<[^>]*>|\S+)", args))] for target, args in found]


def made_by_the_project() -> dict[str, str]:
    """Where the embedded build puts the tiny teacher and student, and the models the presets name."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        teacher = compose(config_name="score_teacher").teacher.model
        student = compose(config_name="train_student").student.model
        presets = {compose(config_name="score_teacher", overrides=[f"teacher={p.stem}"]).teacher.model
                   for p in (REPO / "conf" / "teacher").glob("*.yaml")}
        presets |= {compose(config_name="train_student", overrides=[f"student={p.stem}"]).student.model
                    for p in (REPO / "conf" / "student").glob("*.yaml")}
    return {"teacher": teacher, "student": student, "models": presets}


def test_every_example_names_what_a_clone_has():
    made = made_by_the_project()
    assert made["teacher"] == "artifacts/tiny-teacher-n3000-s0" and made["student"] == "artifacts/tiny-student-n3000-s0"
    for target, *args in examples():
        for key, value in (a.split("=", 1) for a in args):
            if key in ("teacher", "student"):
                assert value in made["models"], f"make {target}: {key}={value} is not built or named by the project"
            elif key in ("path", "other"):
                assert value.startswith("outputs/scored/") or value.startswith("<"), f"make {target}: {key}={value}"
            assert "../" not in value, f"make {target}: {value} lies outside the clone"


def test_the_vocab_overlap_and_align_report_examples_run_as_written(micro_teacher, tiny_student, micro_scored,
                                                                    tmp_path):
    project = tmp_path / "clone"
    (project / "artifacts").mkdir(parents=True)
    (project / "artifacts" / "tiny-teacher-n3000-s0").symlink_to(micro_teacher)
    (project / "artifacts" / "tiny-student-n3000-s0").symlink_to(tiny_student)
    (project / "outputs" / "scored" / "owm-sample" / "tiny").mkdir(parents=True)
    scored = project / "outputs" / "scored" / "owm-sample" / "tiny" / "v1"
    os.symlink(micro_scored, scored)
    commands = {"vocab-overlap": ["command=vocab-overlap"], "align-report": ["command=align-report"]}
    ran = []
    for target, *args in examples():
        if target in commands and all(not a.split("=", 1)[1].startswith(("<", "Qwen/")) for a in args):
            res = subprocess.run([sys.executable, "-m", "stages.inspect", *commands[target], *args,
                                  f"out_dir={tmp_path / target}", f"hydra.run.dir={tmp_path / 'logs' / target}"],
                                 cwd=project, capture_output=True, text=True, timeout=300,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"})
            assert res.returncode == 0, f"make {target} {' '.join(args)}: {res.stderr[-3000:]}"
            ran.append(target)
    assert sorted(ran) == ["align-report", "vocab-overlap"]
