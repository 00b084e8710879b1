"""Stage-1 document handling on hostile text, through the real tokenizer and the micro teacher."""

from __future__ import annotations

import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.hf import TransformersScorer
from pipeline.score_teacher.corpus import CorpusConfig, Document
from pipeline.score_teacher.shards import plan_shards, read_shard
from pipeline.score_teacher.corpus_sources import resolve_sources
from pipeline.score_teacher.teacher import WindowSettings, score_documents
from pipeline.method.tokenization import load_tokenizer
from tests.hostile_text import HOSTILE


@pytest.fixture(scope="module")
def teacher(micro_teacher):
    return load_tokenizer(str(micro_teacher)), TransformersScorer(ScorerConfig(model=str(micro_teacher), window=64))


def _check_document(doc, text, normalised_away=""):
    assert doc.text == text
    n = len(doc.ids)
    assert n > 0 and len(doc.starts) == len(doc.ends) == len(doc.losses) == n
    assert (0 <= doc.starts).all() and (doc.starts <= doc.ends).all() and (doc.ends <= len(text)).all()
    assert (np.diff(doc.starts) >= 0).all()
    assert np.isnan(doc.losses[0]) and np.isfinite(doc.losses[1:]).all()
    covered = np.zeros(len(text), bool)
    for s, e in zip(doc.starts, doc.ends):
        covered[s:e] = True
    uncovered = "".join(ch for ch, c in zip(text, covered) if not c)
    assert uncovered == normalised_away, f"uncovered characters {uncovered!r}"


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_text_is_scored_with_valid_offsets(teacher, kind):
    tok, scorer = teacher
    text = HOSTILE[kind]
    result = score_documents([Document(f"h:{kind}", text)], tok, scorer, WindowSettings(64, 32, None))
    assert result.reasons == {} and len(result.documents) == 1
    # The teacher tokenizer NFC-normalises (as Qwen2's tokenizer.json does): "e" + U+0301 becomes
    # one "é" whose offsets cover the "e" only, so combining marks merged by NFC have no teacher
    # span. Every other character is covered by byte-level BPE.
    merged = "".join(ch for prev, ch in zip(text, text[1:])
                     if unicodedata.combining(ch) and len(unicodedata.normalize("NFC", prev + ch)) == 1)
    _check_document(result.documents[0], text, normalised_away=merged if kind == "combining" else "")


def _long_line(n_chars: int) -> str:
    unit = "Let $x_k = k^2$; then \\sum_{k=1}^{n} x_k = n(n+1)(2n+1)/6 🙂 ∑ 数学 "
    return (unit * (n_chars // len(unit) + 1))[:n_chars]


def _score_long_line(teacher, n_chars):
    tok, scorer = teacher
    text = _long_line(n_chars)
    assert "\n" not in text
    result = score_documents([Document("long:0", text)], tok, scorer, WindowSettings(64, 48, None))
    doc = result.documents[0]
    _check_document(doc, text)
    assert len(doc.ids) == len(tok(text, add_special_tokens=False)["input_ids"]), "nothing is truncated"


def test_long_single_line_document(teacher):
    _score_long_line(teacher, 200_000)


@pytest.mark.slow
def test_ten_megabyte_single_line_document(teacher):
    _score_long_line(teacher, 10_000_000)


def test_duplicate_rows_keep_distinct_stable_ids(tmp_path):
    path = tmp_path / "dups.parquet"
    pq.write_table(pa.table({"text": ["same text", "same text", "other", "same text"]}), path)
    shards = plan_shards(resolve_sources(CorpusConfig(files=[str(path)], rows_per_shard=3)), 3)
    ids = [d.doc_id for s in shards for d in read_shard(s)]
    assert ids == ["dups.parquet:0", "dups.parquet:1", "dups.parquet:2", "dups.parquet:3"]
