"""The Ray side of stage 1 that is not the pool: start or join a cluster, ship the code to every
node, read what the alive nodes hold, and check that every node sees the job's local paths.

On a cluster whose nodes share nothing but the object store, nothing may rely on the driver's disk:
the package goes to every node with the job (a Ray ``runtime_env`` whose ``working_dir`` holds it), and
every local path the job reads or writes (a teacher folder, corpus files, the output folder) is
checked from every node before any actor starts (:func:`check_nodes_see`). The scorer actors and
their fault policy are :mod:`pipeline.score_teacher.pool`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import pipeline
import storage_schemas
from pipeline.runtime.config import ConfigError, handling, refuse
from pipeline.score_teacher.faults import FAULTS_ENV

RAY_AUTH_LOG = "ray._private.authentication.authentication_token_setup"  # Ray's notes on token authentication


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # None: start a local cluster; "auto" or ray://host:port: join one
    num_cpus: int | None = None  # local cluster only
    include_dashboard: bool = False
    dashboard_host: str = "127.0.0.1"
    ship_code: bool = True  # send pipeline/ and storage_schemas/ to every node with the actors (runtime_env)
    env_vars: dict[str, str] = field(default_factory=dict)  # set in every actor's environment (HF_HOME, ...)

    def problems(self) -> list[str]:
        bad = [str(k) for k, v in self.env_vars.items() if not isinstance(v, str)]
        return [f"env_vars: values must be strings (quote them): {', '.join(bad)}"] if bad else []

    def __post_init__(self) -> None:
        refuse(self)


# ---------------------------------------------------------------------------------------------
# Starting Ray, shipping the code


def init_ray(rc: RayConfig) -> bool:
    """Start or join Ray with the job's runtime environment (:func:`shipped_code`); returns True when
    this call started it (so the job shuts it down). A caller that starts Ray itself should pass
    such a runtime environment to its own ``ray.init`` for the code to reach other nodes: Ray
    uploads local code only for a whole job, never for one actor."""
    import ray  # lazy: seconds to import; a config error is refused first

    if ray.is_initialized():
        return False
    kwargs = dict(include_dashboard=rc.include_dashboard, dashboard_host=rc.dashboard_host,
                  log_to_driver=True, configure_logging=True, logging_level=logging.WARNING)
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # the actors' lines as plain text, without colour codes
    handlers = _python_signal_handlers()
    with signals_held(handlers) as held:
        with shipped_code(rc) as env:
            if rc.address:
                ray.init(address=rc.address, runtime_env=env, **kwargs)
            else:  # a new local cluster, never one that happens to run on this machine
                with _quiet(RAY_AUTH_LOG):  # its note that token authentication is on, as it is by default
                    ray.init(address="local", num_cpus=rc.num_cpus, runtime_env=env, **kwargs)
    if held:  # a signal came while Ray started: stop it, then the entry point's own handler (its line, its status)
        ray.shutdown()
        handlers[held[0]](held[0], None)
    return True


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Only errors from ``logger_name`` while this lasts."""
    logger = logging.getLogger(logger_name)
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


