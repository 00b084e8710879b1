"""An S3 server that throttles and drops, for tests: an HTTP proxy on 127.0.0.1 in front of the local
S3 server that answers some requests as a store under load does. Each request draws, from one
seeded generator, whether it is

- throttled: answered ``503 SlowDown`` with S3's XML error body (no body for a HEAD), and never
  forwarded, as S3 does when it sheds load;
- dropped: forwarded, then its connection reset halfway through the answer's body (a drop drawn
  for an answer without a body, such as a HEAD's or an upload's, falls on the next answer that has
  one: with nothing of an answer read, curl inside the AWS SDK would send the request again by
  itself, unseen by the SDK's retries);
- delayed: its answer held back for some seconds.

While :meth:`FaultyS3.down` is on, every request is throttled (a store that stays down). The proxy
counts what it did. Requests are forwarded byte for byte (chunked uploads included), so signatures
and checksums hold.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlsplit

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message><RequestId>{id}</RequestId></Error>')
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


@dataclass(frozen=True)
class Faults:
    slowdown: float = 0.10  # share of requests answered 503 SlowDown
    reset: float = 0.02  # share of requests whose connection is reset in the middle of the answer
    delay: float = 0.02  # share of answers held back ...
    delay_s: float = 2.0  # ... this many seconds
    seed: int = 0


class FaultyS3:
    """The proxy, serving from its own threads until :meth:`close`."""

    def __init__(self, upstream: str, faults: Faults = Faults()):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.faults = faults
        self._rng = random.Random(faults.seed)
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._down = False
        self._resets_due = 0  # drops drawn for answers without a body, for the next answers with one
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self
        self._thread = threading.Thread(target=self._server.serve_forever, name="faulty-s3", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def counts(self) -> dict:
        """``requests`` and what was done to them: ``slowdown``, ``reset``, ``delayed``, ``down``."""
        with self._lock:
            return {k: self._counts[k] for k in ("requests", "slowdown", "reset", "delayed", "down")}

    def down(self, on: bool = True) -> None:
        with self._lock:
            self._down = on

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _draw(self) -> str:
        """What happens to the next request: ``down``, ``slowdown``, ``reset``, ``delayed`` or ``""``
        (the k-th request gets the k-th draw)."""
        with self._lock:
            self._counts["requests"] += 1
            fault, late = self._rng.random(), self._rng.random()
            if self._down:
                return "down"
            if fault < self.faults.slowdown:
                return "slowdown"
            if fault < self.faults.slowdown + self.faults.reset:
                return "reset"
            return "delayed" if late < self.faults.delay else ""

    def _done(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1

    def _reset_now(self, kind: str, has_body: bool) -> bool:
        """Whether to drop this answer: its own draw, or one drawn earlier for an answer without a body."""
        with self._lock:
            if kind == "reset" and not has_body:
                self._resets_due += 1
            elif has_body and (kind == "reset" or (not kind and self._resets_due)):
                self._resets_due -= kind != "reset"
                self._counts["reset"] += 1
                return True
            return False


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue for the SDK's uploads
    upstream: http.client.HTTPConnection | None = None

    def log_message(self, format, *args) -> None:
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # the client went away, or this side reset the connection
            pass
        finally:
            if self.upstream is not None:
                self.upstream.close()

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()

    def _request_body(self) -> bytes:
        """The body as it came, framing included: a chunked body keeps its chunks and trailers."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raw = []
            while True:
                line = self.rfile.readline()
                raw.append(line)
                size = int(line.split(b";")[0], 16)
                if size == 0:
                    while True:
                        trailer = self.rfile.readline()
                        raw.append(trailer)
                        if trailer in (b"\r\n", b"\n", b""):
                            return b"".join(raw)
                raw.append(self.rfile.read(size + 2))  # the chunk and its CRLF
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _serve(self) -> None:
        proxy: FaultyS3 = self.server.proxy
        body = self._request_body()
        kind = proxy._draw()
        if kind in ("slowdown", "down"):
            proxy._done(kind)
            return self._slow_down()
        status, reason, headers, data = self._forward(body, proxy.upstream)
        head = [f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")]
        head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers
                 if k.lower() not in HOP_BY_HOP and (k.lower() != "content-length" or self.command == "HEAD")]
        if self.command != "HEAD":
            head.append(f"Content-Length: {len(data)}\r\n".encode())
        answer = b"".join(head) + b"\r\n"
        if kind == "delayed":
            proxy._done(kind)
            time.sleep(proxy.faults.delay_s)
        if proxy._reset_now(kind, bool(data) and self.command != "HEAD"):
            return self._reset(answer + data[: len(data) // 2])
        self.wfile.write(answer + (b"" if self.command == "HEAD" else data))

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

    def _forward(self, body: bytes, upstream: tuple[str, int]):
        if self.upstream is None:
            self.upstream = http.client.HTTPConnection(*upstream, timeout=120)
        self.upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for key, value in self.headers.items():
            if key.lower() not in ("connection", "expect", "keep-alive", "proxy-connection"):
                self.upstream.putheader(key, value)
        self.upstream.endheaders()
        self.upstream.send(body)
        response = self.upstream.getresponse()
        data = response.read()
        return response.status, response.reason, response.getheaders(), data

    def _slow_down(self) -> None:
        body = SLOW_DOWN.replace(b"{id}", os.urandom(8).hex().encode())
        self.send_response(503, "Slow Down")
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self, partial: bytes) -> None:
        """Send ``partial``, then reset the connection (RST, not an orderly close)."""
        self.wfile.write(partial)
        self.wfile.flush()
        time.sleep(0.05)  # let the client take the part: a reset discards what it has not read yet
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()


@contextlib.contextmanager
def faulty_s3(faults: Faults = Faults()) -> Iterator[FaultyS3]:
    """The proxy in front of the S3 server ``AWS_ENDPOINT_URL`` names (the local one), with
    ``AWS_ENDPOINT_URL`` pointing at the proxy until the block ends, so that the clients of this
    process and the processes it starts go through it."""
    upstream = os.environ["AWS_ENDPOINT_URL"]
    proxy = FaultyS3(upstream, faults)
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
    try:
        yield proxy
    finally:
        os.environ["AWS_ENDPOINT_URL"] = upstream
        proxy.close()
