"""Local paths and s3:// URIs through one interface, against a real S3 server (moto) on 127.0.0.1."""

from __future__ import annotations

from storage_schemas import filesystem as sfs


def test_s3_round_trip_listing_and_glob(s3_server):
    bucket = s3_server()
    for key in ["data/a-000.parquet", "data/a-001.parquet", "data/sub/b.parquet", "other/c.json"]:
        sfs.write_bytes(f"{bucket}/{key}", key.encode())
    assert sfs.read_bytes(f"{bucket}/data/sub/b.parquet") == b"data/sub/b.parquet"
    assert sfs.exists(f"{bucket}/other/c.json") and not sfs.exists(f"{bucket}/other/d.json")
    assert sfs.list_names(f"{bucket}/data") == ["a-000.parquet", "a-001.parquet"]
    assert sfs.glob(f"{bucket}/data/*.parquet") == [f"{bucket}/data/a-000.parquet", f"{bucket}/data/a-001.parquet"]
    assert sfs.glob(f"{bucket}/data/**/*.parquet") == [f"{bucket}/data/a-000.parquet", f"{bucket}/data/a-001.parquet",
                                                       f"{bucket}/data/sub/b.parquet"]
    assert sfs.glob(f"{bucket}/nothing/*.parquet") == []
    assert sfs.join(bucket, "x", "y.json") == f"{bucket}/x/y.json"
    sfs.delete(f"{bucket}/other/c.json")
    assert not sfs.exists(f"{bucket}/other/c.json")


def test_local_paths_behave_the_same(tmp_path):
    (tmp_path / "d").mkdir()
    sfs.write_bytes(tmp_path / "d" / "x.json", b"1")
    assert sfs.read_bytes(str(tmp_path / "d" / "x.json")) == b"1"
    assert sfs.list_names(tmp_path / "d") == ["x.json"]
    assert sfs.list_names(tmp_path / "missing") == []
    assert sfs.glob(str(tmp_path / "d" / "*.json")) == [str(tmp_path / "d" / "x.json")]
    assert not sfs.is_remote(tmp_path) and sfs.scheme("s3://b/k") == "s3" and sfs.scheme("gs://b/k") == "gs"