@contextlib.contextmanager
def signals_held(handlers: dict) -> Iterator[list[int]]:
    """While Ray starts, the signals of ``handlers`` (the entry point's) are only noted in the list
    yielded, and Ray does not install its own SIGTERM handler (which exits at once): an exception
    raised in a signal handler while Ray forks its processes is printed and dropped by Python's
    at-fork hooks, so the signal would be lost. ``handlers`` are put back afterwards (Ray's core
    worker installs its own, which aborts on SIGTERM)."""
    import ray._private.utils as ray_utils  # lazy: seconds to import; a config error is refused first

    held: list[int] = []
    keep = getattr(ray_utils, "set_sigterm_handler", None)
    if handlers and keep is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    try:
        with handling(handlers, lambda signum, frame: held.append(signum)):
            yield held
    finally:
        if keep is not None:
            ray_utils.set_sigterm_handler = keep
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _python_signal_handlers() -> dict:
    """The entry point's own SIGINT / SIGTERM handlers (Python callables), to put back after Ray
    starts; none outside the main thread, where signals cannot be handled."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    found = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    return {s: h for s, h in found.items() if callable(h)}


@contextlib.contextmanager
def shipped_code(rc: RayConfig) -> Iterator[dict | None]:
    """The job's Ray runtime environment while Ray starts: :func:`actor_env`, and (``ship_code``) a
    ``working_dir`` holding a copy of the library's two packages and nothing else. Ray uploads it
    once to the cluster and every worker, on every node, imports the library from it, ahead of any
    installed copy; a job with a working_dir also stops Ray from putting the driver's current folder
    on the workers' import path, where another node could hold other code under the same path.
    Third-party packages (torch, transformers ...) must be installed on every node; data and models
    never travel this way."""

    env: dict = dict(actor_env(rc) or {})
    if not rc.ship_code:
        yield env or None
        return
    staging = tempfile.mkdtemp(prefix="vocagno-code-")
    try:
        for package in (pipeline, storage_schemas):
            source = os.path.dirname(os.path.abspath(package.__file__))
            shutil.copytree(source, os.path.join(staging, package.__name__), ignore=shutil.ignore_patterns(*CODE_EXCLUDES))
        yield {**env, "working_dir": staging, "excludes": list(CODE_EXCLUDES)}
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # uploaded by ray.init by now


CODE_EXCLUDES = ("__pycache__", "*.pyc", "*.so", ".pytest_cache")


def actor_env(rc: RayConfig) -> dict | None:
    """What each actor's own runtime environment adds to the job's: the environment variables asked
    for (``ray.env_vars``, and the fault-injection variable when it is set on the driver)."""
    env_vars = dict(rc.env_vars)
    if os.environ.get(FAULTS_ENV):
        env_vars[FAULTS_ENV] = os.environ[FAULTS_ENV]
    return {"env_vars": env_vars} if env_vars else None


# ---------------------------------------------------------------------------------------------
# What the alive nodes hold, and whether every node sees the job's local paths


def alive_nodes() -> list[dict]:
    import ray  # lazy: seconds to import; a config error is refused first
    return [n for n in ray.nodes() if n.get("Alive")]


def actors_per_node(resources: dict[str, float], need: dict[str, float]) -> int:
    """How many actors that each ask ``need`` fit on a node with ``resources`` (its totals)."""
    if not need:
        return 1
    return min(int(resources.get(k, 0.0) / v + 1e-9) for k, v in need.items())


def cluster_capacity(nodes: Sequence[dict], need: dict[str, float]) -> int:
    """How many actors that each ask ``need`` the ``nodes`` hold, node by node (their totals)."""
    return sum(actors_per_node(n.get("Resources", {}), need) for n in nodes)


def amounts(need: dict[str, float]) -> str:
    """What one actor asks for, in a few words (``CPU=1, GPU=1``)."""
    return ", ".join(f"{k}={v:g}" for k, v in need.items()) or "nothing"


def nodes_have(nodes: Sequence[dict], need: dict[str, float], shown: int = 4) -> str:
    """What the first ``shown`` nodes hold of the resources one actor asks for."""
    parts = [f"{_node_label(n)}: " + (", ".join(f"{k}={n.get('Resources', {}).get(k, 0.0):g}" for k in need) or "-")
             for n in nodes[:shown]]
    more = f"; and {len(nodes) - shown} more" if len(nodes) > shown else ""
    return "; ".join(parts) + more if parts else "no nodes"


def _node_label(node: dict) -> str:
    return f"node {node.get('NodeManagerAddress', '?')} ({node.get('NodeManagerHostname', '?')})"


def local_files_to_check(paths: Iterable[str]) -> dict[str, int | None]:
    """The local files (with their sizes) and folders (None) a job reads, as the driver sees them:
    a folder is listed with the files directly in it, so a teacher folder is checked file by file."""
    found: dict[str, int | None] = {}
    for path in paths:
        if not path or not os.path.exists(path):
            continue
        path = os.path.abspath(path)
        if os.path.isdir(path):
            found[path] = None
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                if os.path.isfile(full):
                    found[full] = os.path.getsize(full)
        else:
            found[path] = os.path.getsize(path)
    return found


def node_view(files: dict[str, int | None], probe: tuple[str, bytes] | None) -> dict:
    """Run on one node: which of ``files`` it lacks or sees with another size (grouped by folder),
    and whether it reads the probe the driver wrote into the output folder."""
    problems = []
    if probe is not None:
        path, content = probe
        try:
            with open(path, "rb") as f:
                seen = f.read() == content
        except OSError:
            seen = False
        if not seen:
            problems.append(f"{os.path.dirname(path)} (the output folder: not the driver's, a file written there is not seen)")
    folders = [p for p, size in files.items() if size is None]
    by_folder: dict[str, list[str]] = {}
    for path, size in files.items():
        if size is not None and os.path.isfile(path) and os.path.getsize(path) == size:
            continue
        if size is None and os.path.isdir(path):
            continue
        parent = os.path.dirname(path)
        key = parent if size is not None and parent in folders else path
        by_folder.setdefault(key, []).append(os.path.basename(path))
    for key, names in by_folder.items():
        if key in folders:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            problems.append(f"{key}: {len(names)} of the driver's files missing or of another size ({shown})")
        else:
            problems.append(f"{key} (missing or of another size)")
    return {"host": socket.gethostname(), "missing": problems}


def check_nodes_see(nodes: Sequence[dict], local_paths: Iterable[str], output_dir: str | None, env: dict) -> None:
    """On a cluster of several nodes, check from each node that the local files the job reads exist
    with the driver's sizes and that the output folder (when local) is the driver's own folder (a
    probe file written by the driver is read back). Raises :class:`ConfigError` listing each node's
    problems and what to do instead."""
    import ray  # lazy: seconds to import; a config error is refused first
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # lazy: seconds to import; a config error is refused first

    files = local_files_to_check(local_paths)
    probe_path, probe = None, None
    if output_dir is not None:
        probe_path = os.path.join(output_dir, f".node-probe-{uuid.uuid4().hex[:12]}")
        probe = (probe_path, uuid.uuid4().bytes)
        with open(probe_path, "wb") as f:
            f.write(probe[1])
    try:
        view = ray.remote(node_view)
        refs = {n["NodeID"]: view.options(num_cpus=0, runtime_env=env, scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(files, probe) for n in nodes}
        seen = {node_id: ray.get(ref) for node_id, ref in refs.items()}
    finally:
        if probe_path is not None:
            os.unlink(probe_path)
    problems = []
    for node in nodes:
        missing = seen[node["NodeID"]]["missing"]
        if missing:
            shown = "; ".join(missing[:4]) + (f"; and {len(missing) - 4} more" if len(missing) > 4 else "")
            problems.append(f"{_node_label(node)}: {shown}")
    if problems:
        raise ConfigError(
            "the Ray cluster's nodes do not all see the local files this job reads and writes:\n  "
            + "\n  ".join(problems)
            + "\nOn nodes that share no disk, give the teacher as a hub id (each node downloads it or finds it "
              "in its HF_HOME) or a folder copied to the same path on every node, and the corpus files and "
              "output_root as object-store URIs (s3://..., gs://...) or paths on a file system every node mounts.")

