"""``inspect validate``: a clean dataset passes; each injected fault is found and named (file, row,
document); all faults are reported in one run; the command exits 1 listing them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.inspection.validate import ERROR, WARNING, validate_dataset
from pipeline.score_teacher.writer import finished_shards, write_manifest
from storage_schemas import MANIFEST_NAME, file_sha256, marker_name, read_manifest, write_json_atomic

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def dataset(micro_scored, tmp_path) -> Path:
    """A private copy of the micro scored dataset, to break."""
    return Path(shutil.copytree(micro_scored, tmp_path / "ds"))


def errors(report) -> list:
    return [p for p in report.problems if p.severity == ERROR]


def rewrite_rows(folder: Path, index: int, edit) -> list[dict]:
    """Rewrite shard ``index`` with ``edit(rows)`` applied (schema and metadata kept), then reseal
    it (size and checksum in its marker and the manifest) so that only the row fault remains."""
    path = folder / f"shard-{index:06d}.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path, compression="zstd")
    marker = folder / marker_name(index)
    entry = {**json.loads(marker.read_text()), "bytes": path.stat().st_size, "sha256": file_sha256(path)}
    write_json_atomic(marker, entry)
    manifest = read_manifest(folder)
    write_manifest(folder, manifest["identity"], finished_shards(folder), manifest["n_shards_planned"], manifest["code_version"])
    return rows


def test_clean_dataset_passes(micro_scored):
    report = validate_dataset(micro_scored)
    assert report.ok and report.problems == [], [str(p) for p in report.problems]
    manifest = read_manifest(micro_scored)
    assert report.shards_checked == len(manifest["shards"])
    assert report.rows_checked == manifest["totals"]["documents"]


def test_truncated_file(dataset):
    path = dataset / "shard-000001.parquet"
    os.truncate(path, path.stat().st_size // 2)
    found = errors(validate_dataset(dataset))
    mine = [p for p in found if p.file == path.name]
    assert any("not a readable Parquet file" in p.message for p in mine)
    assert any("truncated" in p.message for p in mine)
    assert any("checksum mismatch" in p.message for p in mine)
    assert {p.file for p in found} == {path.name}


def test_row_with_unequal_list_lengths(dataset):
    rows = rewrite_rows(dataset, 2, lambda rows: rows[3].update(losses=rows[3]["losses"][:-1]))
    found = errors(validate_dataset(dataset))
    assert len(found) == 1, [str(p) for p in found]
    (p,) = found
    assert (p.file, p.row, p.doc_id) == ("shard-000002.parquet", 3, rows[3]["doc_id"])
    assert "list lengths differ" in p.message and "'losses': " in p.message
    assert "shard-000002.parquet row 3 doc" in str(p)


def test_offsets_past_the_text(dataset):
    def edit(rows):
        rows[5]["ends"][-1] = len(rows[5]["text"]) + 5

    rows = rewrite_rows(dataset, 0, edit)
    (p,) = errors(validate_dataset(dataset))
    assert (p.file, p.row, p.doc_id) == ("shard-000000.parquet", 5, rows[5]["doc_id"])
    assert f"span outside the text of length {len(rows[5]['text'])}" in p.message


def test_shard_missing_from_the_manifest(dataset):
    manifest = read_manifest(dataset)
    done = {i: e for i, e in finished_shards(dataset).items() if i != 3}
    write_manifest(dataset, manifest["identity"], done, manifest["n_shards_planned"], manifest["code_version"])
    report = validate_dataset(dataset)
    (p,) = errors(report)
    assert p.file == "shard-000003.parquet" and "shard missing from the manifest" in p.message
    assert "finished (it has a marker)" in p.message
    assert any("partial dataset" in w.message for w in report.warnings)


def test_checksum_mismatch(dataset):
    path = dataset / "shard-000002.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes (a bit flip on disk)
    path.write_bytes(bytes(data))
    mine = [p for p in errors(validate_dataset(dataset)) if p.file == path.name]
    assert any("checksum mismatch" in p.message for p in mine)
    assert not any("checksum" in p.message for p in errors(validate_dataset(dataset, checksums=False)))


def test_column_of_another_type(dataset):
    """A shard rewritten with float64 losses (names, metadata, values, size and checksum in the
    marker all fine) breaks the contract's column types: an error naming the file and the column."""
    path = dataset / "shard-000002.parquet"
    table = pq.read_table(path)
    fields = [pa.field(f.name, pa.list_(pa.float64()) if f.name == "losses" else f.type, f.nullable)
              for f in table.schema]
    pq.write_table(table.cast(pa.schema(fields, metadata=table.schema.metadata)), path, compression="zstd")
    marker = dataset / marker_name(2)
    write_json_atomic(marker, {**json.loads(marker.read_text()), "bytes": path.stat().st_size, "sha256": file_sha256(path)})
    manifest = read_manifest(dataset)
    write_manifest(dataset, manifest["identity"], finished_shards(dataset), manifest["n_shards_planned"], manifest["code_version"])
    mine = [p.message for p in errors(validate_dataset(dataset))]
    assert any("column 'losses' has type list<element: double>" in m for m in mine), mine


