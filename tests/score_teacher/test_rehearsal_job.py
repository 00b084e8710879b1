"""Stage 1 with the rehearsal teacher (scorer.backend=rehearsal) through the real job (Ray actors,
windows, writer, markers, manifest, card), and its refusal by stage 2 and the export unless
``data.allow_rehearsal=true`` (docs/RELIABILITY.md, rows 340-345).

The teacher is Qwen2.5's real tokenizer (saved as a folder, so each actor loads it in a second);
the reference losses are computed from the stored token ids by the definition, token by token."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.folders.rehearsal import NOTE, RehearsalDataError
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.job import run_score_job
from rehearsal_reference import reference_window
from storage_schemas import read_manifest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen_folder(real_tokenizer, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2.5-tokenizer")
    real_tokenizer("qwen2").save_pretrained(str(folder))
    return folder


def rehearsal_job(tokenizer: Path, corpus, out: Path, seed: int = 0) -> ScoreJobConfig:
    return ScoreJobConfig(
        teacher=TeacherConfig(name="rehearsal-qwen2.5", model=str(tokenizer), window=64, stride=48),
        corpus=CorpusConfig(name="owm-micro", files=[str(f) for f in corpus], rows_per_shard=40),
        scorer=ScorerConfig(backend="rehearsal", seed=seed), output_dir=str(out),
        pool=PoolConfig(num_actors=2, num_cpus=1), progress=False)


@pytest.fixture(scope="module")
def rehearsal_scored(qwen_folder, micro_corpus, ray_local, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rehearsal-scored") / "v1"
    run_score_job(rehearsal_job(qwen_folder, micro_corpus, out))
    return out


def shard_digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("shard-*.parquet"))}


def test_the_output_says_rehearsal_in_identity_manifest_and_card(rehearsal_scored):
    manifest = read_manifest(rehearsal_scored)
    teacher = manifest["identity"]["teacher"]
    assert teacher["backend"] == "rehearsal" and teacher["source"] == "rehearsal" and teacher["model"] is None
    assert teacher["rehearsal"]["version"] >= 1 and teacher["vocab_size"] == 151_936  # Qwen2.5: 151,643 + specials, padded
    assert manifest["rehearsal"] == NOTE and manifest["complete"]
    assert all(e["scored_by"]["engine"]["name"] == "rehearsal" for e in manifest["shards"])
    card = (rehearsal_scored / "README.md").read_text()
    assert f"**{NOTE}.**" in card


def test_stored_losses_are_the_definition_of_the_stored_tokens(rehearsal_scored):
    """Documents longer than the window of 64 are scored in windows; each stored loss is still the
    function of its token and the 8 before it in the document (every later window keeps 16
    tokens of left context), and the first token's is NaN (Qwen2 adds no BOS)."""
    checked = long = 0
    for path in sorted(rehearsal_scored.glob("shard-*.parquet")):
        for row in pq.read_table(path).to_pylist():
            ids, losses = row["token_ids"], np.asarray(row["losses"], np.float32)
            if not ids:
                continue
            want = np.asarray(reference_window(0, ids), np.float32)
            # stored losses are rounded to bfloat16 (the default storage): round the reference the same way
            bits = want.view(np.uint32)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)).view(np.float32)
            want = np.where(np.isnan(want), want, rounded)
            np.testing.assert_array_equal(losses, want)
            checked += 1
            long += len(ids) > 64
    assert checked > 100 and long > 50


def test_a_rerun_scores_nothing_keeps_a_current_card_and_a_second_run_writes_the_same_bytes(rehearsal_scored, qwen_folder, micro_corpus,
                                                                      ray_local, tmp_path):
    card = rehearsal_scored / "README.md"
    before = (card.stat().st_mtime_ns, card.read_bytes())
    again = run_score_job(rehearsal_job(qwen_folder, micro_corpus, rehearsal_scored))
    assert again.shards_scored == 0 and again.complete and again.rehearsal
    assert (card.stat().st_mtime_ns, card.read_bytes()) == before  # the card already described these shards
    card.write_text("a card of other shards")
    run_score_job(rehearsal_job(qwen_folder, micro_corpus, rehearsal_scored))
    assert card.read_bytes() == before[1]  # written again, as before
    other = run_score_job(rehearsal_job(qwen_folder, micro_corpus, tmp_path / "v1"))
    assert other.shards_scored == 4
    assert shard_digests(tmp_path / "v1") == shard_digests(rehearsal_scored)  # another seed: test_rehearsal_backend


