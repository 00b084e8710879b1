"""The faulty S3 proxy, seen from a plain HTTP client (the standard library's, no retries): what the
client meets is what the proxy counts; throttled answers are S3's SlowDown error; a dropped answer
breaks off inside its body (a drop drawn for an answer without a body falls on the next GET);
delayed answers come late; the draws follow the seed; an answer that is none of these is the
server's own, byte for byte; 'down' throttles everything."""

from __future__ import annotations

import http.client
import os
import time
import xml.etree.ElementTree as ET
from collections import Counter
from urllib.parse import urlsplit

import pytest

pytest.importorskip("moto.server", reason="moto[server] is not installed")

BODY = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture(scope="module")
def an_object(s3_server):
    import boto3

    bucket = s3_server()[len("s3://"):]
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    client.put_object(Bucket=bucket, Key="data/object.bin", Body=BODY, ACL="public-read")  # read unsigned below
    return f"/{bucket}/data/object.bin"


def fetch(endpoint: str, path: str, method: str = "GET") -> tuple[str, float]:
    """One unsigned request on a new connection: what the client met."""
    parts = urlsplit(endpoint)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    t0 = time.monotonic()
    try:
        connection.request(method, path)
        try:
            response = connection.getresponse()
        except (ConnectionResetError, http.client.RemoteDisconnected):
            return "broken before the answer", time.monotonic() - t0
        try:
            data = response.read()
        except (http.client.IncompleteRead, ConnectionResetError):
            return "broken inside the body", time.monotonic() - t0
    finally:
        connection.close()
    seconds = time.monotonic() - t0
    if response.status == 503:
        if method == "HEAD":
            return "503-head" if not data else "503-head-with-body", seconds
        error = ET.fromstring(data)
        return f"503:{error.findtext('Code')}:{bool(error.findtext('RequestId'))}", seconds
    assert response.status == 200, response.status
    if method == "HEAD":
        assert int(response.headers["Content-Length"]) == len(BODY)
        return "ok", seconds
    return ("ok" if data == BODY else "corrupt"), seconds


def test_what_a_client_meets_is_what_the_proxy_counts(an_object):
    from local_s3.faults import Faults, faulty_s3

    faults = Faults(slowdown=0.10, reset=0.05, delay=0.05, delay_s=0.3, seed=11)
    with faulty_s3(faults) as proxy:
        met = [fetch(proxy.endpoint, an_object, "HEAD" if i % 5 == 0 else "GET") for i in range(300)]
        counts = proxy.counts()
    kinds = Counter(kind for kind, _ in met)
    assert set(kinds) <= {"ok", "503:SlowDown:True", "503-head", "broken inside the body"}
    assert counts["requests"] == 300 and counts["down"] == 0
    assert counts["slowdown"] == kinds["503:SlowDown:True"] + kinds["503-head"]
    # a dropped GET breaks inside its body, after its status line; a HEAD is never dropped
    assert counts["reset"] == kinds["broken inside the body"] >= 1
    assert all(kind != "broken inside the body" for i, (kind, _) in enumerate(met) if i % 5 == 0)
    late = sum(1 for kind, seconds in met if kind == "ok" and seconds >= 0.3)
    assert late == counts["delayed"]
    # the rates are the settings' (binomial, 300 draws: far outside 4 standard deviations fails)
    for kind, p in (("slowdown", 0.10), ("reset", 0.05)):
        assert abs(counts[kind] - 300 * p) <= 4 * (300 * p * (1 - p)) ** 0.5, (kind, counts)


def test_the_draws_follow_the_seed_and_down_throttles_everything(an_object):
    from local_s3.faults import Faults, faulty_s3

    runs = []
    for seed in (5, 5, 6):
        with faulty_s3(Faults(slowdown=0.2, reset=0.1, delay=0.0, seed=seed)) as proxy:
            runs.append([fetch(proxy.endpoint, an_object)[0] for _ in range(60)])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    with faulty_s3(Faults(slowdown=0.0, reset=0.0, delay=0.0)) as proxy:
        assert fetch(proxy.endpoint, an_object)[0] == "ok"
        proxy.down()
        assert [fetch(proxy.endpoint, an_object)[0] for _ in range(5)] == ["503:SlowDown:True"] * 5
        proxy.down(False)
        assert fetch(proxy.endpoint, an_object)[0] == "ok"
        assert proxy.counts() == {"requests": 7, "slowdown": 0, "reset": 0, "delayed": 0, "down": 5}
