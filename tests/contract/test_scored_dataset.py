"""Opening scored datasets for stage 2: validation, refusals, skipping, identity, row access."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from storage_schemas.reader import BadShardError, MixedTeachersError, ShardReader, open_scored_dataset
from storage_schemas import META_IDENTITY, ContractError, file_sha256, read_manifest


def copy_dataset(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_identity(folder: Path, change) -> None:
    """Re-issue a scored folder as if another setup had scored it: every shard's metadata and the
    manifest get ``change(identity)``, and the manifest's sizes and checksums are updated."""
    manifest = read_manifest(folder)
    manifest["identity"] = change(manifest["identity"])
    for entry in manifest["shards"]:
        path = folder / entry["file"]
        table = pq.read_table(path)
        meta = dict(table.schema.metadata)
        meta[META_IDENTITY.encode()] = json.dumps(manifest["identity"], sort_keys=True).encode()
        pq.write_table(table.replace_schema_metadata(meta), path)
        entry["bytes"], entry["sha256"] = path.stat().st_size, file_sha256(path)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_opens_and_records_identity(micro_scored):
    ds = open_scored_dataset([micro_scored])
    manifest = read_manifest(micro_scored)
    assert len(ds.shards) == len(manifest["shards"]) and not ds.skipped
    assert ds.n_documents == manifest["totals"]["documents"]
    identity = ds.identity()
    assert identity["folders"][0]["manifest_sha256"] == file_sha256(micro_scored / "manifest.json")
    assert identity["teacher"]["teacher"]["name"] == "micro"
    assert [s["sha256"] for s in identity["shards_used"]] == [e["sha256"] for e in manifest["shards"]]


def test_rows_match_the_parquet_file(micro_scored):
    ds = open_scored_dataset([micro_scored])
    reader = ShardReader(ds.shards, cache_row_groups=1)
    table = pq.read_table(ds.shards[1].path).to_pylist()
    for r in (0, 7, len(table) - 1):
        row = reader.row(1, r)
        assert row.text == table[r]["text"]
        np.testing.assert_array_equal(row.starts, table[r]["starts"])
        np.testing.assert_array_equal(row.losses, np.asarray(table[r]["losses"], np.float32))


def test_truncated_shard_is_an_error_naming_the_file_or_skipped(micro_scored, tmp_path):
    folder = copy_dataset(micro_scored, tmp_path / "ds")
    victim = folder / "shard-000001.parquet"
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(BadShardError, match="shard-000001.parquet"):
        open_scored_dataset([folder])
    ds = open_scored_dataset([folder], on_bad_shard="skip")
    assert [Path(s["file"]).name for s in ds.skipped] == ["shard-000001.parquet"]
    assert "shard-000001.parquet" not in [s.path.name for s in ds.shards]
    assert ds.identity()["shards_skipped"] == ds.skipped


def test_same_size_corruption_is_found_by_sha256(micro_scored, tmp_path):
    folder = copy_dataset(micro_scored, tmp_path / "ds")
    victim = folder / "shard-000000.parquet"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    open_scored_dataset([folder])  # size and footer still fine
    with pytest.raises(BadShardError, match="shard-000000.parquet.*sha256"):
        open_scored_dataset([folder], verify="sha256")


def test_folders_of_different_teachers_are_refused(micro_scored, tmp_path):
    other = copy_dataset(micro_scored, tmp_path / "other")
    rewrite_identity(other, lambda i: {**i, "teacher": {**i["teacher"], "name": "other", "tokenizer_sha256": "0" * 64}})
    with pytest.raises(MixedTeachersError, match="teacher.name: 'micro' != 'other'") as err:
        open_scored_dataset([micro_scored, other])
    assert "tokenizer_sha256" in str(err.value)


def test_folders_of_one_teacher_are_concatenated(micro_scored, tmp_path):
    second = copy_dataset(micro_scored, tmp_path / "second")
    rewrite_identity(second, lambda i: {**i, "corpus": {**i["corpus"], "name": "another-corpus"}})
    ds = open_scored_dataset([micro_scored, second])
    assert len(ds.shards) == 2 * len(read_manifest(micro_scored)["shards"])
    assert [f.path for f in ds.folders] == [micro_scored.resolve(), second.resolve()]
    with pytest.raises(ContractError, match="listed twice"):
        open_scored_dataset([micro_scored, micro_scored])


def test_shard_from_another_scoring_is_refused(micro_scored, tmp_path):
    folder = copy_dataset(micro_scored, tmp_path / "ds")
    foreign = copy_dataset(micro_scored, tmp_path / "foreign")
    rewrite_identity(foreign, lambda i: {**i, "windows": {**i["windows"], "stride": 1}})
    manifest = read_manifest(folder)
    shutil.copy(foreign / "shard-000002.parquet", folder / "shard-000002.parquet")
    entry = next(e for e in manifest["shards"] if e["file"] == "shard-000002.parquet")
    entry["bytes"] = (folder / "shard-000002.parquet").stat().st_size
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BadShardError, match="shard-000002.parquet.*windows.stride"):
        open_scored_dataset([folder])


def test_shard_with_a_column_of_another_type_is_refused(micro_scored, tmp_path):
    """Losses stored as float64 (same names, metadata, values; size and checksum re-recorded) break
    the contract's column types: the shard is refused, or skipped, naming the file and the column."""
    import pyarrow as pa

    folder = copy_dataset(micro_scored, tmp_path / "ds")
    path = folder / "shard-000001.parquet"
    table = pq.read_table(path)
    fields = [pa.field(f.name, pa.list_(pa.float64()) if f.name == "losses" else f.type, f.nullable) for f in table.schema]
    pq.write_table(table.cast(pa.schema(fields, metadata=table.schema.metadata)), path)
    manifest = read_manifest(folder)
    entry = next(e for e in manifest["shards"] if e["file"] == path.name)
    entry["bytes"], entry["sha256"] = path.stat().st_size, file_sha256(path)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BadShardError, match="shard-000001.parquet.*column 'losses' has type"):
        open_scored_dataset([folder])
    skipped = open_scored_dataset([folder], on_bad_shard="skip").skipped
    assert [Path(s["file"]).name for s in skipped] == [path.name]


def test_incomplete_and_missing_datasets(micro_scored, tmp_path):
    folder = copy_dataset(micro_scored, tmp_path / "ds")
    manifest = read_manifest(folder)
    manifest["complete"], manifest["shards"] = False, manifest["shards"][:2]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match="incomplete.*allow_partial"):
        open_scored_dataset([folder])
    assert len(open_scored_dataset([folder], allow_partial=True).shards) == 2
    with pytest.raises(ContractError, match="no manifest.json"):
        open_scored_dataset([tmp_path / "nothing-here"])
