"""Stage 2's bill (``plan=true``) through the real command: the samples and steps it prints are
those the run's own packing gives (``data.held_out_shards`` included), and it prints a wall time
measured on the student itself, saying how."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from pipeline.student_data.held_out_shards import hold_out
from pipeline.student_data.build import build_student_data
from pipeline.student_data.settings import AlignmentConfig, PackingConfig
from pipeline.method.tokenization import load_tokenizer
from storage_schemas.reader import open_scored_dataset

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1", "COLUMNS": "300"}


def plan_command(folder: Path, student: Path, tmp: Path, *extra: str) -> str:
    args = ["student.embedded=false", f"student.model={student}", "student.seq_len=32", f"data.folders=[{folder}]",
            f"data.cache_dir={tmp / 'lengths'}", "train.micro_batch_size=4", "train.gradient_accumulation_steps=2",
            "train.max_steps=5", f"output_dir={tmp / 'run'}", f"hydra.run.dir={tmp / 'logs'}", "plan=true", *extra]
    res = subprocess.run([sys.executable, "-m", "stages.train_student", *args], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp / "run").exists()  # nothing trained, no run folder
    return " ".join(res.stdout.split())


def number(text: str, pattern: str) -> int:
    found = re.search(pattern, text)
    assert found, (pattern, text[-2000:])
    return int(found.group(1).replace(",", ""))


def test_the_bill_counts_what_the_run_trains_on_with_a_held_out_shard(micro_scored, tiny_student, tmp_path):
    tokenizer = load_tokenizer(str(tiny_student))
    scored = hold_out([open_scored_dataset([micro_scored])], 1)[0]  # the run's own hold-out, then its own packing
    assert len(scored.shards) == 3
    data = build_student_data(scored, tokenizer, PackingConfig(seq_len=32), AlignmentConfig(),
                              cache_dir=str(tmp_path / "lengths"))  # the run's count fills the length cache
    out = plan_command(micro_scored, tiny_student, tmp_path, "data.held_out_shards=1")
    assert "(the length cache holds every shard)" in out
    assert number(out, r"samples\W+(\d[\d,]*) of 32 tokens") == data.plan.n_samples
    assert number(out, r"\((\d[\d,]*) stream tokens") == data.plan.n_tokens
    assert number(out, r"steps\W+(\d[\d,]*) available of 8 samples") == data.plan.n_samples // 8
    assert number(out, r"(\d[\d,]*) shards, ") == 3


def test_the_bill_prints_a_wall_time_measured_on_the_student(micro_scored, tiny_student, tmp_path):
    out = plan_command(micro_scored, tiny_student, tmp_path, "plan_measure=true")
    found = re.search(r"wall time\W+about ([\d.,]+) (s|min|h) for 5 steps at ([\d.,]+) s per step, measured", out)
    assert found, out[-2000:]
    assert "measured over" in out and "on cpu" in out
