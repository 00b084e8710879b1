"""An output folder that cannot be made or written (under a regular file, where the file system
refuses one: ``/proc``) is one line naming the setting, the path and the problem, exit status 2,
before any work and without a traceback, in every command; nothing is left behind. The reference
is the operating system's own answer: making the folder (``os.makedirs``) and writing a file in it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline.folders.output_folder import check_writable, unwritable_problem
from pipeline.runtime.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def system_refuses(path: Path) -> bool:
    """Whether the system refuses to make ``path`` as a folder and write a file in it (it is made where it can be)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError:
        return True
    return False


@pytest.fixture
def a_file(tmp_path) -> Path:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder\n")
    return notes


def cases(tmp_path: Path, a_file: Path) -> dict[str, Path]:
    (tmp_path / "there").mkdir()
    return {"under a file": a_file / "out", "a file": a_file, "deep under a file": a_file / "a" / "b",
            "in /proc": Path("/proc/vocagno-out"), "under /proc": Path("/proc/vocagno-out/v1"),
            "new": tmp_path / "new" / "deep", "existing": tmp_path / "there"}


def test_the_check_agrees_with_the_system_and_leaves_nothing_behind(tmp_path, a_file):
    """The helper every command calls (stage 2, the export and evaluation too): its verdict equals
    the system's on each path, and it makes nothing; the lines name the setting and the path."""
    paths = cases(tmp_path, a_file)
    before = files(tmp_path)
    verdicts = {name: unwritable_problem(path, "output_dir") for name, path in paths.items()}
    assert files(tmp_path) == before, "the check leaves nothing behind"
    assert {name: v is not None for name, v in verdicts.items()} == {name: system_refuses(p) for name, p in paths.items()}
    assert verdicts["under a file"] == (f"output_dir {paths['under a file']}: cannot be made, {a_file} is a file, "
                                        "not a folder; choose another output_dir")
    assert verdicts["a file"] == f"output_dir {a_file}: is a file, not a folder; choose another output_dir"
    assert verdicts["in /proc"].startswith("output_dir /proc/vocagno-out: cannot be made (")
    with pytest.raises(ConfigError) as refused:
        check_writable({"output_dir": paths["under a file"], "logs": paths["in /proc"], "fine": paths["new"],
                        "remote": "s3://bucket/scored"})
    assert refused.value.problems == [verdicts["under a file"], unwritable_problem(paths["in /proc"], "logs")]


def command(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                               "HF_HOME": str(cwd / "hf"), "VOCAGNO_TRACEBACK": ""})


def only_line(result: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, \
        (result.returncode, result.stderr[-3000:])
    return lines[0]


@pytest.mark.parametrize("where", ["under a file", "under /proc"])
@pytest.mark.parametrize("stage", ["score_teacher", "inspect", "convert_teacher"])
def test_every_stage1_command_refuses_a_folder_it_cannot_make_in_one_line(stage, where, tmp_path, a_file,
                                                                         micro_teacher):
    out = cases(tmp_path, a_file)[where]
    logs = tmp_path / "logs"  # Hydra's own
    args = {
        "score_teacher": ["teacher.embedded=false", "teacher.name=micro", f"teacher.model={micro_teacher}",
                          "teacher.stride=null", f"artifacts_dir={tmp_path / 'artifacts'}", f"output_dir={out}"],
        "inspect": ["command=vocab-overlap", f"teacher={micro_teacher}", f"student={micro_teacher}", f"out_dir={out}"],
        "convert_teacher": ["teacher.embedded=false", "teacher.name=micro", f"teacher.model={micro_teacher}",
                            f"out_dir={out}"],
    }[stage]
    setting = "output_dir" if stage == "score_teacher" else "out_dir"
    assert system_refuses(out)
    before = files(tmp_path)
    line = only_line(command(f"stages.{stage}", f"hydra.run.dir={logs}", *args, cwd=tmp_path))
    assert line == f"error: {unwritable_problem(out, setting)}"
    assert line.startswith(f"error: {setting} {out}: cannot be made")
    assert [f for f in files(tmp_path) if not f.startswith("logs")] == before, "nothing built, written or left behind"


def test_hydras_log_folder_under_a_file_is_one_line(tmp_path, a_file):
    """The log folder every command makes first (``hydra.run.dir``) is checked before Hydra makes it."""
    line = only_line(command("stages.inspect", f"hydra.run.dir={a_file}/logs", "command=summary",
                             f"path={tmp_path}", cwd=tmp_path))
    assert line == (f"error: hydra.run.dir {a_file}/logs: cannot be made, {a_file} is a file, not a folder; "
                    "choose another hydra.run.dir")
