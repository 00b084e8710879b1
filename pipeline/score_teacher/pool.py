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
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence


import pipeline
import storage_schemas
from pipeline.runtime.config import ConfigError, UserError, check_at_least, check_choice, handling, refuse
from pipeline.folders.output_folder import storage_error
from pipeline.score_teacher.faults import FAULTS_ENV
from storage_schemas import filesystem as sfs

log = logging.getLogger(__name__)
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


ON_BAD_SHARD = ("stop", "skip")


@dataclass(frozen=True)
class PoolConfig:
    """The scorer actors and what happens when a shard fails or a node is lost.

    A shard whose scoring raises a transient error (:func:`is_transient`: CUDA out of memory, a read
    error, its actor or node died) is tried again, up to ``shard_retries`` more times, on whichever
    actor is free. Other errors are not retried. A shard that still fails stops the job
    (``on_bad_shard=stop``), or is left out and listed in the manifest's ``failed`` (``skip``); the
    next run scores it again. The pool, not Ray, replaces a dead actor, and only where an alive node
    has room for it (:func:`run_shards`); it waits for room at most ``wait_for_resources_s`` with no
    actor placed, saying what it waits for every ``wait_log_every_s``.
    """

    num_actors: int | None = None  # None: as many as the alive nodes hold (GPUs, CPUs and resources per actor)
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per actor
    shard_retries: int = 2  # more tries of a shard after a transient error
    on_bad_shard: str = "stop"  # stop | skip
    wait_for_resources_s: float = 600.0  # with no actor placed this long (no node has room), the job stops
    wait_log_every_s: float = 60.0  # while actors wait for a place, log what they wait for this often

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "on_bad_shard", self.on_bad_shard, ON_BAD_SHARD)
        check_at_least(found, "shard_retries", self.shard_retries, 0)
        check_at_least(found, "num_actors", self.num_actors, 1)
        for name in ("wait_for_resources_s", "wait_log_every_s"):
            if getattr(self, name) <= 0:
                found.append(f"{name}: {getattr(self, name)} must be > 0")
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
# How many actors, and whether every node sees the job's local paths


def alive_nodes() -> list[dict]:
    import ray  # lazy: seconds to import; a config error is refused first
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
    capacity = cluster_capacity(nodes, need)
    if capacity < 1:
        raise ConfigError(f"one scorer actor asks for {_amounts(need)} (pool.num_gpus, pool.num_cpus, pool.resources), "
                          f"but no node of the Ray cluster has that much ({_have(nodes, need)})")
    if pool.num_actors and pool.num_actors > capacity:
        log.warning("pool.num_actors=%d, but the cluster's nodes hold only %d actors of %s: starting %d "
                    "(more as nodes join)", pool.num_actors, capacity, _amounts(need), capacity)
    return min(pool.num_actors or capacity, capacity)


def cluster_capacity(nodes: Sequence[dict], need: dict[str, float]) -> int:
    """How many actors that each ask ``need`` the ``nodes`` hold, node by node (their totals)."""
    return sum(actors_per_node(n.get("Resources", {}), need) for n in nodes)


def _amounts(need: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in need.items()) or "nothing"


def _have(nodes: Sequence[dict], need: dict[str, float], shown: int = 4) -> str:
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


# ---------------------------------------------------------------------------------------------
# Running shards with the fault policy

# Errors of the node's file system that another try will not fix.
PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                    errno.EISDIR, errno.ENOTDIR}


def is_transient(exc: BaseException) -> bool:
    """Whether another try of the shard may succeed: its actor, worker or node died (Ray's own retries
    are spent), Ray's memory monitor killed it, CUDA ran out of memory, or a read failed (an
    ``OSError`` other than a full, read-only or missing disk or path)."""
    import ray.exceptions as rx  # lazy: seconds to import; a config error is refused first

    if isinstance(exc, (rx.RayActorError, rx.ActorUnavailableError, rx.WorkerCrashedError, rx.NodeDiedError,
                        rx.ObjectLostError, rx.OutOfMemoryError, rx.LocalRayletDiedError)):
        return True
    cause = exc.cause if isinstance(exc, rx.RayTaskError) else exc
    if isinstance(cause, UserError):  # e.g. an engine that cannot start with these settings
        return False
    if type(cause).__name__ == "OutOfMemoryError" and type(cause).__module__.startswith("torch"):
        return True  # torch.cuda.OutOfMemoryError (torch.OutOfMemoryError)
    return isinstance(cause, OSError) and cause.errno not in PERMANENT_ERRNOS


