"""The export from a scored folder on an object store into an object store (a real S3 server, moto's
server mode): every file of every shard holds the bytes of the local export, each under its
attempt's own name; a rerun writes nothing; a changed setting is refused there too."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from export_helpers import make_export, manifest
from pipeline.export_student.job import run_export
from pipeline.folders.shard_folder import DatasetMismatchError, parts_of
from storage_schemas import filesystem as sfs


def upload(local, uri: str) -> str:
    for path in sorted(local.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            sfs.write_bytes(sfs.child(uri, path.name), path.read_bytes())
    return uri


@pytest.mark.slow  # about a minute: every file through the S3 server
def test_export_from_and_to_an_object_store_equals_the_local_one(s3_server, tiny_student, micro_scored, tmp_path):
    bucket = s3_server()
    scored = upload(micro_scored, f"{bucket}/scored/v1")
    local = tmp_path / "local"
    run_export(make_export(tiny_student, micro_scored, local, formats=["parquet", "megatron"]))

    out = f"{bucket}/exports/micro"
    job = replace(make_export(tiny_student, scored, tmp_path / "unused", formats=["parquet", "megatron"]), output_dir=out)
    summary = run_export(job)
    assert summary.complete
    entries = json.loads(sfs.read_bytes(sfs.child(out, "manifest.json")))["shards"]
    want = manifest(local)["shards"]
    assert [e["index"] for e in entries] == [e["index"] for e in want]
    for got, local_entry in zip(entries, want):
        names = [got["file"], *(p["file"] for p in parts_of(got))]
        local_names = [local_entry["file"], *(p["file"] for p in parts_of(local_entry))]
        assert all(n.startswith(f"shard-{got['index']:06d}.") and n not in local_names for n in names)  # attempts
        for name, local_name in zip(names, local_names):
            assert sfs.read_bytes(sfs.child(out, name)) == (local / local_name).read_bytes(), name
    listed = set(sfs.list_names(out))
    assert "README.md" in listed and not [n for n in listed if n.startswith(".")]

    again = run_export(job)
    assert again.shards_written == 0 and set(sfs.list_names(out)) == listed
    with pytest.raises(DatasetMismatchError, match="formats"):
        run_export(replace(job, export=replace(job.export, formats=["parquet"])))
