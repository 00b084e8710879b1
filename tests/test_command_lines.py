"""What a user types and what the stages print back: ``~`` in a path, a relative teacher path taken
for a hub id, and printed follow-up commands that run as printed from a folder whose name holds a
space and a comma (checked by bash, make and Hydra's own parser, never by the code that quotes)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from rich.console import Console

from pipeline.score_teacher.corpus import CorpusConfig, CorpusError
from pipeline.score_teacher.corpus_sources import resolve_sources

REPO = Path(__file__).resolve().parent.parent


def stage1(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.score_teacher", "data.name=mine", "data.embedded=false",
                           f"hydra.run.dir={tmp_path / 'logs'}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
                                            "VOCAGNO_TRACEBACK": ""})


def only_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_a_tilde_is_the_home_folder_and_a_folder_given_as_corpus_files_gets_its_pattern(tmp_path):
    (tmp_path / "corpus").mkdir()
    pq.write_table(pa.table({"content": ["2 + 2 = 4"]}), tmp_path / "corpus" / "part-0.parquet")
    line = only_line(stage1(tmp_path, "data.files=[~/corpus]", "output_root=~/scored", "artifacts_dir=~/artifacts"))
    assert line == (f"error: data.files: corpus 'mine': '{tmp_path}/corpus' is a folder; give its files: "
                    f"'{tmp_path}/corpus/*.parquet'"), line
    assert not (tmp_path / "scored").exists() and not (tmp_path / "artifacts").exists()
    with pytest.raises(CorpusError, match=r"no column 'text' \(columns found: content\); set "
                                          r"data.text_column=content if that field holds the text$"):
        resolve_sources(CorpusConfig(name="mine", files=[str(tmp_path / "corpus" / "*.parquet")]))


def test_a_relative_teacher_path_is_not_taken_for_a_hub_id_without_a_word():
    """The check stage 1 runs before Ray (its one-line path through the command line: row 26)."""
    from pipeline.folders.model_source import TeacherSourceError, check_teacher_source
    from pipeline.score_teacher.config import TeacherConfig

    with pytest.raises(TeacherSourceError) as refusal:  # offline here, as in every test (conftest)
        check_teacher_source(TeacherConfig(name="t", model="models/my-teacher"))
    line = str(refusal.value)
    assert "\n" not in line and line.startswith("teacher 't' (models/my-teacher): models/my-teacher is not in the "
                                                 "Hugging Face cache"), line
    assert line.endswith(f"read as a hub id: as a local path it does not exist ({Path.cwd() / 'models' / 'my-teacher'}), "
                         "and a relative one is written ./models/my-teacher"), line


def run_make_line(line: str, cwd: Path) -> list[str]:
    """The words a Makefile recipe's shell passes for ``$(ARGS)``, with the real make and bash."""
    (cwd / "Makefile").write_text("inspect:\n\t@printf '%s\\n' $(ARGS)\n")
    # as typed in a fresh terminal: not a sub-make of `make test` (which would add "Entering directory" lines)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True, check=True, env=env).stdout
    return out.splitlines()


def test_printed_commands_run_as_printed_from_a_folder_with_a_space_and_a_comma(micro_scored, tmp_path):
    from pipeline.score_teacher.job import JobSummary
    from stages.score_teacher import print_summary

    folder = tmp_path / "my data, v2" / "v1"
    shutil.copytree(micro_scored, folder)
    summary = JobSummary(output_dir=str(folder), shards_planned=4, shards_done_before=4, shards_scored=0,
                         shards_complete=4, documents=160, tokens=1, documents_this_run=0, tokens_this_run=0,
                         seconds=1.0, reasons={}, complete=True)
    text = io.StringIO()
    print_summary(summary, Console(file=text, width=60))
    lines = text.getvalue().splitlines()
    polars = next(ln.strip() for ln in lines if " -c " in ln)
    ran = subprocess.run(["bash", "-c", polars], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    documents = json.loads((folder / "manifest.json").read_text())["totals"]["documents"]
    assert "mean_loss" in ran.stdout and f"shape: ({documents}, 3)" in ran.stdout, ran.stdout

    make = next(ln.strip() for ln in lines if ln.strip().startswith("make inspect"))
    words = run_make_line(make, tmp_path)
    parsed = OverridesParser.create().parse_overrides(words)
    assert [(o.key_or_group, o.value()) for o in parsed] == [("path", str(folder))]


def test_the_export_summary_names_its_folder_on_one_line(tmp_path, monkeypatch):
    from pipeline.export_student.job import ExportSummary
    from stages import export_student

    out = str(tmp_path / ("a long folder name " * 6) / "it's")
    summary = ExportSummary(output_dir=out, layout="packed", formats=["parquet"], rows=1, shards_planned=1,
                            shards_done_before=0, shards_written=1, tokens=1, student_tokens=1, tokens_this_run=1, mapped_fraction=1.0,
                            bytes={"parquet": 1}, complete=True, seconds=1.0)
    text = io.StringIO()
    monkeypatch.setattr(export_student, "Console", lambda: Console(file=text, width=60))  # a narrow terminal
    export_student.print_summary(summary)
    line = next(ln for ln in text.getvalue().splitlines() if "load_dataset" in ln)
    argument = re.search(r"load_dataset\((.*)\); recipes", line).group(1)
    assert json.loads(argument) == out, line
