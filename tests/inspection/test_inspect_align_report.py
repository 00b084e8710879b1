"""``inspect align-report``: every per-token measure against a brute-force count over character
sets, on documents scored by the real stage 1 and the real TinyLlama/Llama-2 student tokenizer;
report totals, the written Parquet, and the identical-tokenizer case."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.inspection.align_report import (
    ALIGNED_SCHEMA,
    META_ALIGNED,
    _union_length_by_group,
    align_record,
    align_report,
)
from storage_schemas.reader import ScoredDataset
from pipeline.method.tokenization import encode

CHUNKS = (1, 3, 16)


@pytest.fixture(scope="module")
def student(real_tokenizer):
    return real_tokenizer("llama-spm")


def brute_force(record, enc, chunk_counts=CHUNKS, how: str = "max") -> dict:
    """Every measure from explicit character masks, token by token."""
    reduce = {"max": max, "mean": lambda v: sum(v) / len(v)}[how]
    text_len = len(record.text)
    a, b, losses = record.starts.astype(int), record.ends.astype(int), record.losses.astype(float)
    c, d = enc.starts.astype(int), enc.ends.astype(int)

    def mask(starts, ends) -> np.ndarray:
        m = np.zeros(text_len + 1, dtype=bool)
        for s, e in zip(starts, ends):
            m[s:e] = True
        return m

    def quality(i: int, members: np.ndarray) -> tuple[float, float]:
        own, union = mask([c[i]], [d[i]]), mask(a[members], b[members])
        return (own & union).sum() / own.sum(), (own & union).sum() / (own | union).sum()

    out = {"fanout": [], "mapped": [], "ios": [], "iou": [], "loss": [], "chunks": {n: ([], [], []) for n in chunk_counts}}
    valid = (b > a) & ~np.isnan(losses)
    chunk_of = {n: (lambda x, n=n: min(x * n // text_len, n - 1)) for n in chunk_counts}
    t_chunk = {n: np.array([chunk_of[n](x) for x in a]) for n in chunk_counts}
    for i in range(c.size):
        members = np.flatnonzero((a < d[i]) & (b > c[i]) & (b > a)) if d[i] > c[i] else np.zeros(0, int)
        finite = members[~np.isnan(losses[members])]
        out["fanout"].append(members.size)
        out["mapped"].append(finite.size > 0)
        out["loss"].append(reduce(losses[finite].tolist()) if finite.size else np.nan)
        ios, iou = quality(i, members) if finite.size else (np.nan, np.nan)
        out["ios"].append(ios)
        out["iou"].append(iou)
        for n in chunk_counts:
            in_chunk = np.flatnonzero(valid & (t_chunk[n] == chunk_of[n](c[i])))
            ok = d[i] > c[i] and in_chunk.size > 0
            ios_c, iou_c = quality(i, in_chunk) if ok else (np.nan, np.nan)
            for store, value in zip(out["chunks"][n], (ok, ios_c, iou_c)):
                store.append(value)
    return out


def test_every_measure_matches_brute_force_on_real_documents(micro_scored, student):
    ds = ScoredDataset.open(micro_scored)
    records = sorted((r for r in ds.iter_documents() if len(r)), key=len)[:8:2]  # short ones, for brute force
    for record in records:
        enc = encode(student, record.text)
        got = align_record(record, enc, "max", CHUNKS)
        want = brute_force(record, enc)
        np.testing.assert_array_equal(got.fanout, want["fanout"])
        np.testing.assert_array_equal(got.token.mapped, want["mapped"])
        np.testing.assert_allclose(got.teacher_loss, want["loss"], rtol=1e-6, equal_nan=True)
        np.testing.assert_allclose(got.token.ios, want["ios"], equal_nan=True)
        np.testing.assert_allclose(got.token.iou, want["iou"], equal_nan=True)
        for n in CHUNKS:
            mapped, ios, iou = want["chunks"][n]
            np.testing.assert_array_equal(got.chunks[n].mapped, mapped, err_msg=f"C={n}")
            np.testing.assert_allclose(got.chunks[n].ios, ios, equal_nan=True, err_msg=f"C={n}")
            np.testing.assert_allclose(got.chunks[n].iou, iou, equal_nan=True, err_msg=f"C={n}")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 30), st.integers(0, 12)), max_size=25))
def test_union_length_by_group(intervals):
    intervals = sorted((g, s, s + w) for g, s, w in intervals)  # by group, then start
    group = np.array([g for g, _, _ in intervals], dtype=np.int64)
    starts = np.array([s for _, s, _ in intervals], dtype=np.int64)
    ends = np.array([e for _, _, e in intervals], dtype=np.int64)
    got = _union_length_by_group(group, starts, ends, 5)
    want = [len({x for g, s, e in intervals if g == k for x in range(s, e)}) for k in range(5)]
    np.testing.assert_array_equal(got, want)


def test_report_totals_and_aligned_parquet(micro_scored, student, tmp_path):
    ds = ScoredDataset.open(micro_scored)
    report = align_report(ds, student, "llama-spm", how="mean", chunk_counts=(2, 8), limit_docs=30, write_dir=tmp_path)
    records = list(ds.iter_documents(limit=30))
    encodings = [encode(student, r.text) for r in records]
    want = [brute_force(r, e, chunk_counts=(), how="mean") for r, e in zip(records, encodings)]
    d = report.to_dict()
    assert d["documents"] == 30 and d["teacher_tokens"] == sum(len(r) for r in records)
    assert d["student_tokens"] == sum(len(e) for e in encodings)
    assert report.token_level.mapped == sum(sum(w["mapped"]) for w in want)
    assert sum(d["teacher_per_student"].values()) == d["student_tokens"] - d["empty_student_spans"]
    assert set(d["chunk_level"]) == {"2", "8"}
    # Byte-level teacher tokens cover every character: token-level IoS is 1; chunks cut through
    # student tokens whose characters a teacher token from the previous chunk covers.
    assert d["token_level"]["ios_mean"] == pytest.approx(1.0) and d["chunk_level"]["8"]["ios_mean"] < 1.0
    files = sorted(tmp_path.glob("shard-*.parquet"))
    assert [f.name for f in files] == sorted({r.file for r in records})
    table = pq.read_table(files[0])
    assert table.schema.remove_metadata() == ALIGNED_SCHEMA
    meta = json.loads(table.schema.metadata[META_ALIGNED.encode()])
    assert meta["aggregation"] == "mean" and meta["student"] == "llama-spm" and len(meta["student_tokenizer_sha256"]) == 64
    rows = table.to_pylist()
    assert len(rows) == sum(r.file == files[0].name for r in records)
    for row, rec, enc, w in zip(rows, records, encodings, want):
        assert row["doc_id"] == rec.doc_id and row["token_ids"] == enc.ids.tolist()
        np.testing.assert_allclose(np.asarray(row["teacher_loss"], np.float64), w["loss"], rtol=1e-6, equal_nan=True)
        assert row["mapped"] == [bool(m) for m in w["mapped"]]
    assert not list(tmp_path.glob(".*tmp*"))


def test_identical_tokenizers_align_one_to_one_and_chunks_do_not(micro_corpus, real_tokenizer, tmp_path):
    """Teacher = student (Mistral), every loss finite: token-level IoS and IoU are 1, every token is
    mapped; chunks keep IoS at 1 (each token starts in the chunk of its twin) but their IoU grows
    with the chunk count and stays below the token level's (the ablation of docs/METHOD.md §2.3)."""
    from pipeline.embedded.sample_corpus import clean_texts
    from pipeline.score_teacher.writer import write_manifest, write_shard
    from pipeline.score_teacher.teacher import ScoredDocument, ShardResult
    from pipeline.method.tokenization import encode_batch

    tok = real_tokenizer("mistral")
    texts = clean_texts(micro_corpus)[:40]
    rng = np.random.default_rng(0)
    docs = []
    for k, (text, enc) in enumerate(zip(texts, encode_batch(tok, texts))):
        losses = rng.gamma(2.0, 1.0, len(enc)).astype(np.float32)
        docs.append(ScoredDocument(f"d:{k}", text, enc.ids, enc.starts, enc.ends, losses))
    identity = {"teacher": {"name": "mistral", "vocab_size": len(tok), "bos_id": 1}}
    write_manifest(tmp_path, identity, {0: write_shard(tmp_path, 0, ShardResult(documents=docs), identity, {}, "t")}, 1)
    report = align_report(ScoredDataset.open(tmp_path), tok, "mistral", chunk_counts=(1, 16, 256)).to_dict()
    token, chunks = report["token_level"], report["chunk_level"]
    assert token["ios_mean"] == 1.0 and token["iou_mean"] == pytest.approx(1.0)
    assert token["mapped"] == report["student_tokens"] and report["teacher_per_student"]["0"] == 0
    assert chunks["1"]["iou_mean"] < chunks["16"]["iou_mean"] < chunks["256"]["iou_mean"] < token["iou_mean"]
    assert [chunks[n]["ios_mean"] for n in ("1", "16", "256")] == pytest.approx([1.0, 1.0, 1.0])