def first_line(exc: BaseException) -> str:
    """The last non-empty line of an error's text: for a Ray task error, the remote exception itself."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


class ShardFailedError(RuntimeError):
    """A shard failed for good and ``on_bad_shard=stop``; not a user error: its traceback (and the
    remote one in its message) is kept. ``failed`` lists every shard that failed in this run."""

    def __init__(self, message: str, failed: list[dict]):
        super().__init__(message)
        self.failed = failed


class ResourcesUnavailableError(UserError, RuntimeError):
    """No scorer actor could be placed for ``pool.wait_for_resources_s``: the alive nodes lack the
    resources one actor asks for. The shards finished so far are kept; a rerun resumes from them."""


class ActorStartError(RuntimeError):
    """Scorer actors failed to load the teacher (not a user error: the traceback is kept)."""


# The pool looks at the cluster's nodes this often while shards run (and wakes this often when
# nothing finishes): to drop actors on lost nodes, grow and shrink, log a wait, and end it.
CHECK_EVERY_S = 2.0


@dataclass
class PoolRun:
    scored: list[dict] = field(default_factory=list)  # marker entries of the shards scored
    failed: list[dict] = field(default_factory=list)  # {"index", "error", "attempts"} of the shards given up
    actors: list[dict] = field(default_factory=list)  # where the actors that started ran (their describe())


@dataclass(eq=False)
class _Actor:
    handle: object
    call: object = None  # its pending describe() (state "placing") or load() ("loading")
    state: str = "placing"  # placing -> loading -> live
    info: dict = field(default_factory=dict)  # its describe(): node_id, node_ip, hostname ...


class ScorerPool:
    """The scorer actors of one job, sized to what the alive nodes hold.

    An actor is *placed* once its ``describe()`` answers (Ray found it a node with the resources it
    asks for and started it), then loads the teacher (``load()``), then is *live* and takes shards:
    a shard is never bound to an actor that has not started. Every :data:`CHECK_EVERY_S` the pool
    reads the alive nodes: it drops the actors on nodes that are gone, creates actors up to what
    the nodes hold (``pool.num_actors`` caps it; the shards left cap it too), and removes the
    unplaced ones they can no longer hold. It grows when nodes join, as on an autoscaling cluster.
    While actors wait for a place it logs what for every ``pool.wait_log_every_s``; after
    ``pool.wait_for_resources_s`` with no actor placed it raises :class:`ResourcesUnavailableError`.
    Ray's own restarts are off: Ray would restart a dead actor wherever it could, even where no
    node has room, with the shard it ran still bound to it."""

    def __init__(self, make_actor: Callable[[], object], pool: PoolConfig):
        self.make_actor, self.pool, self.need = make_actor, pool, pool.per_actor()
        self.actors: list[_Actor] = []
        self.idle: deque[_Actor] = deque()
        self.started: list[dict] = []  # describe() of every actor that loaded the teacher, in order
        self.nodes: list[dict] = []
        self.capacity: int | None = None
        self.checked = -float("inf")
        self.unplaced_since: float | None = time.monotonic()  # since when no actor is placed
        self.waiting_since: float | None = None  # since when an actor waits for a place
        self.next_log = float("inf")
        self.load_failures = 0  # in a row

    # -- reading the cluster, growing and shrinking

    def check(self, work_left: int) -> None:
        """Look at the alive nodes (at most every :data:`CHECK_EVERY_S`) and fit the pool to them;
        log and bound the wait for resources."""
        now = time.monotonic()
        if now - self.checked < CHECK_EVERY_S:
            return
        self.checked = now
        self.nodes = alive_nodes()
        alive = {n["NodeID"] for n in self.nodes}
        for actor in [a for a in self.actors if a.state != "placing" and a.info.get("node_id") not in alive]:
            log.warning("the node of a scorer actor is gone (%s): its shard, if any, is tried again elsewhere",
                        actor.info.get("node_ip"))
            self.remove(actor)  # its running shard fails and is queued again
        capacity = cluster_capacity(self.nodes, self.need)
        if self.capacity is not None and capacity != self.capacity:
            (log.warning if capacity < self.capacity else log.info)(
                "the alive nodes now hold %d scorer actor%s of %s (were %d)%s", capacity, "s" * (capacity != 1),
                _amounts(self.need), self.capacity, "" if capacity else f": {_have(self.nodes, self.need)}")
        self.capacity = capacity
        self._fit(min(self.pool.num_actors or capacity, capacity, work_left))
        self._watch_wait(now, work_left)

    def _fit(self, wanted: int) -> None:
        """Remove unplaced actors beyond ``wanted`` (newest first), then create actors up to it."""
        placed = len(self.actors) - len(self.placing())
        for actor in self.placing()[::-1][:max(0, len(self.actors) - max(wanted, placed))]:
            self.remove(actor)
        for _ in range(wanted - len(self.actors)):
            handle = self.make_actor()
            self.actors.append(_Actor(handle, call=handle.describe.remote()))

    def placing(self) -> list[_Actor]:
        return [a for a in self.actors if a.state == "placing"]

    def remove(self, actor: _Actor) -> None:
        import ray  # lazy: seconds to import; a config error is refused first
        ray.kill(actor.handle, no_restart=True)
        self.actors.remove(actor)
        if actor in self.idle:
            self.idle.remove(actor)

    def close(self) -> None:
        for actor in list(self.actors):
            self.remove(actor)

    # -- actors starting

    def starting_calls(self) -> list:
        return [a.call for a in self.actors if a.state != "live"]

    def started_call(self, ref) -> None:
        """An actor's ``describe()`` or ``load()`` answered (or failed)."""
        import ray  # lazy: seconds to import; a config error is refused first

        actor = next((a for a in self.actors if a.call == ref), None)
        if actor is None:  # removed meanwhile
            return
        try:
            answer = ray.get(ref)
        except ray.exceptions.RayError as exc:
            self._start_failed(actor, exc)
            return
        actor.info = answer
        if actor.state == "placing":  # placed: now load the teacher
            actor.state, actor.call = "loading", actor.handle.load.remote()
        else:
            actor.state, actor.call = "live", None
            self.load_failures = 0
            self.started.append(answer)
            self.idle.append(actor)

    def _start_failed(self, actor: _Actor, exc: BaseException) -> None:
        """An actor lost with its node (or removed) is forgotten; one whose teacher failed to load is
        replaced, and the job stops after ``1 + shard_retries`` such failures in a row, or at once
        when the error is not transient."""
        import ray  # lazy: seconds to import; a config error is refused first
        import ray.exceptions as rx  # lazy: seconds to import; a config error is refused first

        self.remove(actor)
        if isinstance(exc, ray.exceptions.RayActorError) and not exc.actor_init_failed:
            log.info("a scorer actor was lost while starting (%s); another is started where there is room",
                     first_line(exc))
            return
        self.load_failures += 1
        cause = exc.cause if isinstance(exc, rx.RayTaskError) else None
        if isinstance(cause, UserError):  # the actor's own one-line error (an engine that cannot start): as it is
            raise cause from None
        if not is_transient(exc) or self.load_failures > self.pool.shard_retries:
            raise ActorStartError(f"a scorer actor failed to start ({self.load_failures} in a row): "
                                  f"{first_line(exc)}\n{exc}") from exc
        log.warning("a scorer actor failed to start (%d in a row), starting another: %s", self.load_failures,
                    first_line(exc))

    # -- waiting for resources

    def _watch_wait(self, now: float, work_left: int) -> None:
        placed = len(self.actors) - len(self.placing())
        self.unplaced_since = None if placed or not work_left else (self.unplaced_since or now)
        waiting = bool(work_left) and (bool(self.placing()) or not placed)
        if not waiting:
            self.waiting_since, self.next_log = None, float("inf")
            return
        if self.waiting_since is None:
            self.waiting_since, self.next_log = now, now + self.pool.wait_log_every_s
        if now >= self.next_log:
            log.warning("%s", self.wait_text(now, work_left))
            self.next_log = now + self.pool.wait_log_every_s
        if self.unplaced_since is not None and now - self.unplaced_since > self.pool.wait_for_resources_s:
            raise ResourcesUnavailableError(
                f"no scorer actor could be placed for {now - self.unplaced_since:.0f} s "
                f"(pool.wait_for_resources_s={self.pool.wait_for_resources_s:g}): {self._lacking()}; "
                "the shards finished so far are kept, and a rerun resumes from them once the cluster has "
                "room for one actor")

    def wait_text(self, now: float, work_left: int) -> str:
        """What the pool waits for, since when, in one line."""
        placing = self.placing()
        since = time.strftime("%H:%M:%S", time.localtime(time.time() - (now - self.waiting_since)))
        placed = len(self.actors) - len(placing)
        text = (f"waiting for resources since {since} ({now - self.waiting_since:.0f} s): "
                f"{len(placing)} scorer actor{'s' * (len(placing) != 1)} not placed, {placed} placed, "
                f"{work_left} shard{'s' * (work_left != 1)} left; {self._lacking()}")
        if not placed:
            text += f"; the job stops after pool.wait_for_resources_s={self.pool.wait_for_resources_s:g} s without one"
        return text

    def _lacking(self) -> str:
        """Which resources are missing: what one actor asks, against what the alive nodes hold."""
        import ray  # lazy: seconds to import; a config error is refused first

        asks = f"one actor asks for {_amounts(self.need)} (pool.num_gpus, pool.num_cpus, pool.resources)"
        if not self.capacity:
            return f"{asks} and no alive node has that much ({_have(self.nodes, self.need)})"
        free = ray.available_resources()
        return (f"{asks}; the alive nodes hold {self.capacity} such actor{'s' * (self.capacity != 1)}, but the "
                f"cluster has {', '.join(f'{k}={free.get(k, 0.0):g}' for k in self.need)} free (others hold the rest)")

    def status(self) -> str:
        """A few words for the progress bar: how many actors score, load the teacher, wait for a place."""
        counts = {state: sum(a.state == state for a in self.actors) for state in ("live", "loading", "placing")}
        if not self.actors:
            return f"waiting for resources ({_amounts(self.need)} per actor)"
        words = {"live": "scoring", "loading": "loading the teacher", "placing": "waiting for resources"}
        return "actors: " + ", ".join(f"{n} {words[state]}" for state, n in counts.items() if n)


