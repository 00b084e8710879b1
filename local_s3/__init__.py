"""A real S3 server on 127.0.0.1 (moto's server mode) for tests and the bench: the standard AWS
variables (``AWS_ENDPOINT_URL`` included) point at it while it runs, so pyarrow, Ray actors started
meanwhile and child processes all reach it; they are restored when it stops."""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator


@contextlib.contextmanager
def local_s3_server(key: str = "local") -> Iterator[Callable[[str], str]]:
    """Start the server; yields ``make_bucket(name)``, which creates a bucket and returns its
    ``s3://`` URI. Raises ImportError when moto is not installed (``pip install 'moto[server]'``)."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": key, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    admin = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], region="us-east-1",
                              access_key=key, secret_key=key, allow_bucket_creation=True)

    def make_bucket(name: str) -> str:
        admin.create_dir(name)
        return f"s3://{name}"

    try:
        yield make_bucket
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
