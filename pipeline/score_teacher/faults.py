"""Faults injected on purpose into a real scoring job, to test the fault policy end to end.

Set ``VOCAGNO_INJECT_FAULTS`` (on the driver; the job passes it on to its actors) to JSON::

    {"counter_dir": "/some/folder", "shards": {"3": {"error": "oom", "times": 2}}}

The first ``times`` tries at shard 3 then fail with ``error``: ``oom`` (``torch.cuda.OutOfMemoryError``),
``read`` (an ``OSError`` EIO), ``die`` (the actor's process exits at once) or ``bug`` (a ``TypeError``,
which is not transient); or ``hang``: the try waits until the file ``release`` exists (or for
``seconds``, an hour unless given), then goes on, as a shard on a node about to be lost would. Tries
are counted with files in ``counter_dir``, each holding the Ray node id of the try, so the count holds
across actor processes, restarts and nodes of one machine. Unset, it costs one environment lookup
per shard.
"""

from __future__ import annotations

import errno
import json
import os
import time


FAULTS_ENV = "VOCAGNO_INJECT_FAULTS"
KINDS = ("oom", "read", "die", "bug", "hang")


def inject_fault(index: int) -> None:
    """Fail this try at shard ``index`` if ``VOCAGNO_INJECT_FAULTS`` asks for it."""
    import torch  # lazy: seconds to import; a config error is refused first
    spec = os.environ.get(FAULTS_ENV)
    if not spec:
        return
    plan = json.loads(spec)
    fault = plan.get("shards", {}).get(str(index))
    if not fault:
        return
    if fault["error"] not in KINDS:
        raise ValueError(f"{FAULTS_ENV}: unknown error kind {fault['error']!r}; one of {', '.join(KINDS)}")
    tried = _count_try(plan["counter_dir"], index)
    if tried > int(fault["times"]):
        return
    message = f"injected fault ({fault['error']}) at shard {index}, try {tried} of {fault['times']} failing"
    if fault["error"] == "oom":
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory: {message}")
    if fault["error"] == "read":
        raise OSError(errno.EIO, f"Input/output error: {message}")
    if fault["error"] == "die":
        os._exit(1)
    if fault["error"] == "hang":
        _hang(fault.get("release"), float(fault.get("seconds", 3600)))
        return
    raise TypeError(message)


def _hang(release: str | None, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (release and os.path.exists(release)):
        time.sleep(0.1)


def _count_try(folder: str, index: int) -> int:
    """Record one more try at shard ``index`` (the file holds the node id); returns its number (1 for the first)."""
    os.makedirs(folder, exist_ok=True)
    n = 1
    while True:
        try:
            fd = os.open(os.path.join(folder, f"shard-{index}.try-{n}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            n += 1
            continue
        try:
            os.write(fd, _node_id().encode())
        finally:
            os.close(fd)
        return n


def _node_id() -> str:
    """The Ray node this process runs on, or "" outside Ray."""
    import ray  # lazy: seconds to import; a config error is refused first
    try:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - a note for tests only, never a reason to fail the try
        return ""
