"""The litdata export read back with litdata's own StreamingDataset equals the Parquet export, bit for
bit. litdata is an optional extra that CI does not install (its torchvision pulls another torch):
this test runs where it is installed (pip install 'vocagno[litdata]' with torch pinned)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from export_helpers import exported_rows, make_export, manifest
from pipeline.export_student.job import run_export

litdata = pytest.importorskip("litdata")


def test_litdata_streaming_dataset_reads_the_parquet_rows(tiny_student, micro_scored, tmp_path):
    out = tmp_path / "export"
    job = make_export(tiny_student, micro_scored, out, formats=["parquet", "litdata"], limit_shards=2)
    run_export(job)
    assert not (out / "index.json").exists()  # written when the export is complete
    run_export(make_export(tiny_student, micro_scored, out, formats=["parquet", "litdata"]))
    assert manifest(out)["complete"] and manifest(out)["n_shards_planned"] > 2
    rows = exported_rows(out)
    stream = litdata.StreamingDataset(str(out))
    assert len(stream) == len(rows)
    for r, item in zip(rows, stream):
        assert item["sample_index"] == r["sample_index"]
        assert item["input_ids"].dtype == np.int32 and item["teacher_loss"].dtype == np.float32
        assert np.array_equal(item["input_ids"], np.asarray(r["input_ids"], np.int32))
        assert np.array_equal(item["teacher_loss"].view(np.uint32), np.asarray(r["teacher_loss"], np.float32).view(np.uint32))
        assert item["doc_starts"].tolist() == r["doc_starts"] and item["doc_offsets"].tolist() == r["doc_offsets"]
    chunks = sorted(p.name for p in Path(out).glob("*.litdata.bin"))
    assert len(chunks) == manifest(out)["n_shards_planned"]
