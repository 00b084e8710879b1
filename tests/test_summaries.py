"""The stages' end summaries on a narrow terminal: every path and command printed whole on one
line (copyable as it is), the one-liners run with the project's interpreter."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from rich.console import Console

from pipeline.score_teacher.job import JobSummary
from pipeline.train_student.run import TrainSummary
from stages import score_teacher, train_student
from stages.common import python_command

DEEP = "/very/long/path/to/a/project/that/does/not/fit/in/an/eighty/column/terminal/at/all"


def shown(print_summary, summary) -> list[str]:
    console = Console(width=60, record=True, force_terminal=False)
    print_summary(summary, console)
    return console.export_text().splitlines()


def test_stage1_summary_prints_the_folder_and_the_polars_command_whole():
    folder = f"{DEEP}/outputs/scored/owm-sample/tiny/v1"
    summary = JobSummary(output_dir=folder, shards_planned=12, shards_done_before=12, shards_scored=0,
                         shards_complete=12, documents=2998, tokens=2771974, documents_this_run=0,
                         tokens_this_run=0, seconds=6.4, reasons={"empty_text": 3}, complete=True)
    lines = shown(score_teacher.print_summary, summary)
    assert f"  {folder}" in lines
    polars = next(ln for ln in lines if "import polars" in ln)
    assert polars.startswith(f"  {python_command()} -c ") and f"{folder}/shard-*.parquet" in polars
    assert shlex.split(polars)[-1].endswith(".collect())"), "the command is not cut"


def test_stage2_summary_prints_the_model_path_and_tensorboard_command_whole():
    run = f"{DEEP}/outputs/students/owm-sample/tiny-tiny-guided"
    data = {"teacher": "tiny", "shards_used": 12, "n_documents": 2998, "n_tokens": 3_000_000, "student_tokens": 2_994_004, "n_samples": 11_000,
            "seq_len": 256, "shards_skipped": [], "n_empty": 3, "alignment": "token", "aggregate": "max"}
    summary = TrainSummary(output_dir=run, final_model=f"{run}/final", steps=200, resumed_from=None,
                           tokens_per_step=8192, tokens_trained=1_638_400, seconds=120.0, data=data, last_log={})
    lines = shown(train_student.print_summary, summary)
    assert f"  {run}/final" in lines
    assert f"  tensorboard --logdir {run}/runs" in lines


def test_python_command_is_the_interpreter_as_typed_from_the_project():
    command = Path(python_command())
    assert (command if command.is_absolute() else Path.cwd() / command).resolve() == Path(sys.executable).resolve()
