"""The bill before the run (``plan=true``): stage 1's counts against a brute-force count with the
teacher's tokenizer and a real scoring's bytes; the estimate within its stated error; the command
line prints the bill without starting Ray or writing anything. Stage 2's plan: samples and steps
against the run's own packing, student tokens against the length cache and a brute-force count."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.plan import plan_score_job
from pipeline.method.tokenization import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def job(teacher: Path, corpus, out: Path, rows_per_shard: int = 40) -> ScoreJobConfig:
    return ScoreJobConfig(teacher=TeacherConfig(name="micro", model=str(teacher), window=64, stride=48),
                          corpus=CorpusConfig(name="owm-micro", files=[str(f) for f in corpus],
                                              rows_per_shard=rows_per_shard),
                          scorer=ScorerConfig(), output_dir=str(out), pool=PoolConfig(num_actors=1), progress=False)


def brute_force_tokens(teacher: Path, corpus) -> tuple[int, int]:
    """(teacher tokens, documents stored) of every readable text, one document at a time."""
    tokenizer = load_tokenizer(str(teacher))
    texts = [t for f in corpus for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
    kept = [t for t in texts if t is not None]
    return sum(len(tokenizer(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]) for t in kept
               if t.strip()), len(kept)


def test_a_small_corpus_is_counted_exactly(micro_teacher, micro_corpus, micro_scored, tmp_path):
    plan = plan_score_job(job(micro_teacher, micro_corpus, tmp_path / "none"), tokens_per_s=1000.0, measure=True)
    tokens, stored = brute_force_tokens(micro_teacher, micro_corpus)
    assert plan.counted and plan.tokens_error == 0 and plan.teacher_tokens == tokens
    assert (plan.files, plan.documents, plan.shards, plan.shards_done) == (2, 160, 4, 0) and plan.sample_documents == stored
    assert plan.gpu_hours == pytest.approx(tokens / 1000.0 / 3600)
    scored = micro_scored / "manifest.json"
    import json

    real = json.loads(scored.read_text())["totals"]
    assert real["tokens"] == tokens  # the real job stores the same tokens
    assert plan.bytes_per_token == pytest.approx(real["bytes"] / real["tokens"], rel=0.25)  # one shard vs four


def test_a_large_corpus_is_estimated_within_its_error(micro_teacher, micro_corpus, micro_scored, tmp_path):
    scored_as = job(micro_teacher, micro_corpus, micro_scored)  # the folder's own windows (64, stride 32): else refused
    scored_as = replace(scored_as, teacher=replace(scored_as.teacher, stride=32))
    plan = plan_score_job(scored_as, count_bytes=0, sample_bytes=60_000)
    tokens, _ = brute_force_tokens(micro_teacher, micro_corpus)
    assert not plan.counted and 0 < plan.sample_groups < 8 and plan.gpu_hours is None
    assert abs(plan.teacher_tokens - tokens) <= 2 * plan.tokens_error * tokens + 1, (plan.teacher_tokens, tokens, plan.tokens_error)
    assert plan.shards_done == 4  # the scored folder given as the output: every shard already done


def test_plan_true_prints_the_bill_and_starts_nothing(micro_teacher, micro_corpus, tmp_path):
    env = {**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1", "COLUMNS": "400"}
    args = ["teacher.embedded=false", "teacher.name=micro", f"teacher.model={micro_teacher}", "teacher.window=64", "teacher.stride=48",
            "data=open-web-math", "data.source=files", "data.hub_id=null", f"data.files=[{micro_corpus[0]}]",
            f"output_root={tmp_path / 'scored'}", "plan=true", "plan_tokens_per_s=5000", f"hydra.run.dir={tmp_path}/logs"]
    result = subprocess.run([sys.executable, "-m", "stages.score_teacher", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = " ".join(result.stdout.split())
    assert "the bill before the run (nothing was scored)" in out and "(counted)" in out
    assert "at 5,000 teacher tokens/s per actor (1 CPU) (plan_tokens_per_s)" in out  # a CPU job: per actor
    assert not (tmp_path / "scored").exists() and "ray" not in result.stderr.lower()


def test_the_training_plan_matches_the_runs_packing(micro_scored, tiny_student, tmp_path):
    from pipeline.student_data.build import build_student_data
    from pipeline.student_data.settings import AlignmentConfig, PackingConfig
    from pipeline.train_student.plan import plan_training
    from pipeline.train_student.config import DataConfig, StudentConfig, TrainConfig, TrainJobConfig
    from storage_schemas.reader import open_scored_dataset

    run = TrainJobConfig(student=StudentConfig(name="t", model=str(tiny_student), seq_len=32),
                         data=DataConfig(folders=[str(micro_scored)], cache_dir=str(tmp_path / "lengths"), epochs=2),
                         train=TrainConfig(micro_batch_size=4, gradient_accumulation_steps=2, max_steps=5),
                         output_dir=str(tmp_path / "run"))
    estimated = plan_training(run)
    tokenizer = load_tokenizer(str(tiny_student))
    data = build_student_data(open_scored_dataset([micro_scored]), tokenizer, PackingConfig(seq_len=32, epochs=2),
                              AlignmentConfig(), cache_dir=str(tmp_path / "lengths"))  # fills the length cache
    exact = plan_training(run)
    truth = int(sum(int(c) for s in data.scored.shards for c in
                    [len(tokenizer(t, add_special_tokens=False, split_special_tokens=True)["input_ids"])
                     for t in pq.read_table(s.path, columns=["text"]).column("text").to_pylist()]))
    assert exact.counted and exact.student_tokens == truth
    assert (exact.samples, exact.stream_tokens) == (data.plan.n_samples, data.plan.n_tokens)
    assert exact.samples_per_step == 8 and exact.steps_available == data.plan.n_samples // 8 and exact.steps == 5
    assert not estimated.counted and abs(estimated.student_tokens - truth) <= 2 * estimated.student_tokens_error * truth + 1
    assert replace(exact, seconds=0).documents == 160 - 2  # the micro corpus's two null texts are not stored


def test_the_bill_uses_the_gpu_bench_rate_when_one_was_measured(tmp_path, monkeypatch):
    """The GPU-hours rate: plan_tokens_per_s, else the 4096-window scorer figure of a gpu-bench
    report (with the device that measured it), else the stated reference."""
    import json

    import stages.score_teacher as stage

    base = job(tmp_path, [], tmp_path / "out")
    monkeypatch.setattr(stage, "GPU_BENCH_RESULT", tmp_path / "none.json")
    assert stage.bill_rate(base)[0] == stage.REFERENCE_TOKENS_PER_S
    report = tmp_path / "gpu-latest.json"
    report.write_text(json.dumps({"machine": {"device": "NVIDIA H200", "cuda": "13.0"}, "figures": [
        {"key": "scorer_tokens_per_s_teacher_w2048", "value": 35151.0},
        {"key": "scorer_tokens_per_s_teacher_w4096", "value": 34263.4}]}))
    monkeypatch.setattr(stage, "GPU_BENCH_RESULT", report)
    rate, source = stage.bill_rate(base)
    assert rate == 34263.4 and "NVIDIA H200" in source and "4096" in source
    assert stage.bill_rate(replace(base, plan_tokens_per_s=5000.0)) == (5000.0, "plan_tokens_per_s")
