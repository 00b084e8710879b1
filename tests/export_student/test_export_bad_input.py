"""Bad input: one line naming the problem (exit status 2 through the real command line), and nothing
half-written marked complete (no marker, no complete manifest, an existing export untouched)."""

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

from export_helpers import make_export
from pipeline.export_student.job import run_export
from pipeline.method.tokenization import TokenizerError
from storage_schemas.reader import BadShardError

REPO = Path(__file__).resolve().parents[2]


def export_cli(tmp_path: Path, student: Path, folder: Path, *extra: str, out: Path | None = None):
    env = {**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"}
    args = ["student.embedded=false", "student.name=t", f"student.model={student}", "student.seq_len=32",
            f"data.folders=[{folder}]", f"data.cache_dir={tmp_path}/lengths", f"output_dir={out or tmp_path / 'out'}", "export.progress=false",
            f"hydra.run.dir={tmp_path}/logs", f"artifacts_dir={tmp_path}/artifacts", *extra]
    return subprocess.run([sys.executable, "-m", "stages.export_student", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)


def one_line_refusal(result, *words: str) -> None:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert all(w in lines[0] for w in words), (words, lines[0])


def nothing_marked(out: Path) -> None:
    assert not list(out.glob("*.done.json")) if out.exists() else True
    manifest = out / "manifest.json"
    assert not manifest.exists() or not json.loads(manifest.read_text())["complete"]


def test_a_scored_folder_that_fails_validation(tiny_student, micro_scored, tmp_path):
    folder = tmp_path / "scored"
    shutil.copytree(micro_scored, folder)
    victim = folder / "shard-000002.parquet"
    victim.write_bytes(victim.read_bytes()[:-100])  # truncated: size and footer no longer match the manifest
    with pytest.raises(BadShardError) as refused:
        run_export(make_export(tiny_student, folder, tmp_path / "out"))
    assert "\n" not in str(refused.value) and "shard-000002.parquet" in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_student_tokenizer_without_offsets(tiny_student, micro_scored, shared_tokenizers, tmp_path):
    slow = tmp_path / "slow-tokenizer"
    slow.mkdir()
    shutil.copy(shared_tokenizers / "mistral-v1.tokenizer.model", slow / "spiece.model")
    (slow / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertGenerationTokenizer"}))
    job = make_export(tiny_student, micro_scored, tmp_path / "out")
    with pytest.raises(TokenizerError, match="slow .* no character offsets"):
        run_export(replace(job, student=replace(job.student, tokenizer=str(slow))))
    assert not (tmp_path / "out").exists()


def test_a_sequence_longer_than_the_students_positions(tiny_student, micro_scored, tmp_path):
    result = export_cli(tmp_path, tiny_student, micro_scored, "student.seq_len=65")  # the tiny student has 64
    one_line_refusal(result, "student.seq_len: 65 exceeds the 64 positions")
    nothing_marked(tmp_path / "out")


def test_a_target_folder_holding_another_export(tiny_student, micro_scored, tmp_path):
    out = tmp_path / "existing"
    run_export(make_export(tiny_student, micro_scored, out, rows_per_shard=64))
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    result = export_cli(tmp_path, tiny_student, micro_scored, "export.rows_per_shard=64",
                        "data.seed=5", out=out)
    one_line_refusal(result, "exported with a different setup", "packing.seed: 0 != 5", "overwrite=true")
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()} == before


def test_configuration_mistakes_are_listed_before_any_work(tiny_student, micro_scored, tmp_path):
    result = export_cli(tmp_path, tiny_student, micro_scored, "export.layout=rows", "export.formats=[parquet,mds]",
                        "loss.ratio=0.2")
    for words in ("export.layout: 'rows' is not one of packed, documents", "export.formats: 'mds' is not one of",
                  "loss.ratio: unknown key"):
        assert result.returncode == 2 and words in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "out").exists()
