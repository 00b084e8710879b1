"""The embedded default: a sample corpus in OpenWebMath's schema, a tiny teacher trained on it and a
tiny student with another vocabulary (test and demo fixtures, not part of the library).

All are built by the project itself, deterministically, on first use, and cached under an
artifacts folder (``artifacts/sample-corpus-n<docs>-s<seed>``, ``artifacts/tiny-teacher-n<docs>-s<seed>``,
``artifacts/tiny-student-n<docs>-s<seed>``); nothing is downloaded. Their specs share
:class:`~pipeline.embedded.model_shape.ModelShape`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.embedded.sample_corpus import build_sample_corpus, clean_texts
from pipeline.embedded.tiny_teacher import TinyTeacherSpec, build_tiny_teacher

N_FILES = 4


def sample_corpus_dir(artifacts: str | Path, n_docs: int, seed: int = 0) -> Path:
    return Path(artifacts) / f"sample-corpus-n{n_docs}-s{seed}"


def tiny_teacher_dir(artifacts: str | Path, corpus_docs: int, seed: int = 0) -> Path:
    return Path(artifacts) / f"tiny-teacher-n{corpus_docs}-s{seed}"


def ensure_sample_corpus(artifacts: str | Path, n_docs: int = 3000, seed: int = 0, n_files: int = N_FILES) -> list[Path]:
    return build_sample_corpus(sample_corpus_dir(artifacts, n_docs, seed), n_docs=n_docs, n_files=n_files, seed=seed)


def ensure_tiny_teacher(
    artifacts: str | Path, corpus_docs: int = 3000, seed: int = 0, spec: TinyTeacherSpec = TinyTeacherSpec()
) -> Path:
    """Build (or reuse) the tiny teacher, trained on the clean documents of the sample corpus.

    The last 5% of clean documents are held out; the build stamp reports the loss on them and on
    the noise documents, before and after training.
    """

    files = ensure_sample_corpus(artifacts, corpus_docs, seed)
    texts = clean_texts(files)
    held_out = max(1, len(texts) // 20)
    noise = []
    for f in files:
        table = pq.read_table(f, columns=["text", "metadata"]).to_pydict()
        noise += [t for t, m in zip(table["text"], table["metadata"]) if t and json.loads(m or "{}").get("kind") == "noise"]
    return build_tiny_teacher(
        texts[:-held_out],
        tiny_teacher_dir(artifacts, corpus_docs, seed),
        spec,
        eval_texts={"clean_held_out": texts[-held_out:], "noise": noise},
    )
