"""A run asking for more tokens than the scored data holds is refused before the token count, from
the manifests alone, with one line giving both numbers and the ways out; the paper's recipe is
checked the same way."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.train_student.config import validate
from pipeline.train_student.run import run_training
from test_train_student import compose, make_job


@pytest.fixture
def no_count(monkeypatch):
    """Any student token count fails the test: the refusal must come before the count pass."""

    def count_tokens(tokenizer, texts):
        raise AssertionError("the token count ran")

    monkeypatch.setattr("pipeline.student_data.lengths.count_tokens", count_tokens)


def hand_bound(scored: Path, seq_len: int, samples_per_step: int, ratio: float = 1.25, epochs: int = 1) -> int:
    """The most optimizer steps the manifest allows, worked from its numbers: teacher tokens x ratio
    plus BOS and EOS per row, cut into windows of seq_len (+1 token overlap), then into steps."""
    manifest = json.loads((scored / "manifest.json").read_text())
    teacher = sum(e["tokens"] for e in manifest["shards"])
    rows = sum(e["rows"] for e in manifest["shards"])
    stream = int(teacher * ratio) + 2 * rows
    return ((stream * epochs - 1) // seq_len) // samples_per_step


def test_one_step_past_the_bound_is_refused_before_the_count(tiny_student, micro_scored, tmp_path, no_count):
    bound = hand_bound(micro_scored, seq_len=32, samples_per_step=8)  # make_job: 4 sequences x 2 micro-batches
    with pytest.raises(ValueError) as refused:
        run_training(make_job(tiny_student, micro_scored, tmp_path / "run", steps=bound + 1))
    message = str(refused.value)
    assert "\n" not in message
    assert f"train.max_steps {bound + 1:,} asks for {bound + 1:,} optimizer steps" in message
    teacher = json.loads((micro_scored / "manifest.json").read_text())["totals"]["tokens"]
    assert f"{teacher:,} teacher tokens in 4 shard(s)" in message and f"at most {bound:,} steps" in message
    assert f"train.max_tokens={bound * 8 * 32} or less" in message and "data.epochs=2 or more" in message
    assert not (tmp_path / "lengths").exists() and not (tmp_path / "run").exists()

    job = make_job(tiny_student, micro_scored, tmp_path / "run", steps=bound + 1)
    two_passes = replace(job, data=replace(job.data, epochs=2))  # a way out the message names: passes the check
    with pytest.raises(AssertionError, match="the token count ran"):
        run_training(two_passes)


def test_at_the_bound_the_count_runs_and_the_exact_check_refuses(tiny_student, micro_scored, tmp_path):
    """The bound is an upper bound: a request at it passes the first check, the count runs, and the
    exact check after it refuses (the student tokenizer gives fewer tokens than the bound)."""
    bound = hand_bound(micro_scored, seq_len=32, samples_per_step=8)
    with pytest.raises(ValueError, match=rf"{bound} optimizer steps asked for, the data gives \d+") as refused:
        run_training(make_job(tiny_student, micro_scored, tmp_path / "run", steps=bound))
    assert "train.max_tokens=" in str(refused.value)
    assert list((tmp_path / "lengths").rglob("*.npy")), "counted (and cached) this time"


@pytest.mark.parametrize("experiment", ["paper_qwen", "paper_llemma"])
def test_paper_recipe_asking_for_15b_tokens_of_a_small_scored_folder(experiment, tiny_student, micro_scored,
                                                                     tmp_path, no_count):
    from stages.train_student import job_config

    student = tmp_path / "student-2048"  # the tiny student with room for the recipe's 2048 positions (RoPE)
    shutil.copytree(tiny_student, student)
    config = json.loads((student / "config.json").read_text())
    (student / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    cfg = compose([f"experiment={experiment}", "student.embedded=false", f"student.model={student}",
                   f"data.folders=[{micro_scored}]", f"data.cache_dir={tmp_path}/lengths", "train.use_cpu=true",
                   f"output_dir={tmp_path}/run", "train.max_tokens=15000000000", "train.report_to=[]"])
    job = job_config(cfg)
    assert job.train.global_batch_tokens == 2**21 and job.student.seq_len == 2048
    with pytest.raises(ValueError) as refused:
        run_training(job)
    message = str(refused.value)
    assert "\n" not in message
    assert "train.max_tokens 15,000,000,000 asks for 7,153 optimizer steps of 2,097,152 tokens" in message
    assert "at most 0 steps" in message and "a smaller global batch" in message and "data.epochs=" in message
    assert not (tmp_path / "run").exists()


def test_ratio_bound_must_be_positive(tiny_student, micro_scored, tmp_path):
    job = make_job(tiny_student, micro_scored, tmp_path / "run")
    assert validate(job) == []
    assert validate(replace(job, data=replace(job.data, token_ratio_bound=0))) == [
        "data.token_ratio_bound: must be > 0, got 0"]


@pytest.fixture(scope="module")
def byte_student(tmp_path_factory) -> Path:
    """A tiny Llama on a byte-level BPE of 260 tokens (almost no merges): several student tokens per
    token of the micro teacher, as a 512-token student against a 49k-token teacher on real text."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.inputs import math_texts
    from pipeline.embedded.tiny_teacher import train_tokenizer

    folder = tmp_path_factory.mktemp("byte-student") / "s"
    tokenizer = train_tokenizer(math_texts(20_000), 260)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=64)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_small_student_vocabulary_is_bounded_by_its_sampled_ratio_not_refused(byte_student, micro_scored, tmp_path,
                                                                                no_count):
    """A student with far more tokens per teacher token than data.token_ratio_bound: a length the data
    holds (counted here, by hand) passes the check before the count (the count then runs), where the
    fixed bound alone refused it; one far past what the data holds is still refused before the count."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(byte_student)
    texts = [t for f in sorted(micro_scored.glob("shard-*.parquet")) for t in pq.read_table(f)["text"].to_pylist()]
    student = sum(len(x) for x in tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    rows = len(texts)
    holds = (((student + 2 * rows) - 1) // 32) // 8  # the steps the data truly gives (BOS at most and EOS)
    assert holds > hand_bound(micro_scored, seq_len=32, samples_per_step=8), "the fixed bound would refuse it"
    with pytest.raises(AssertionError, match="the token count ran"):
        run_training(make_job(byte_student, micro_scored, tmp_path / "run", steps=holds))
    with pytest.raises(ValueError, match=r"per teacher token, 1\.25 x \d\.\d\d on a sample of documents"):
        run_training(make_job(byte_student, micro_scored, tmp_path / "run", steps=3 * holds))
