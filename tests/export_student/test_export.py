"""make export-student's rows against a brute-force reference (the scored Parquet files and the
student tokenizer alone), read back by Polars, datasets and Megatron-core's own reader."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from export_helpers import (
    exported_rows,
    make_export,
    manifest,
    reference_documents,
    reference_packed,
    same_floats,
)
from pipeline.export_student.job import run_export


@pytest.fixture(scope="module")
def packed(tiny_student, micro_scored, tmp_path_factory) -> Path:
    """The micro scored dataset exported for the tiny student, packed to 32, in Parquet and Megatron's format."""
    out = tmp_path_factory.mktemp("export") / "packed"
    summary = run_export(make_export(tiny_student, micro_scored, out, formats=["parquet", "megatron"]))
    assert summary.complete and summary.shards_written == summary.shards_planned > 1
    return out


def test_packed_rows_are_the_aligned_stream_by_brute_force(packed, micro_scored, student_tokenizer):
    want = reference_packed(reference_documents(micro_scored, student_tokenizer), 32)
    got = exported_rows(packed)
    assert len(got) == len(want) == manifest(packed)["totals"]["rows"]
    for g, w in zip(got, want):
        assert g["sample_index"] == w["sample_index"]
        assert g["input_ids"] == w["input_ids"].tolist()
        assert same_floats(g["teacher_loss"], w["teacher_loss"]), g["sample_index"]
        assert (g["doc_ids"], g["doc_starts"], g["doc_offsets"]) == (w["doc_ids"], w["doc_starts"], w["doc_offsets"])
    # Each stream token once: a row after the first begins with the token that ends the row before it.
    mapped = sum(int(np.isfinite(np.asarray(r["teacher_loss"], np.float32)[1 if k else 0:]).sum())
                 for k, r in enumerate(want))
    assert manifest(packed)["totals"]["mapped"] == mapped


@pytest.mark.parametrize("loss", [{"aggregate": "min"}, {"alignment": "chunk", "n_chunks": 4}])
def test_documents_layout_and_alignment_options_by_brute_force(loss, tiny_student, micro_scored, student_tokenizer,
                                                               tmp_path):
    run_export(make_export(tiny_student, micro_scored, tmp_path / "docs", layout="documents", rows_per_shard=64,
                           loss=loss, data={"seed": 3}))
    want = reference_documents(micro_scored, student_tokenizer, seed=3, how=loss.get("aggregate", "max"),
                               n_chunks=loss.get("n_chunks"))
    got = exported_rows(tmp_path / "docs")
    assert [r["sample_index"] for r in got] == list(range(len(want)))
    for g, w in zip(got, want):
        assert (g["doc_ids"], g["doc_starts"], g["doc_offsets"]) == ([w["doc_id"]], [0], [0])
        assert g["input_ids"] == w["ids"].tolist()
        assert same_floats(g["teacher_loss"], w["teacher_loss"]), w["doc_id"]


def test_datasets_and_polars_read_exactly_the_manifest_shards(packed):
    from datasets import load_dataset

    (Path(packed) / "stray.parquet").write_bytes(b"not a shard")  # a file no reader may take
    try:
        rows = load_dataset(str(packed), split="train")
    finally:
        (Path(packed) / "stray.parquet").unlink()
    want = exported_rows(packed)
    assert rows.num_rows == len(want) and rows["sample_index"] == [r["sample_index"] for r in want]
    assert rows.features["input_ids"].feature.dtype == "int32" and rows.features["teacher_loss"].feature.dtype == "float32"
    files = [str(Path(packed) / e["file"]) for e in manifest(packed)["shards"]]
    frame = pl.scan_parquet(files).select("sample_index", pl.col("teacher_loss").list.len().alias("n")).collect()
    assert frame["n"].to_list() == [33] * len(want)  # seq_len + 1 tokens per packed row


