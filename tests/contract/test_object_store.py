"""The commit protocol and the folder lock on an object store, against a real S3 server (moto's
server mode on 127.0.0.1). Objects are listed and read back with boto3, a client independent of the
pyarrow file systems the code under test uses."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.folders.folder_lock import LOCK_NAME, DatasetBusyError, exclusive_writer
from pipeline.score_teacher.teacher import ScoredDocument, ShardResult
from pipeline.score_teacher.writer import (
    StorageConfig,
    finished_shards,
    prepare_output,
    remove_unreferenced,
    write_shard,
)
from storage_schemas import filesystem as sfs
from storage_schemas import marker_of, read_manifest
from storage_schemas.reader import BadShardError, open_scored_dataset

ATTEMPT_NAME = re.compile(r"^shard-000003\.[0-9a-f]{12}\.parquet$")


def _boto(uri: str):
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")


def _objects(folder: str) -> dict[str, bytes]:
    """Every object under ``folder`` (an ``s3://bucket/prefix``) by name, read with boto3; the empty
    ``prefix/`` object pyarrow leaves as a folder placeholder after a delete is not a file."""
    bucket, prefix = folder[len("s3://"):].split("/", 1)
    client = _boto(folder)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1:]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
            for o in listed if not o["Key"].endswith("/")}


def _docs(seed: int, n: int = 5) -> list[ScoredDocument]:
    rng = np.random.default_rng(seed)
    docs = []
    for k in range(n):
        m = int(rng.integers(1, 30))
        starts = np.arange(m, dtype=np.int32)
        losses = rng.random(m).astype(np.float32)
        losses[0] = np.nan
        docs.append(ScoredDocument(f"f:{k}", "x" * m, rng.integers(0, 100, m).astype(np.int32), starts, starts + 1, losses))
    return docs


IDENTITY = {"format": 2, "teacher": {"name": "t"}, "windows": {"window": 8, "stride": 4},
            "loss_precision": "float32", "corpus": {"name": "c", "n_shards": 2}}


def _write(folder: str, index: int, seed: int = 0) -> dict:
    return write_shard(folder, index, ShardResult(documents=_docs(seed)), IDENTITY, {"file": "c.parquet"}, "test",
                       storage=StorageConfig(loss_precision="float32"))  # the bits compared below are the written ones


def test_a_shard_is_one_attempt_object_and_its_marker_names_size_and_sha256(s3_server):
    folder = f"{s3_server()}/ds"
    entry = _write(folder, 3)
    objects = _objects(folder)
    assert ATTEMPT_NAME.match(entry["file"]) and set(objects) == {entry["file"], marker_of(entry["file"])}
    data = objects[entry["file"]]
    assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert json.loads(objects[marker_of(entry["file"])]) == entry
    table = pq.read_table(sfs.child(folder, entry["file"]))
    expected = _docs(0)
    assert table.column("doc_id").to_pylist() == [d.doc_id for d in expected]
    for got, want in zip(table.column("losses").to_pylist(), expected):
        np.testing.assert_array_equal(np.asarray(got, np.float32).view(np.uint32), want.losses.view(np.uint32))


def test_two_finished_attempts_resolve_to_the_first_name_and_the_other_is_deleted(s3_server):
    folder = f"{s3_server()}/ds"
    first, second = _write(folder, 3), _write(folder, 3)  # a retried shard whose first attempt had finished
    assert first["file"] != second["file"] and first["sha256"] == second["sha256"]  # the same rows, the same bytes
    winner, loser = sorted([first, second], key=lambda e: e["file"])
    assert finished_shards(folder) == {3: winner}
    assert remove_unreferenced(folder, finished_shards(folder)) == sorted([loser["file"], marker_of(loser["file"])])
    assert set(_objects(folder)) == {winner["file"], marker_of(winner["file"])}
    assert finished_shards(folder) == {3: winner}


def test_unmarked_objects_and_stale_markers_are_never_listed_and_are_removed_by_a_rerun(s3_server, monkeypatch):
    folder = f"{s3_server()}/ds"
    assert prepare_output(folder, IDENTITY, overwrite=False)[0] == {}  # the first run's start: the manifest
    good = _write(folder, 0)
    real_write = sfs.write_bytes

    def marker_put_fails(location, data):  # the connection drops between the shard's PUT and its marker's
        if str(location).endswith(".done.json"):
            raise OSError("connection reset")
        real_write(location, data)

    monkeypatch.setattr(sfs, "write_bytes", marker_put_fails)
    with pytest.raises(OSError, match="connection reset"):
        _write(folder, 1)
    monkeypatch.undo()
    orphan = [n for n in _objects(folder) if n.startswith("shard-000001.")]
    assert len(orphan) == 1 and orphan[0].endswith(".parquet")  # the object is there, its marker is not
    stale = {**good, "index": 2, "file": "shard-000002.0123456789ab.parquet"}  # names an object that is not there
    sfs.write_bytes(sfs.child(folder, marker_of(stale["file"])), json.dumps(stale).encode())

    done, _, _ = prepare_output(folder, IDENTITY, overwrite=False)
    assert done == {0: good}
    assert [e["file"] for e in read_manifest(folder)["shards"]] == [good["file"]]
    assert set(_objects(folder)) == {good["file"], marker_of(good["file"]), "manifest.json"}


def test_a_reader_names_a_truncated_object(s3_server):
    from pipeline.score_teacher.writer import write_manifest

    folder = f"{s3_server()}/ds"
    entries = {i: _write(folder, i, seed=i) for i in range(2)}
    write_manifest(folder, IDENTITY, entries, n_planned=2)
    assert open_scored_dataset([folder]).n_documents == 10
    victim = sfs.child(folder, entries[1]["file"])
    sfs.write_bytes(victim, sfs.read_bytes(victim)[:-100])
    with pytest.raises(BadShardError, match=re.escape(victim)):
        open_scored_dataset([folder])
    skipped = open_scored_dataset([folder], on_bad_shard="skip")
    assert [sfs.name(s.path) for s in skipped.shards] == [entries[0]["file"]]


# --------------------------------------------------------------------------------------------
# The lock object


def _lock(folder: str) -> dict:
    return json.loads(_objects(folder)[LOCK_NAME])


def test_a_fresh_lock_refuses_and_the_lock_is_released(s3_server):
    folder = f"{s3_server()}/ds"
    with exclusive_writer(folder, heartbeat_s=0.2, settle_s=0.05):
        held = _lock(folder)
        assert held["pid"] == os.getpid()
        with pytest.raises(DatasetBusyError, match=f"another scoring job is writing this folder \\(pid {os.getpid()} on "):
            with exclusive_writer(folder, settle_s=0.05):
                pass
        time.sleep(0.7)
        assert _lock(folder)["heartbeat"] > held["heartbeat"]  # the holder keeps it fresh
    assert LOCK_NAME not in _objects(folder)


def test_a_stale_lock_is_taken_over(s3_server):
    folder = f"{s3_server()}/ds"
    where = sfs.child(folder, LOCK_NAME)
    elsewhere = {"token": "x", "host": "another-host", "boot_id": "b", "pid": 1, "started": 0.0}
    sfs.write_bytes(where, json.dumps({**elsewhere, "heartbeat": time.time()}).encode())
    with pytest.raises(DatasetBusyError, match="pid 1 on another-host"):
        with exclusive_writer(folder, settle_s=0.05):
            pass
    sfs.write_bytes(where, json.dumps({**elsewhere, "heartbeat": time.time() - 120}).encode())
    with exclusive_writer(folder, settle_s=0.05, stale_after_s=60):
        assert _lock(folder)["pid"] == os.getpid()

    # a holder on this machine whose process is gone (a killed driver): taken over at once
    import psutil

    from pipeline.folders.folder_lock import _holder

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(dead.pid).create_time()
    dead.wait()
    sfs.write_bytes(where, json.dumps({**_holder(), "pid": dead.pid, "started": started}).encode())
    with exclusive_writer(folder, settle_s=0.05):
        assert _lock(folder)["pid"] == os.getpid()


def test_a_job_whose_lock_is_replaced_while_it_settles_gives_way(s3_server):
    folder = f"{s3_server()}/ds"
    where = sfs.child(folder, LOCK_NAME)
    other = {"token": "other", "host": "another-host", "boot_id": "b", "pid": 7, "started": 0.0}

    def second_job_writes():  # another job that checked before this one wrote, and writes after it
        deadline = time.time() + 5
        while time.time() < deadline and not sfs.exists(where):
            time.sleep(0.01)
        sfs.write_bytes(where, json.dumps({**other, "heartbeat": time.time()}).encode())

    racer = threading.Thread(target=second_job_writes)
    racer.start()
    with pytest.raises(DatasetBusyError, match="took this folder at the same moment \\(pid 7 on another-host"):
        with exclusive_writer(folder, settle_s=1.0):
            pass
    racer.join()
    assert _lock(folder)["token"] == "other"  # the job that gave way did not delete the other's lock
