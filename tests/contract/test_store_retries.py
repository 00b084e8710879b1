"""The S3 client's retry settings from the standard AWS variables, what counts as a store that did
not answer, and how the SDK's monitoring records are read, on the words pyarrow and the SDK really
produce (copied from runs against moto's server behind local_s3/faults.py). The behaviour end to end
is in tests/test_object_store_faults.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage_schemas import filesystem as sfs
from storage_schemas import store_calls

REPO = Path(__file__).resolve().parents[2]


def test_the_retry_settings_come_from_the_standard_aws_variables(monkeypatch):
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    assert sfs.retry_settings() == ("standard", 10)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    monkeypatch.setenv("AWS_RETRY_MODE", "Legacy")
    assert sfs.retry_settings() == ("legacy", 4)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "0")
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    with pytest.raises(sfs.StoreSettingError) as refused:
        sfs.retry_settings()
    assert "AWS_RETRY_MODE='adaptive'" in str(refused.value) and "AWS_MAX_ATTEMPTS='0'" in str(refused.value)


def test_unusable_retry_settings_end_a_stage_in_one_line_before_any_request(tmp_path):
    env = {**os.environ, "AWS_MAX_ATTEMPTS": "ten", "VOCAGNO_TRACEBACK": ""}
    result = subprocess.run([sys.executable, "-m", "stages.inspect", "command=validate", "path=s3://no-bucket/x",
                             f"hydra.run.dir={tmp_path}/logs"], cwd=REPO, capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: AWS_MAX_ATTEMPTS='ten': use a whole number of attempts per request, at least 1")


class RayLikeError(Exception):
    """A remote error that holds its cause in ``cause``, as a Ray task error does."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause


SLOW_DOWN = ("When completing multiple part upload for key 'scored/v1/manifest.json' in bucket 'b': AWS Error "
             "SLOW_DOWN during CompleteMultipartUpload operation: Please reduce your request rate.")
HEAD_503 = ("When getting information for key 'x' in bucket 'b': AWS Error UNKNOWN (HTTP status 503) during "
            "HeadObject operation: No response body.")
REFUSED = ("When reading information for key 'x' in bucket 'b': AWS Error NETWORK_CONNECTION during HeadObject "
           "operation: curlCode: 7, Couldn't connect to server")
DENIED = ("When getting information for key 'x' in bucket 'b': AWS Error ACCESS_DENIED during HeadObject "
          "operation: No response body.")


def test_a_store_that_did_not_answer_is_told_from_other_errors():
    for message in (SLOW_DOWN, HEAD_503, REFUSED):
        assert sfs.unavailable(OSError(message)) == message
    assert sfs.unavailable(OSError(DENIED)) is None  # a refused key is the user's to fix, not the store's
    assert sfs.unavailable(FileNotFoundError("[Errno 2] Path does not exist 'b/x'")) is None
    # across a Ray task (its cause), a data-loader worker (the original text inside) and a re-raise
    assert sfs.unavailable(RayLikeError("ray task failed", OSError(SLOW_DOWN))) == SLOW_DOWN
    assert sfs.unavailable(OSError(f"Caught OSError in DataLoader worker process 0.\nOriginal Traceback:\n"
                                   f"OSError: {HEAD_503}\n")) == f"OSError: {HEAD_503}"
    try:
        try:
            raise OSError(REFUSED)
        except OSError as exc:
            raise RuntimeError("shard 2 failed") from exc
    except RuntimeError as exc:
        assert sfs.unavailable(exc) == REFUSED


def attempt(status: int, **fields) -> dict:
    return {"Type": "ApiCallAttempt", "Api": "GetObject", "HttpStatusCode": status, **fields}


CURL_RESET = "curlCode: 56, Failure when receiving data from the peer; Details: Recv failure: Connection reset by peer"


def test_the_sdks_monitoring_records_are_counted_by_reason():
    """Records as the SDK sends them: a throttled attempt, a HEAD's 503 without a body, connections
    reset inside an answer (status received) and before it (-1), a missing object (not a failure)."""
    assert store_calls.failure_reason(attempt(503, AwsException="SlowDown")) == "SlowDown"
    assert store_calls.failure_reason(attempt(503, SdkExceptionMessage="No response body.")) == "HTTP 503"
    assert store_calls.failure_reason(attempt(500, AwsException="InternalError")) == "InternalError"
    assert store_calls.failure_reason(attempt(206, SdkExceptionMessage=CURL_RESET)) == "connection"
    assert store_calls.failure_reason(attempt(-1, SdkExceptionMessage=CURL_RESET)) == "connection"
    assert store_calls.failure_reason(attempt(404, SdkExceptionMessage="No response body.")) is None
    assert store_calls.failure_reason(attempt(200)) is None

    total = store_calls.add({}, {"requests": 3, "retries": 2, "gave_up": 0, "failed_attempts": {"SlowDown": 2},
                                 "counted": True})
    total = store_calls.add(total, {"requests": 1, "retries": 1, "gave_up": 1, "failed_attempts": {"connection": 1},
                                    "counted": False})
    assert total == {"requests": 4, "retries": 3, "gave_up": 1, "failed_attempts": {"SlowDown": 2, "connection": 1},
                     "counted": True}
    assert store_calls.describe(total) == ("4 requests, 3 retried by the S3 client (SlowDown 2, connection 1), "
                                           "1 given up")


@pytest.mark.parametrize("mode, attempts", [("standard", 2), ("legacy", 5)])
def test_the_s3_client_makes_as_many_attempts_as_the_settings_say(s3_server, monkeypatch, mode, attempts):
    """A store that answers 503 to everything sees each request exactly AWS_MAX_ATTEMPTS times, for a
    footer read through the contract's readers too (a URI handed to pyarrow as it is would get
    pyarrow's own default: 31 attempts over 6 s)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from local_s3.faults import Faults, faulty_s3
    from storage_schemas.schema import read_shard_metadata

    uri = f"{s3_server()}/shard.parquet"
    fs, path = sfs.resolve(uri)
    pq.write_table(pa.table({"x": [1, 2]}), path, filesystem=fs)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", str(attempts))
    monkeypatch.setenv("AWS_RETRY_MODE", mode)
    with faulty_s3(Faults(slowdown=0.0, reset=0.0, delay=0.0)) as proxy:
        assert sfs.parquet_file(uri).metadata.num_rows == 2  # through the proxy, before it goes down
        proxy.down()
        for read in (sfs.exists, sfs.read_bytes, sfs.parquet_file, read_shard_metadata):
            before = proxy.counts()["down"]
            with pytest.raises(Exception) as failed:
                read(uri)
            assert proxy.counts()["down"] - before == attempts, read.__name__
            assert sfs.unavailable(failed.value), (read.__name__, failed.value)