def run_shards(make_actor: Callable[[], object], specs: Sequence, pool: PoolConfig,
               on_scored: Callable[[dict, PoolRun], None], on_failed: Callable[[dict, PoolRun], None],
               on_status: Callable[[str], None] | None = None) -> PoolRun:
    """Score ``specs`` (each with an ``index``) on a :class:`ScorerPool` of actors from ``make_actor``
    (with ``describe()``, ``load()`` and ``score_shard(spec, attempt)``), one shard per live actor at
    a time, with :class:`PoolConfig`'s fault policy. ``on_scored``/``on_failed`` are called on the
    driver as each shard finishes or is given up, ``on_status`` with a few words when the pool's
    state changes. The actors are killed on return or error; where those that started ran is in the
    result's ``actors``."""
    import ray  # lazy: seconds to import; a config error is refused first

    actors = ScorerPool(make_actor, pool)
    queue = deque(specs)
    tries: dict[int, int] = {}
    running: dict = {}  # ObjectRef -> (actor, spec)
    run = PoolRun()
    status = None
    try:
        while queue or running:
            actors.check(len(queue) + len(running))
            while queue and actors.idle:
                actor, spec = actors.idle.popleft(), queue.popleft()
                tries[spec.index] = tries.get(spec.index, 0) + 1
                running[actor.handle.score_shard.remote(spec, tries[spec.index])] = (actor, spec)
            if on_status is not None and actors.status() != status:
                status = actors.status()
                on_status(status)
            calls = [*running, *actors.starting_calls()]
            if not calls:  # no actor yet: the nodes hold none
                time.sleep(CHECK_EVERY_S)
                continue
            ready, _ = ray.wait(calls, num_returns=1, timeout=CHECK_EVERY_S)
            for ref in ready:
                if ref in running:
                    _shard_done(ref, running, queue, tries, actors, pool, run, on_scored, on_failed)
                else:
                    actors.started_call(ref)
        run.actors = actors.started
        return run
    finally:
        actors.close()