def test_megatron_files_read_back_by_megatron_equal_the_parquet_bit_for_bit(packed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    rows = exported_rows(packed)
    ids, losses = [], []
    for e in manifest(packed)["shards"]:
        prefix = str(Path(packed) / e["file"].removesuffix(".parquet"))
        ids_ds, loss_ds = IndexedDataset(prefix + ".input_ids"), IndexedDataset(prefix + ".teacher_loss")
        assert np.array_equal(ids_ds.sequence_lengths, loss_ds.sequence_lengths)
        assert ids_ds.document_indices.tolist() == list(range(len(ids_ds) + 1))  # one document per row
        ids += [np.array(ids_ds[i]) for i in range(len(ids_ds))]  # copies: the views die with the dataset's mmap
        losses += [np.array(loss_ds[i]) for i in range(len(loss_ds))]
    assert len(ids) == len(rows)
    for r, i, t in zip(rows, ids, losses):
        assert i.dtype == np.int32 and t.dtype == np.float32
        assert np.array_equal(i, np.asarray(r["input_ids"], np.int32))
        assert np.array_equal(t.view(np.uint32), np.asarray(r["teacher_loss"], np.float32).view(np.uint32))


def test_card_and_manifest_say_what_made_the_export(packed, micro_scored, student_tokenizer):
    from pipeline.method.tokenization import fingerprint

    m = manifest(packed)
    card = (Path(packed) / "README.md").read_text()
    front = card.split("---")[1]
    assert [f for f in json.loads(json.dumps(m))["shards"]] and all(e["file"] in front for e in m["shards"])
    assert m["identity"]["student"]["tokenizer_sha256"] == fingerprint(student_tokenizer) and fingerprint(student_tokenizer) in card
    assert m["identity"]["teachers"][0]["alignment"] == {"method": "token", "aggregate": "max", "n_chunks": 8}
    t = m["totals"]
    # Each stream token once (rows share their boundary token): rows * seq_len + 1 of the brute-force stream.
    stream = np.concatenate([d["teacher_loss"] for d in reference_documents(micro_scored, student_tokenizer)])
    covered = stream[:len(exported_rows(packed)) * 32 + 1]
    assert t["tokens"] == covered.size and t["mapped"] == int(np.isfinite(covered).sum())
    assert t["loss_sum"] == pytest.approx(float(covered[np.isfinite(covered)].astype(np.float64).sum()), rel=1e-9)
    assert f"{t['tokens']:,}" in card
    assert set(t["bytes"]) == {"parquet", "megatron"} and "bytes per student token" in card
    assert f"{t['rows']:,}" in card and "owm-micro" in card and "micro" in card


def test_several_teachers_combined_by_brute_force(tiny_student, micro_scored, student_tokenizer, tmp_path):
    """A second teacher (the micro teacher's folder with other spans and losses for the same texts):
    each teacher's column and the combined one against the reference."""
    other = second_teacher(micro_scored, tmp_path / "other")
    run_export(make_export(tiny_student, [micro_scored, other], tmp_path / "two", layout="documents",
                           rows_per_shard=200, loss={"combine": "max"}))
    want = reference_documents([micro_scored, other], student_tokenizer, combine="max")
    got = exported_rows(tmp_path / "two")
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["input_ids"] == w["ids"].tolist()
        assert same_floats(g["teacher_loss"], w["teacher_loss"])
        assert same_floats(g["teacher_loss_t0"], w["per_teacher"][0]) and same_floats(g["teacher_loss_t1"], w["per_teacher"][1])


def second_teacher(scored: Path, out: Path) -> Path:
    """Another teacher over the same documents: each text cut into 3-character tokens with made-up losses
    (written with stage 1's own writer, so it is a valid scored folder of another teacher identity)."""
    import pyarrow.parquet as pq

    from pipeline.score_teacher.teacher import ScoredDocument, ShardResult
    from pipeline.score_teacher.writer import write_manifest, write_shard

    m = manifest(scored)
    identity = json.loads(json.dumps(m["identity"]))
    identity["teacher"] = {**identity["teacher"], "name": "chars3", "tokenizer_sha256": "0" * 64}
    out.mkdir(parents=True)
    done = {}
    for e in m["shards"]:
        docs = []
        for r in pq.read_table(Path(scored) / e["file"]).to_pylist():
            starts = np.arange(0, len(r["text"]), 3, dtype=np.int32)
            ends = np.minimum(starts + 3, len(r["text"])).astype(np.int32)
            losses = ((starts * 7919) % 97 / 10).astype(np.float32)
            docs.append(ScoredDocument(doc_id=r["doc_id"], text=r["text"], ids=np.arange(starts.size, dtype=np.int32),
                                       starts=starts, ends=ends, losses=losses))
        done[e["index"]] = write_shard(out, e["index"], ShardResult(documents=docs, reasons={}, skipped=[]), identity,
                                       e["source"], "test")
    write_manifest(out, identity, done, m["n_shards_planned"])
    return out
