"""Stage 1's pool of scorer actors: how many to start, where they may run, and the fault policy
that runs shards on them (a shard tried again after a transient error, given up or the job
stopped after a lasting one, an actor replaced only where an alive node has room).

Starting Ray, shipping the code and reading the cluster's nodes are
:mod:`pipeline.score_teacher.ray_cluster`'s; the actor itself is
:class:`pipeline.score_teacher.scorer_actor.ShardScorer`.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pipeline.runtime.config import ConfigError, UserError, check_at_least, check_choice, refuse
from pipeline.folders.output_folder import storage_error
from pipeline.score_teacher.ray_cluster import alive_nodes, amounts, cluster_capacity, nodes_have
from storage_schemas import filesystem as sfs

log = logging.getLogger(__name__)

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
# How many actors


def num_actors(pool: PoolConfig, nodes: Sequence[dict]) -> int:
    """Actors to start: the sum over nodes of what each node holds (the minimum over its GPUs, CPUs
    and custom resources of what one actor asks), so that none is left waiting for a place;
    ``pool.num_actors`` caps it. Raises :class:`ConfigError` when no node holds even one."""
    need = pool.per_actor()
    capacity = cluster_capacity(nodes, need)
    if capacity < 1:
        raise ConfigError(f"one scorer actor asks for {amounts(need)} (pool.num_gpus, pool.num_cpus, pool.resources), "
                          f"but no node of the Ray cluster has that much ({nodes_have(nodes, need)})")
    if pool.num_actors and pool.num_actors > capacity:
        log.warning("pool.num_actors=%d, but the cluster's nodes hold only %d actors of %s: starting %d "
                    "(more as nodes join)", pool.num_actors, capacity, amounts(need), capacity)
    return min(pool.num_actors or capacity, capacity)


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
                amounts(self.need), self.capacity, "" if capacity else f": {nodes_have(self.nodes, self.need)}")
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

        asks = f"one actor asks for {amounts(self.need)} (pool.num_gpus, pool.num_cpus, pool.resources)"
        if not self.capacity:
            return f"{asks} and no alive node has that much ({nodes_have(self.nodes, self.need)})"
        free = ray.available_resources()
        return (f"{asks}; the alive nodes hold {self.capacity} such actor{'s' * (self.capacity != 1)}, but the "
                f"cluster has {', '.join(f'{k}={free.get(k, 0.0):g}' for k in self.need)} free (others hold the rest)")

    def status(self) -> str:
        """A few words for the progress bar: how many actors score, load the teacher, wait for a place."""
        counts = {state: sum(a.state == state for a in self.actors) for state in ("live", "loading", "placing")}
        if not self.actors:
            return f"waiting for resources ({amounts(self.need)} per actor)"
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