def test_every_row_fault_is_named_in_one_run(dataset):
    """Several faults in several rows of one shard, plus one in another shard: all reported."""
    def edit(rows):
        rows[1]["losses"][4] = float("inf")
        rows[2]["starts"][2], rows[2]["starts"][3] = rows[2]["starts"][3], rows[2]["starts"][2]
        rows[4]["token_ids"][0] = 10**6  # past the teacher's vocabulary
        rows[6]["ends"][7] = rows[6]["starts"][7]  # an empty text slice
        rows[8]["losses"][9] = -2.0
        rows[9]["doc_id"] = rows[10]["doc_id"]  # duplicate id
        rows[11]["losses"][0] = 1.5  # no BOS: the first token has no prediction
        rows[12]["losses"][5] = float("nan")

    rows = rewrite_rows(dataset, 1, edit)
    rewrite_rows(dataset, 3, lambda rows: rows[0].update(doc_id=""))
    report = validate_dataset(dataset)
    by_row = {}
    for p in report.problems:
        if p.file == "shard-000001.parquet":
            by_row.setdefault(p.row, []).append((p.severity, p.message))
    expected = {
        1: (ERROR, "infinite loss"), 2: (ERROR, "starts decrease"), 4: (ERROR, "token id outside the teacher vocabulary"),
        6: (ERROR, "empty text slice"), 8: (ERROR, "negative loss"), 9: (ERROR, "doc_id is not unique"),
        10: (ERROR, "doc_id is not unique"), 11: (WARNING, "first token's loss finite"), 12: (WARNING, "NaN loss past the first token"),
    }
    for row, (severity, text) in expected.items():
        assert any(s == severity and text in m for s, m in by_row.get(row, [])), (row, by_row.get(row))
    assert set(by_row) == set(expected)
    assert any(p.file == "shard-000003.parquet" and p.row == 0 and "empty or null doc_id" in p.message for p in report.problems)
    assert rows[9]["doc_id"] in {p.doc_id for p in report.problems if "not unique" in p.message}


def test_manifest_totals_and_markers_are_checked(dataset):
    manifest = json.loads((dataset / MANIFEST_NAME).read_text())
    manifest["totals"]["tokens"] += 1
    (dataset / MANIFEST_NAME).write_text(json.dumps(manifest))
    (dataset / marker_name(0)).unlink()
    (dataset / ".shard-000009.parquet.tmp-abc").write_bytes(b"x")
    report = validate_dataset(dataset)
    messages = [str(p) for p in report.problems]
    assert any("manifest.json: totals.tokens" in m for m in messages)
    assert any("shard-000000.parquet: no completion marker" in m for m in messages)
    assert any(m.startswith("warning: .shard-000009.parquet.tmp-abc") for m in messages)


def test_command_exits_1_and_lists_every_problem(dataset):
    rewrite_rows(dataset, 2, lambda rows: rows[3].update(losses=rows[3]["losses"][:-1]))
    os.truncate(dataset / "shard-000001.parquet", 100)
    out_dir = dataset.parent / "inspect-out"
    run = subprocess.run(
        [sys.executable, "-m", "stages.inspect", "command=validate", f"path={dataset}", f"out_dir={out_dir}",
         "hydra.run.dir=" + str(dataset.parent / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "shard-000001.parquet: not a readable Parquet file" in run.stdout
    assert "shard-000002.parquet row 3 doc" in run.stdout and "list lengths differ" in run.stdout
    assert "validate FAILED" in run.stdout
    saved = json.loads((out_dir / "validation.json").read_text())
    assert saved["ok"] is False and saved["errors"] == len([p for p in saved["problems"] if p["severity"] == "error"]) >= 4


def test_compact_encodings_and_rounded_losses_validate(micro_scored, tmp_path):
    """Shards written with the compact storage options read and validate like default ones."""
    from pipeline.score_teacher.writer import StorageConfig, write_shard
    from pipeline.score_teacher.teacher import ScoredDocument, ShardResult

    manifest = read_manifest(micro_scored)
    table = pq.read_table(micro_scored / "shard-000000.parquet").to_pylist()
    docs = [ScoredDocument(r["doc_id"], r["text"], np.asarray(r["token_ids"], np.int32), np.asarray(r["starts"], np.int32),
                           np.asarray(r["ends"], np.int32), np.asarray(r["losses"], np.float32)) for r in table]
    storage = StorageConfig(encodings="compact", loss_precision="bfloat16", compression_level=9)
    entry = write_shard(tmp_path, 0, ShardResult(documents=docs), manifest["identity"], {"file": "x"}, "test", storage=storage)
    write_manifest(tmp_path, manifest["identity"], {0: entry}, 1, "test")
    report = validate_dataset(tmp_path)
    assert report.ok and report.rows_checked == len(docs), [str(p) for p in report.problems]
