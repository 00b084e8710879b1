"""Where the rehearsal teacher's loss distribution comes from: the embedded tiny teacher's per-token
losses on the embedded sample corpus, summarised as the quantile knots that
:mod:`pipeline.score_teacher.backends.rehearsal` interpolates.

``python -m rehearsal.calibrate [n_docs]`` builds (or reuses) the tiny teacher under ``artifacts/``,
scores the first ``n_docs`` documents of its sample corpus (clean and noise pages alike, as the
embedded default does) in this process with the transformers backend and the default window plan,
and prints the knots (the losses at probabilities ``k / KNOTS`` for ``k = 0 .. KNOTS``) with the
mean, the standard deviation and a few quantiles of the losses, and of the rehearsal teacher's
losses on the same windows for comparison.
"""

from __future__ import annotations

import json
import sys

import numpy as np

KNOTS = 64


def tiny_teacher_losses(n_docs: int) -> np.ndarray:
    """Every finite per-token loss the tiny teacher gives the first ``n_docs`` sample documents."""
    import pyarrow.parquet as pq

    from pipeline.embedded import ensure_sample_corpus, ensure_tiny_teacher
    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer
    from pipeline.score_teacher.corpus import Document
    from pipeline.score_teacher.teacher import WindowSettings, score_documents
    from pipeline.method.tokenization import load_tokenizer

    teacher = ensure_tiny_teacher("artifacts")
    texts = []
    for path in ensure_sample_corpus("artifacts"):
        texts += pq.read_table(path, columns=["text"]).column("text").to_pylist()
    docs = [Document(f"d{i}", t) for i, t in enumerate(texts[:n_docs])]
    tokenizer = load_tokenizer(str(teacher))
    scorer = TransformersScorer(ScorerConfig(model=str(teacher), window=512))
    result = score_documents(docs, tokenizer, scorer, WindowSettings(window=512, stride=384, bos_id=None))
    losses = np.concatenate([d.losses for d in result.documents])
    return losses[np.isfinite(losses)]


def describe(losses: np.ndarray) -> dict:
    q = np.quantile(losses, [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99])
    return {"tokens": int(losses.size), "mean": float(losses.mean()), "std": float(losses.std()),
            "quantiles_1_10_25_50_75_90_99": [round(float(v), 4) for v in q]}


def main(argv: list[str]) -> int:
    n_docs = int(argv[0]) if argv else 600
    losses = tiny_teacher_losses(n_docs)
    knots = np.quantile(losses, np.linspace(0.0, 1.0, KNOTS + 1))
    print("knots:", "(" + ", ".join(f"{v:.4f}" for v in knots) + ")")
    print("tiny teacher:", json.dumps(describe(losses)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
