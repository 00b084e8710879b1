"""The local S3 server: pyarrow reaches it through the AWS variables alone (as Ray actors and child
processes do), an object written reads back, and the variables are as before once it stops, also
when the block inside raised."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("moto.server", reason="moto[server] is not installed")

VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL")


def test_an_object_written_reads_back_and_the_environment_is_restored(monkeypatch):
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from local_s3 import local_s3_server

    monkeypatch.setenv("AWS_REGION", "eu-west-3")  # one variable set before, the others absent
    for name in set(VARIABLES) - {"AWS_REGION"}:
        monkeypatch.delenv(name, raising=False)
    before = {k: os.environ.get(k) for k in VARIABLES}

    table = pa.table({"doc_id": ["a", "b"], "losses": [[0.5, 1.5], [2.0]]})
    with local_s3_server("testing") as make_bucket:
        assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        uri = make_bucket("bucket-one") + "/folder/shard.parquet"
        fs, path = pafs.FileSystem.from_uri(uri)  # configured from the environment only
        pq.write_table(table, path, filesystem=fs)
        assert pq.read_table(path, filesystem=fs).equals(table)
        with fs.open_input_stream(path) as f:
            assert f.read(4) == b"PAR1"
    assert {k: os.environ.get(k) for k in VARIABLES} == before

    with pytest.raises(RuntimeError), local_s3_server("testing"):
        raise RuntimeError("a failure inside the block")
    assert {k: os.environ.get(k) for k in VARIABLES} == before
