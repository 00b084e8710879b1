"""Shared fixtures: tiny real models and corpora built in seconds, real tokenizers, one local Ray."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The session's own Hugging Face caches (hub, datasets, modules), empty at the start and removed at
# the end, whatever the machine's caches hold: every one follows HF_HOME, set before any test imports
# datasets or transformers and inherited by every child process a test starts.
_HF_HOME = tempfile.mkdtemp(prefix="vocagno-tests-hf-")
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)
os.environ["HF_HOME"] = _HF_HOME
for _name in ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_MODULES_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE"):
    os.environ.pop(_name, None)

REPO = Path(__file__).resolve().parent
SHARED_TOKENIZERS = REPO.parent / "shared" / "tokenizers"


@pytest.fixture(scope="session")
def shared_tokenizers() -> Path:
    if not SHARED_TOKENIZERS.is_dir():
        pytest.skip(f"real tokenizer vocabularies not found at {SHARED_TOKENIZERS}")
    return SHARED_TOKENIZERS


REAL_TOKENIZER_FILES = {
    "llama-spm": "ggml-vocab-llama-spm.gguf",  # TinyLlama / Llama-2 (the student), Llemma
    "qwen2": "ggml-vocab-qwen2.gguf",  # Qwen2.5-Math
    "deepseek": "ggml-vocab-deepseek-llm.gguf",  # DeepSeekMath
    "mistral": "mistral-v1.tokenizer.model",  # Mistral-7B / Mistral-ProXMath
}


@pytest.fixture(scope="session")
def real_tokenizer(shared_tokenizers):
    """``real_tokenizer(name)``: the real tokenizer, loaded once per session (Qwen2's takes ~10 s)."""
    from pipeline.method.tokenization import load_tokenizer

    cache = {}

    def load(name: str):
        if name not in cache:
            cache[name] = load_tokenizer(str(shared_tokenizers / REAL_TOKENIZER_FILES[name]))
        return cache[name]

    return load


@pytest.fixture(scope="session")
def micro_corpus(tmp_path_factory) -> list[Path]:
    """A 160-document sample corpus in OpenWebMath's schema (two Parquet files)."""
    from pipeline.embedded.sample_corpus import build_sample_corpus

    return build_sample_corpus(tmp_path_factory.mktemp("corpus"), n_docs=160, n_files=2, seed=1)


MICRO_TEACHER_SPEC = dict(vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                          num_kv_heads=1, context=64, block=32, batch_size=8, steps=30, learning_rate=5e-3)


def build_micro_teacher(corpus_files, out_dir) -> Path:
    """Train on the clean documents but the last 10, which are held out for the build's eval."""
    from pipeline.embedded.sample_corpus import clean_texts
    from pipeline.embedded.tiny_teacher import TinyTeacherSpec, build_tiny_teacher

    texts = clean_texts(corpus_files)
    return build_tiny_teacher(texts[:-10], out_dir, TinyTeacherSpec(**MICRO_TEACHER_SPEC),
                              eval_texts={"clean_held_out": texts[-10:]})


@pytest.fixture(scope="session")
def micro_teacher_builder():
    """``build_micro_teacher`` for a test that builds the micro teacher again (a test module cannot
    import it from ``conftest``: another folder's conftest.py may hold that name)."""
    return build_micro_teacher


@pytest.fixture(scope="session")
def micro_teacher(tmp_path_factory, micro_corpus) -> Path:
    """A tiny Qwen2 teacher (context 64, so real documents are scored in many windows)."""
    return build_micro_teacher(micro_corpus, tmp_path_factory.mktemp("teacher") / "micro")


MICRO_STUDENT_SPEC = dict(vocab_size=640, limit_alphabet=100, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=2, num_kv_heads=1, context=64, seed=3)


@pytest.fixture(scope="session")
def tiny_student(micro_corpus, tmp_path_factory) -> Path:
    """A tiny Llama student with its own SentencePiece-style vocabulary (context 64)."""
    from pipeline.embedded.sample_corpus import clean_texts
    from pipeline.embedded.tiny_student import TinyStudentSpec, build_tiny_student

    return build_tiny_student(clean_texts(micro_corpus), tmp_path_factory.mktemp("students") / "sp",
                              TinyStudentSpec(**MICRO_STUDENT_SPEC))


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for the whole session (dashboard off); jobs reuse it."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def micro_scored(tmp_path_factory, micro_corpus, micro_teacher, ray_local) -> Path:
    """A complete scored dataset (stage-1 output) of the micro corpus by the micro teacher."""
    from pipeline.score_teacher.corpus import CorpusConfig
    from storage_schemas import dataset_dir
    from pipeline.score_teacher.pool import PoolConfig
    from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
    from pipeline.score_teacher.job import run_score_job
    from pipeline.score_teacher.backends.base import ScorerConfig

    out = dataset_dir(tmp_path_factory.mktemp("micro-scored"), "owm-micro", "micro")
    run_score_job(ScoreJobConfig(
        teacher=TeacherConfig(name="micro", model=str(micro_teacher)),
        corpus=CorpusConfig(name="owm-micro", files=[str(f) for f in micro_corpus], rows_per_shard=40),
        scorer=ScorerConfig(max_batch_tokens=2048),
        output_dir=str(out),
        pool=PoolConfig(num_actors=1, num_cpus=1),
        progress=False,
    ))
    return out


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (moto's server mode) on 127.0.0.1 for the session: the standard AWS variables
    (``AWS_ENDPOINT_URL`` included) point at it, so pyarrow, Ray actors started after this fixture
    and child processes all reach it. Yields ``new_bucket()``, which makes an empty bucket and
    returns its ``s3://`` URI."""
    pytest.importorskip("moto.server")
    import itertools

    from local_s3 import local_s3_server

    counter = itertools.count()
    with local_s3_server("testing") as make_bucket:
        yield lambda: make_bucket(f"bucket-{next(counter)}")
