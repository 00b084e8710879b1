"""The embedded default: a sample corpus in OpenWebMath's schema and a tiny teacher trained on it.

Both are built by the project itself, deterministically, on first use, and cached under an
artifacts folder; nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.embedded.tiny_teacher import TinyTeacherSpec, build_tiny_teacher


@dataclass(frozen=True)
class EmbeddedSpec:
    n_docs: int = 3000
    n_files: int = 4
    seed: int = 0
    teacher: TinyTeacherSpec = field(default_factory=TinyTeacherSpec)


def corpus_dir(artifacts: str | Path, spec: EmbeddedSpec) -> Path:
    return Path(artifacts) / f"sample-corpus-n{spec.n_docs}-s{spec.seed}"


def ensure_sample_corpus(artifacts: str | Path, spec: EmbeddedSpec = EmbeddedSpec()) -> list[Path]:
    from pipeline.embedded.sample_corpus import build_sample_corpus

    return build_sample_corpus(corpus_dir(artifacts, spec), n_docs=spec.n_docs, n_files=spec.n_files, seed=spec.seed)


def ensure_tiny_teacher(artifacts: str | Path, spec: EmbeddedSpec = EmbeddedSpec()) -> Path:
    """Build (or reuse) the tiny teacher, trained on the clean documents of the sample corpus."""
    import pyarrow.parquet as pq

    from pipeline.embedded.sample_corpus import clean_texts

    files = ensure_sample_corpus(artifacts, spec)
    texts = clean_texts(files)
    held_out = max(1, len(texts) // 20)  # the last 5% of clean documents are never trained on
    noise = [
        t
        for f in files
        for t, m in zip(*pq.read_table(f, columns=["text", "metadata"]).to_pydict().values())
        if t and json.loads(m or "{}").get("kind") == "noise"
    ]
    out = Path(artifacts) / f"tiny-teacher-n{spec.n_docs}-s{spec.seed}"
    return build_tiny_teacher(
        texts[:-held_out], out, spec.teacher, eval_texts={"clean_held_out": texts[-held_out:], "noise": noise}
    )
