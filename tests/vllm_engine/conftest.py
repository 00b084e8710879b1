"""The vLLM tests' teachers and engines (``make test-vllm``, in ``.venv-vllm`` against the real engine:
vLLM's CPU build where there is no GPU).

vLLM's CPU attention runs head sizes of 32 and more, so these teachers have ``hidden_size / num_heads
= 32`` (the shared micro teacher's 16 is the unsupported case). An engine takes 20-40 s to start
on two cores: a test module starts one for all its tests and stops it at the end.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.vllm_engine.helpers import vllm_processes

VLLM_TEACHER_SPEC = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                         num_kv_heads=1, context=64, block=32, batch_size=8, steps=30, learning_rate=5e-3)
BOS_TEACHER_SPEC = dict(vocab_size=640, limit_alphabet=100, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=2, num_kv_heads=1, context=64, seed=5)


@pytest.fixture(scope="session")
def vllm_teacher(tmp_path_factory, micro_corpus) -> Path:
    """A tiny trained Qwen2 (64 positions, head size 32, no BOS) and its byte-level BPE tokenizer."""
    from pipeline.embedded.sample_corpus import clean_texts
    from pipeline.embedded.tiny_teacher import TinyTeacherSpec, build_tiny_teacher

    texts = clean_texts(micro_corpus)
    return build_tiny_teacher(texts, tmp_path_factory.mktemp("teacher") / "vllm-micro", TinyTeacherSpec(**VLLM_TEACHER_SPEC))


@pytest.fixture(scope="session")
def bos_teacher(tmp_path_factory, micro_corpus) -> Path:
    """A random-init Llama (64 positions, head size 32) whose SentencePiece-style tokenizer puts BOS first."""
    from pipeline.embedded.sample_corpus import clean_texts
    from pipeline.embedded.tiny_student import TinyStudentSpec, build_tiny_student

    return build_tiny_student(clean_texts(micro_corpus), tmp_path_factory.mktemp("teacher") / "bos-micro",
                              TinyStudentSpec(**BOS_TEACHER_SPEC))


@pytest.fixture(scope="session", autouse=True)
def no_engine_left_behind():
    """At the end, no engine process (VLLM::EngineCore, VLLM::Worker) of this session is left; any
    that is, is killed and reported."""
    yield
    left = vllm_processes()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"engine processes left running: {left}"
