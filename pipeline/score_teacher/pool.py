"""The Ray side of stage 1: start or join a cluster, size and place the scorer actors, ship the
code to every node, and run shards on the actors with a fault policy.

On a cluster whose nodes share nothing but the object store, nothing may rely on the driver's disk:
the package goes to every node with the job (a Ray ``runtime_env`` whose ``working_dir`` holds it), and
every local path the job reads or writes (a teacher folder, corpus files, the output folder) is
checked from every node before any actor starts (:func:`check_nodes_see`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import ray
import ray.exceptions as rx
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import pipeline
import storage_schemas
from pipeline.config import ConfigError, check_at_least, check_choice, refuse
from pipeline.score_teacher.faults import FAULTS_ENV

log = logging.getLogger(__name__)


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


ON_BAD_SHARD = ("stop", "skip")


@dataclass(frozen=True)
class PoolConfig:
    """The scorer actors and what happens when a shard fails.

    A shard whose scoring raises a transient error (:func:`is_transient`: CUDA out of memory, a read
    error, its actor or node died) is tried again, up to ``shard_retries`` more times, on whichever
    actor is free; a dead actor is replaced. Other errors are not retried. A shard that still fails
    stops the job (``on_bad_shard=stop``), or is left out and listed in the manifest's ``failed``
    (``skip``); the next run scores it again. ``max_restarts``/``max_task_retries`` are Ray's own
    restart of a dead actor and of its current call, which the shard's tries do not count.
    """

    num_actors: int | None = None  # None: as many as the nodes hold (GPUs, CPUs and resources per actor)
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per actor
    max_restarts: int = 2  # per actor, if it dies
    max_task_retries: int = 2  # a shard on a dead actor is retried on its restart
    shard_retries: int = 2  # more tries of a shard after a transient error
    on_bad_shard: str = "stop"  # stop | skip

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "on_bad_shard", self.on_bad_shard, ON_BAD_SHARD)
        check_at_least(found, "shard_retries", self.shard_retries, 0)
        check_at_least(found, "num_actors", self.num_actors, 1)
        for name in ("num_gpus", "num_cpus"):
            if getattr(self, name) < 0:
                found.append(f"{name}: {getattr(self, name)} must be >= 0")
        bad = [str(k) for k, v in self.resources.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0]
        if bad:
            found.append(f"resources: amounts must be numbers >= 0: {', '.join(bad)}")
        return found

    def __post_init__(self) -> None:
        refuse(self)

    def per_actor(self) -> dict[str, float]:
        """What one actor asks of its node, as Ray names resources."""
        need = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: float(v) for k, v in need.items() if v > 0}


# ---------------------------------------------------------------------------------------------
# Starting Ray, shipping the code


def init_ray(rc: RayConfig) -> bool:
    """Start or join Ray with the job's runtime environment (:func:`shipped_code`); returns True when
    this call started it (so the job shuts it down). A caller that starts Ray itself should pass
    such a runtime environment to its own ``ray.init`` for the code to reach other nodes: Ray
    uploads local code only for a whole job, never for one actor."""

    if ray.is_initialized():
        return False
    kwargs = dict(include_dashboard=rc.include_dashboard, dashboard_host=rc.dashboard_host,
                  log_to_driver=True, configure_logging=True, logging_level=logging.WARNING)
    with shipped_code(rc) as env:
        if rc.address:
            ray.init(address=rc.address, runtime_env=env, **kwargs)
        else:  # a new local cluster, never one that happens to run on this machine
            ray.init(address="local", num_cpus=rc.num_cpus, runtime_env=env, **kwargs)
    return True


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
# How many actors, and whether every node sees the job's local paths


def alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def actors_per_node(resources: dict[str, float], need: dict[str, float]) -> int:
    """How many actors that each ask ``need`` fit on a node with ``resources`` (its totals)."""
    if not need:
        return 1
    return min(int(resources.get(k, 0.0) / v + 1e-9) for k, v in need.items())


def num_actors(pool: PoolConfig, nodes: Sequence[dict]) -> int:
    """Actors to start: the sum over nodes of what each node holds (the minimum over its GPUs, CPUs
    and custom resources of what one actor asks), so that none is left waiting for a place;
    ``pool.num_actors`` caps it. Raises :class:`ConfigError` when no node holds even one."""
    need = pool.per_actor()
    capacity = sum(actors_per_node(n.get("Resources", {}), need) for n in nodes)
    if capacity < 1:
        have = "; ".join(f"{_node_label(n)}: " + ", ".join(f"{k}={v:g}" for k, v in sorted(n.get("Resources", {}).items())
                                                           if k in need) for n in nodes)
        raise ConfigError(f"one scorer actor asks for {_amounts(need)} (pool.num_gpus, pool.num_cpus, pool.resources), "
                          f"but no node of the Ray cluster has that much ({have or 'no nodes'})")
    if pool.num_actors and pool.num_actors > capacity:
        log.warning("pool.num_actors=%d, but the cluster's nodes hold only %d actors of %s: starting %d",
                    pool.num_actors, capacity, _amounts(need), capacity)
    return min(pool.num_actors or capacity, capacity)


def _amounts(need: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in need.items()) or "nothing"


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


# ---------------------------------------------------------------------------------------------
# Running shards with the fault policy

# Errors of the node's file system that another try will not fix.
PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                    errno.EISDIR, errno.ENOTDIR}


def is_transient(exc: BaseException) -> bool:
    """Whether another try of the shard may succeed: its actor, worker or node died (Ray's own retries
    are spent), Ray's memory monitor killed it, CUDA ran out of memory, or a read failed (an
    ``OSError`` other than a full, read-only or missing disk or path)."""

    if isinstance(exc, (rx.RayActorError, rx.ActorUnavailableError, rx.WorkerCrashedError, rx.NodeDiedError,
                        rx.ObjectLostError, rx.OutOfMemoryError, rx.LocalRayletDiedError)):
        return True
    cause = exc.cause if isinstance(exc, rx.RayTaskError) else exc
    if type(cause).__name__ == "OutOfMemoryError" and type(cause).__module__.startswith("torch"):
        return True  # torch.cuda.OutOfMemoryError (torch.OutOfMemoryError)
    return isinstance(cause, OSError) and cause.errno not in PERMANENT_ERRNOS


def first_line(exc: BaseException) -> str:
    """The last non-empty line of an error's text: for a Ray task error, the remote exception itself."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _described(refs: list) -> list[dict]:
    found = []
    for ref in refs:
        try:
            found.append(ray.get(ref, timeout=30))
        except ray.exceptions.RayError:
            continue  # that actor died; its replacement was not described
    return found