def _shard_done(ref, running: dict, queue: deque, tries: dict, actors: ScorerPool, pool: PoolConfig, run: PoolRun,
                on_scored, on_failed) -> None:
    """A shard's call answered: record it, or try it again, or give it up (the fault policy)."""
    import ray  # lazy: seconds to import; a config error is refused first

    actor, spec = running.pop(ref)
    try:
        entry = ray.get(ref)
    except ray.exceptions.RayError as exc:
        if isinstance(exc, ray.exceptions.RayActorError):  # dead or unreachable: never given work again
            if actor in actors.actors:
                actors.remove(actor)
        elif actor in actors.actors:
            actors.idle.append(actor)
        storage = storage_error(exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc,
                                f"shard {spec.index} could not be written")
        if storage is not None:  # every shard writes to the same place: skipping or retrying would not help
            run.failed.append({"index": spec.index, "error": str(storage), "attempts": tries[spec.index]})
            raise storage from None
        n = tries[spec.index]
        store = sfs.unavailable(exc)
        if store:  # the S3 client has spent its retries: another try of the shard would only wait as long again
            raise sfs.StoreUnavailableError(f"shard {spec.index}: {store}") from exc
        if is_transient(exc) and n <= pool.shard_retries:
            log.warning("shard %d failed (try %d of %d), trying again: %s", spec.index, n,
                        pool.shard_retries + 1, first_line(exc))
            queue.append(spec)
            return
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
        return
    if actor in actors.actors:
        actors.idle.append(actor)
    run.scored.append(entry)
    on_scored(entry, run)
