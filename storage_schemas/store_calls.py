"""How many object-store requests this process made and how many of them the S3 client retried.

pyarrow's S3 file system retries inside the AWS SDK (its retry strategy) and tells Python nothing
about it. The SDK's own client-side monitoring does: with ``AWS_CSM_ENABLED=true`` it sends one UDP
datagram per API call (with ``AttemptCount``) and one per attempt (with the HTTP status or the error)
to ``AWS_CSM_HOST:AWS_CSM_PORT``. :func:`start` opens a listener for them on 127.0.0.1 and sets those
variables, before the SDK starts in this process (it reads them once, when the first S3 file system
is made). Processes started from this one inherit the variables, so a data-loader worker or a local
Ray actor sends its datagrams to the same listener; a process elsewhere (a Ray actor on another node)
starts its own and reports its counts with its results.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
from collections import Counter

CLIENT_ID = "vocagno"
_lock = threading.Lock()
_counts: Counter = Counter()
_reasons: Counter = Counter()
_state = {"listening": None}  # None: not started; True: this process listens; False: another listener counts


def start(own: bool = False) -> None:
    """Listen for the SDK's datagrams, unless a parent process on this host already does (then its
    listener counts this process's requests) or the user runs client-side monitoring of their own.
    ``own``: listen in any case (a run's own process, whatever started it, counts for itself)."""
    if _state["listening"] is not None:
        return
    inherited = os.environ.get("AWS_CSM_CLIENT_ID") == CLIENT_ID and os.environ.get("AWS_CSM_PORT") and not own
    users = os.environ.get("AWS_CSM_ENABLED", "").lower() == "true" and os.environ.get("AWS_CSM_CLIENT_ID") != CLIENT_ID
    if inherited or users:
        _state["listening"] = False
        return
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    _state["socket"] = sock
    os.environ.update(AWS_CSM_ENABLED="true", AWS_CSM_HOST="127.0.0.1", AWS_CSM_PORT=str(sock.getsockname()[1]),
                      AWS_CSM_CLIENT_ID=CLIENT_ID)
    threading.Thread(target=_listen, args=(sock,), name="s3-call-counts", daemon=True).start()
    _state["listening"] = True


def _listen(sock: socket.socket) -> None:
    while True:
        select.select([sock], [], [], 1.0)
        with _lock:
            _drain()


def _drain() -> None:
    """Count every datagram waiting (under ``_lock``). The SDK sends a call's datagrams before the call
    returns, so after :func:`_drain` the counts hold every call this process (or a child) finished."""
    sock = _state.get("socket")
    while sock is not None:
        try:
            data = sock.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        try:
            _count(json.loads(data))
        except ValueError:
            continue


def _count(event: dict) -> None:
    if event.get("Type") == "ApiCall":
        _counts["requests"] += 1
        _counts["retries"] += max(0, int(event.get("AttemptCount", 1)) - 1)
        _counts["gave_up"] += int(event.get("MaxRetriesExceeded", 0))
    elif event.get("Type") == "ApiCallAttempt":
        reason = failure_reason(event)
        if reason:
            _reasons[reason] += 1


def failure_reason(attempt: dict) -> str | None:
    """Why an attempt failed in a way the SDK retries (throttling, a server error, a dropped or
    timed-out connection); None for an answer (2xx, 3xx, and 4xx such as a missing object)."""
    status = int(attempt.get("HttpStatusCode") or 0)
    if attempt.get("AwsException") and (status >= 500 or status == 429):
        return str(attempt["AwsException"])  # SlowDown, InternalError, ...
    if status >= 500 or status == 429:
        return f"HTTP {status}"
    message = str(attempt.get("SdkExceptionMessage") or attempt.get("SdkException") or "")
    if "curlCode" in message or (status <= 0 and message):  # reset, refused or timed out, before or inside the answer
        return "connection"
    return None


def snapshot() -> dict:
    """The counts so far: ``requests`` (API calls), ``retries`` (attempts beyond each call's first),
    ``gave_up`` (calls whose retries ran out), ``failed_attempts`` by reason, and whether this
    process counts (``counted``: false where nothing listened to it)."""
    with _lock:
        _drain()
        return _current()


def take() -> dict:
    """:func:`snapshot`, then start counting from zero (for a process that reports its counts in parts)."""
    with _lock:
        _drain()
        counts = _current()
        _counts.clear()
        _reasons.clear()
    return counts


def _current() -> dict:
    return {"requests": _counts["requests"], "retries": _counts["retries"], "gave_up": _counts["gave_up"],
            "failed_attempts": dict(sorted(_reasons.items())), "counted": bool(_state["listening"])}


def add(total: dict, part: dict) -> dict:
    """Two counts together (the driver's and an actor's)."""
    reasons = Counter(total.get("failed_attempts", {}))
    reasons.update(part.get("failed_attempts", {}))
    return {"requests": total.get("requests", 0) + part.get("requests", 0),
            "retries": total.get("retries", 0) + part.get("retries", 0),
            "gave_up": total.get("gave_up", 0) + part.get("gave_up", 0),
            "failed_attempts": dict(sorted(reasons.items())),
            "counted": bool(total.get("counted")) or bool(part.get("counted"))}


def describe(counts: dict) -> str:
    """One line for a stage's summary."""
    if not counts.get("requests"):
        return "no request" if counts.get("counted") else "not counted (the S3 client started before the counter)"
    reasons = ", ".join(f"{k} {v:,}" for k, v in counts["failed_attempts"].items())
    line = f"{counts['requests']:,} requests, {counts['retries']:,} retried by the S3 client"
    line += f" ({reasons})" if reasons else ""
    return line + (f", {counts['gave_up']:,} given up" if counts["gave_up"] else "")