class ShardFailedError(RuntimeError):
    """A shard failed for good and ``on_bad_shard=stop``; not a user error: its traceback (and the
    remote one in its message) is kept. ``failed`` lists every shard that failed in this run."""

    def __init__(self, message: str, failed: list[dict]):
        super().__init__(message)
        self.failed = failed


@dataclass
class PoolRun:
    scored: list[dict] = field(default_factory=list)  # marker entries of the shards scored
    failed: list[dict] = field(default_factory=list)  # {"index", "error", "attempts"} of the shards given up
    actors: list[dict] = field(default_factory=list)  # where the first actors ran (their describe())


def run_shards(make_actor: Callable[[], object], n_actors: int, specs: Sequence, pool: PoolConfig,
               on_scored: Callable[[dict, PoolRun], None], on_failed: Callable[[dict, PoolRun], None]) -> PoolRun:
    """Score ``specs`` (each with an ``index``) on ``n_actors`` actors from ``make_actor``, one shard
    per actor at a time, with :class:`PoolConfig`'s fault policy. ``on_scored``/``on_failed`` are called
    on the driver as each shard finishes or is given up. The actors are killed on return or error;
    where the first ones ran (their ``describe()``) is in the result's ``actors``."""

    actors = [make_actor() for _ in range(n_actors)]
    described = [actor.describe.remote() for actor in actors]
    idle = deque(range(n_actors))
    queue = deque(specs)
    tries: dict[int, int] = {}
    running: dict = {}  # ObjectRef -> (actor slot, spec)
    run = PoolRun()
    try:
        while queue or running:
            while queue and idle:
                slot, spec = idle.popleft(), queue.popleft()
                tries[spec.index] = tries.get(spec.index, 0) + 1
                running[actors[slot].score_shard.remote(spec, tries[spec.index])] = (slot, spec)
            [ref], _ = ray.wait(list(running), num_returns=1)
            slot, spec = running.pop(ref)
            try:
                entry = ray.get(ref)
            except ray.exceptions.RayError as exc:
                if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
                    ray.kill(actors[slot], no_restart=True)
                    actors[slot] = make_actor()  # a fresh one in its place
                idle.append(slot)
                n = tries[spec.index]
                if is_transient(exc) and n <= pool.shard_retries:
                    log.warning("shard %d failed (try %d of %d), trying again: %s", spec.index, n,
                                pool.shard_retries + 1, first_line(exc))
                    queue.append(spec)
                    continue
                failure = {"index": spec.index, "error": first_line(exc), "attempts": n}
                run.failed.append(failure)
                on_failed(failure, run)
                if pool.on_bad_shard == "stop":
                    raise ShardFailedError(
                        f"shard {spec.index} failed after {n} tr{'y' if n == 1 else 'ies'} ({first_line(exc)}); "
                        "the job stops (pool.on_bad_shard=skip leaves it out and goes on; a rerun scores it)\n"
                        f"{exc}", run.failed) from exc
                log.error("shard %d failed after %d tries and is skipped (listed in the manifest's failed; a rerun "
                          "scores it again): %s", spec.index, n, first_line(exc))
                continue
            idle.append(slot)
            run.scored.append(entry)
            on_scored(entry, run)
        run.actors = _described(described)
        return run
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
