"""A teacher of your own given without ``teacher.name`` (the tiny teacher's preset still chosen): its
dataset is filed and carded under a name taken from its folder or file, never as the tiny teacher's,
through the real command. The reference is the folder's own name as the user wrote it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def stage1(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.score_teacher", f"hydra.run.dir={cwd / 'logs'}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"})


def test_a_teacher_folder_without_a_name_is_filed_and_carded_under_its_folders_name(micro_teacher, micro_corpus,
                                                                                    tmp_path):
    teacher = shutil.copytree(micro_teacher, tmp_path / "models" / "My Teacher v2")
    root = tmp_path / "scored"
    run = stage1("teacher.embedded=false", f"teacher.model={teacher}", "teacher.stride=null", "data.embedded=false",
                 "data.name=micro", f"data.files=[{micro_corpus[0]}]", "data.limit_docs=4", f"output_root={root}",
                 f"artifacts_dir={tmp_path / 'artifacts'}", "progress=false", "ray.num_cpus=1", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    name = "my-teacher-v2"  # "My Teacher v2" in lower case, the space as "-"
    assert [p.relative_to(root).as_posix() for p in root.glob("*/*/v1")] == [f"micro/{name}/v1"]
    folder = root / "micro" / name / "v1"
    assert json.loads((folder / "manifest.json").read_text())["identity"]["teacher"]["name"] == name
    card = (folder / "README.md").read_text()
    assert f"pretty_name: micro scored by {name}" in card and f"| name | `{name}` |" in card and "tiny" not in card
    assert f"teacher.name not given: this teacher is filed as '{name}'" in run.stderr
    assert not (tmp_path / "artifacts").exists(), "the tiny teacher is not built"