def test_stage2_refuses_rehearsal_scores_unless_told(rehearsal_scored, tiny_student, tmp_path):
    from pipeline.train_student.config import DataConfig, StudentConfig, TrainConfig, TrainJobConfig
    from pipeline.train_student.run import run_training

    job = TrainJobConfig(
        student=StudentConfig(name="t", model=str(tiny_student), seq_len=32),
        data=DataConfig(folders=[str(rehearsal_scored)], cache_dir=str(tmp_path / "lengths"), num_workers=0),
        train=TrainConfig(micro_batch_size=4, max_steps=2, logging_steps=1, save_steps=2, report_to=[], progress=False,
                          use_cpu=True, cpu_threads=1),
        output_dir=str(tmp_path / "run"))
    with pytest.raises(RehearsalDataError) as refused:
        run_training(job)
    message = str(refused.value)
    assert "\n" not in message and str(rehearsal_scored) in message and "data.allow_rehearsal=true" in message
    assert not (tmp_path / "run").exists()
    summary = run_training(replace(job, data=replace(job.data, allow_rehearsal=True)))
    assert summary.steps == 2 and summary.data["teacher"] == "rehearsal-qwen2.5"


def test_the_export_refuses_rehearsal_scores_unless_told(rehearsal_scored, tiny_student, tmp_path):
    from pipeline.export_student.config import DataConfig, ExportConfig, ExportJobConfig, StudentConfig
    from pipeline.export_student.job import run_export

    job = ExportJobConfig(student=StudentConfig(name="t", model=str(tiny_student), seq_len=32),
                          data=DataConfig(folders=[str(rehearsal_scored)], cache_dir=str(tmp_path / "lengths")),
                          export=ExportConfig(rows_per_shard=16, progress=False), output_dir=str(tmp_path / "out"))
    with pytest.raises(RehearsalDataError, match="data.allow_rehearsal=true"):
        run_export(job)
    assert not (tmp_path / "out").exists()
    summary = run_export(replace(job, data=replace(job.data, allow_rehearsal=True)))
    assert summary.complete and summary.rows > 0
    assert f"**{NOTE}.**" in (tmp_path / "out" / "README.md").read_text()


def test_train_student_says_so_in_one_line_exit_2(rehearsal_scored, tiny_student, tmp_path):
    env = {**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"}
    args = ["student.embedded=false", "student.name=t", f"student.model={tiny_student}", "student.seq_len=32",
            f"data.folders=[{rehearsal_scored}]", f"data.cache_dir={tmp_path}/lengths", f"output_dir={tmp_path}/run",
            "train.max_steps=2", f"hydra.run.dir={tmp_path}/logs", f"artifacts_dir={tmp_path}/artifacts"]
    result = subprocess.run([sys.executable, "-m", "stages.train_student", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env=env)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: ") and "rehearsal" in lines[0] and "data.allow_rehearsal=true" in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_rehearsal_preset_asks_no_model_and_needs_a_window(qwen_folder, micro_corpus, tmp_path):
    """The preset composes into a valid job (no model config is read, its window is 4096), and a
    rehearsal teacher without a window is refused before any work, naming the setting."""
    from hydra import compose, initialize_config_dir

    from pipeline.runtime.config import ConfigError
    from stages.score_teacher import job_config

    def _compose(name: str, overrides: list[str]):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            return compose(config_name=name, overrides=overrides)

    cfg = _compose("score_teacher", ["teacher=rehearsal-qwen2.5", f"teacher.model={qwen_folder}", "data.source=files",
                          "data.name=mine", "data.embedded=false", f"data.files=[{micro_corpus[0]}]",
                          f"output_root={tmp_path}"])
    job = job_config(cfg)
    assert (job.scorer.backend, job.teacher.window, job.pool.num_gpus) == ("rehearsal", 4096, 0.0)
    with pytest.raises(ConfigError, match="teacher.window: required with scorer.backend=rehearsal"):
        job_config(_compose("score_teacher", ["teacher=rehearsal-qwen2.5", f"teacher.model={qwen_folder}", "teacher.window=null",
                                   "data.source=files", "data.name=mine", "data.embedded=false",
                                   f"data.files=[{micro_corpus[0]}]"]))
