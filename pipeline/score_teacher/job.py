"""Stage 1 as a Ray job: prepare, score the pending shards on a pool of actors, write the
manifest and the dataset card, summarise.

The driver does everything that can fail on bad configuration *before* Ray starts
(:mod:`pipeline.score_teacher.prepare`: resolve the corpus, plan the shards, load the teacher's
tokenizer and config, check the output folder). Then a pool of
:class:`pipeline.score_teacher.scorer_actor.ShardScorer` actors, each holding the teacher once
(``num_gpus`` per actor from the config), takes pending shards as they free up. An actor that dies,
or whose node is lost, is replaced where an alive node has room, and its shard is redone whole
(:mod:`pipeline.score_teacher.pool`). Each actor writes its shard and marker itself, so a shard is
complete on disk before the driver hears of it. The configuration is
:mod:`pipeline.score_teacher.config`'s.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.folders.dataset_card import card_is_current, write_card_or_warn
from pipeline.folders.folder_lock import exclusive_writer
from pipeline.folders.provenance import code_version
from pipeline.folders.rehearsal import NOTE as REHEARSAL_NOTE
from pipeline.folders.rehearsal import is_rehearsal
from pipeline.folders.shard_folder import ShardProgress
from pipeline.score_teacher.backends.server import api_key, share_in_flight
from pipeline.score_teacher.config import ScoreJobConfig
from pipeline.score_teacher.corpus import ShardSpec
from pipeline.score_teacher.faults import FAULTS_ENV
from pipeline.score_teacher.pool import PoolRun, ShardFailedError, num_actors, run_shards
from pipeline.score_teacher.prepare import Prepared, prepare, refuse_early
from pipeline.score_teacher.ray_cluster import actor_env, alive_nodes, check_nodes_see, init_ray
from pipeline.score_teacher.scorer_actor import ShardScorer
from pipeline.score_teacher.writer import finished_shards, prepare_output, remove_unreferenced, write_manifest
from storage_schemas import MANIFEST_NAME, SKIP_REASONS
from storage_schemas import filesystem as sfs
from storage_schemas import store_calls

log = logging.getLogger(__name__)


@dataclass
class JobSummary:
    output_dir: str
    shards_planned: int
    shards_done_before: int
    shards_scored: int
    shards_complete: int
    documents: int  # in the whole dataset
    tokens: int
    documents_this_run: int
    tokens_this_run: int
    seconds: float
    reasons: dict[str, int]
    complete: bool
    failed: list[dict] = field(default_factory=list)  # shards given up in this run (pool.on_bad_shard=skip)
    actors: list[dict] = field(default_factory=list)  # where the scorer actors ran (ShardScorer.describe)
    store_calls: dict = field(default_factory=dict)  # object-store requests and the client's retries, all processes
    rehearsal: bool = False  # scored by the rehearsal teacher (pipeline.folders.rehearsal): no model's losses

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_this_run / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# The driver


def run_score_job(cfg: ScoreJobConfig) -> JobSummary:
    t0 = time.perf_counter()
    store_calls.start(own=True)  # before any S3 request: this run's counts are its own
    prepared = prepare(cfg)
    refuse_early(cfg, prepared)
    created = _first_missing(cfg.output_dir)
    try:
        with exclusive_writer(cfg.output_dir):
            summary = _score(cfg, prepared, t0)
            remove_unreferenced(cfg.output_dir, finished_shards(cfg.output_dir))  # object stores: losing attempts
    except BaseException:
        _remove_empty_folders(cfg.output_dir, created)  # a failed start leaves no folder it made
        raise
    # the actors' object-store requests and the driver's, the lock's release included
    return replace(summary, store_calls=store_calls.add(summary.store_calls, store_calls.snapshot()))


def _first_missing(folder: str) -> Path | None:
    """The outermost folder of ``folder``'s path that does not exist yet (None: it exists, or is remote)."""
    if sfs.is_remote(folder):
        return None
    path, missing = Path(folder).absolute(), None
    while not path.exists():
        path, missing = path.parent, path
    return missing


def _remove_empty_folders(folder: str, created: Path | None) -> None:
    """Remove ``folder`` and its parents up to ``created`` (the outermost one this run made) where empty."""
    if created is None:
        return
    path = Path(folder).absolute()
    while path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        if path == created:
            break
        path = path.parent


def _score(cfg: ScoreJobConfig, prepared: Prepared, t0: float) -> JobSummary:
    version = code_version()
    done, extra, aside = prepare_output(cfg.output_dir, prepared.identity, cfg.overwrite, location=prepared.location,
                                        teacher_origin=prepared.origin,
                                        license=cfg.corpus.license,
                                        rehearsal=REHEARSAL_NOTE if is_rehearsal(prepared.identity) else None)
    done = kept_shards(done, cfg.rescore_shards)
    pending = [s for s in prepared.shards if s.index not in done]
    if cfg.limit_shards is not None:
        pending = pending[: cfg.limit_shards]
    done_before = len(done)
    run = PoolRun()
    if pending:
        try:
            run = _run_pool(cfg, prepared, pending, version, done, extra, on_first=aside.commit if aside else None)
        except ShardFailedError as exc:
            _record_progress(cfg.output_dir, prepared, version, extra, exc.failed, aside)
            raise
        except BaseException:
            _record_progress(cfg.output_dir, prepared, version, extra, [], aside)  # list what did finish, then fail
            raise
    done = finished_shards(cfg.output_dir)
    if aside is not None and not done:  # every shard failed (pool.on_bad_shard=skip): keep the old dataset
        aside.restore()
        raise ShardFailedError(f"{cfg.output_dir}: no shard could be scored; its previous dataset is put back",
                               run.failed)
    if aside is not None:
        aside.commit()
    manifest = write_manifest(cfg.output_dir, prepared.identity, done, len(prepared.shards), version,
                              failed=run.failed, **extra)
    if run.scored or not card_is_current(cfg.output_dir, manifest):  # README.md for people and the hub
        write_card_or_warn(cfg.output_dir, manifest)  # never fails the run
    totals = manifest["totals"]
    return JobSummary(
        output_dir=str(cfg.output_dir),
        shards_planned=len(prepared.shards),
        shards_done_before=done_before,
        shards_scored=len(run.scored),
        shards_complete=len(done),
        documents=totals["documents"],
        tokens=totals["tokens"],
        documents_this_run=sum(e["rows"] for e in run.scored),
        tokens_this_run=sum(e["tokens"] for e in run.scored),
        seconds=time.perf_counter() - t0,
        reasons=totals["reasons"],
        complete=manifest["complete"],
        failed=run.failed,
        actors=run.actors,
        store_calls=functools.reduce(store_calls.add, (e.get("store_calls", {}) for e in run.scored), {}),
        rehearsal=is_rehearsal(prepared.identity),
    )


def kept_shards(done: dict[int, dict], rescore: tuple[int, ...]) -> dict[int, dict]:
    """The finished shards a run keeps: all but those ``rescore_shards`` names (scored again; each
    keeps its files and marker until the new ones replace them, so a run stopped before loses none)."""
    return {i: e for i, e in done.items() if i not in set(rescore)}


def _record_progress(output_dir: str, prepared: Prepared, version: str, extra: dict, failed: list[dict],
                     aside=None) -> None:
    """After a failure: the manifest lists the shards that did finish. With none finished, what
    ``overwrite`` set aside comes back, and a manifest that lists nothing is removed (a failed
    start leaves nothing behind)."""
    try:
        done = finished_shards(output_dir)
        if aside is not None and aside.aside is not None:
            aside.restore()
        elif not done and not failed:
            if sfs.exists(sfs.child(output_dir, MANIFEST_NAME)):
                sfs.delete(sfs.child(output_dir, MANIFEST_NAME))
        else:
            write_manifest(output_dir, prepared.identity, done, len(prepared.shards), version, failed=failed, **extra)
    except OSError as exc:  # e.g. the disk is full: the markers still hold the truth
        log.warning("could not update %s/manifest.json after the failure: %s", output_dir, exc)


def _run_pool(cfg: ScoreJobConfig, prepared: Prepared, pending: list[ShardSpec], version: str, done: dict,
              extra: dict, on_first=None) -> PoolRun:
    """Score the pending shards on a pool of :class:`ShardScorer` actors (:mod:`pipeline.score_teacher.pool`):
    sized to the cluster's nodes, with the code shipped to them, after checking that every node sees
    the job's local paths; the manifest is rewritten from time to time as shards finish."""
    import ray  # lazy: seconds to import; a config error is refused first

    cfg, prepared, pending = _absolute_for_actors(cfg, prepared, pending)
    started_ray = init_ray(cfg.ray)
    try:
        if os.environ.get(FAULTS_ENV):
            log.warning("%s is set: faults are injected into this job on purpose", FAULTS_ENV)
        env = actor_env(cfg.ray)
        nodes = alive_nodes()
        if len(nodes) > 1 or cfg.ray.address:
            check_nodes_see(nodes, _local_inputs(cfg, prepared, pending), _local_output(cfg.output_dir), env)
        n_actors = min(len(pending), num_actors(cfg.pool, nodes))
        if prepared.scorer.backend == "server":  # at most scorer.max_in_flight requests in flight in all
            n_actors = min(n_actors, prepared.scorer.max_in_flight)
            cfg = replace(cfg, pool=replace(cfg.pool, num_actors=n_actors))
            prepared = replace(prepared, scorer=share_in_flight(prepared.scorer, n_actors))
        key = api_key(prepared.scorer)
        actor_cls = ray.remote(ShardScorer).options(  # the pool replaces dead actors, not Ray (ScorerPool)
            num_gpus=cfg.pool.num_gpus,
            num_cpus=cfg.pool.num_cpus,
            resources=dict(cfg.pool.resources) or None,
            max_restarts=0,
            max_task_retries=0,
            runtime_env=env,
        )
        bar = tqdm(total=len(pending), unit="shard", desc=f"starting {n_actors} actor{'s' * (n_actors > 1)}",
                   disable=not cfg.progress, dynamic_ncols=True)
        failed: list[dict] = []
        progress = ShardProgress(lambda: write_manifest(cfg.output_dir, prepared.identity, done, len(prepared.shards),
                                                        version, failed=failed, **extra), cfg.manifest_every_s)

        def shown(run: PoolRun) -> None:
            """Redraw the bar from the counts, after they take in the shard just finished."""
            failed[:] = run.failed
            bar.update(1)
            # written out, not tqdm's 3 significant digits: the last line's counts are the dataset's
            bar.set_postfix(docs=f"{progress.rows:,}", tokens=f"{progress.tokens:,}", failed=len(run.failed),
                            tok_s=f"{progress.tokens_per_s():.0f}")

        def scored(entry: dict, run: PoolRun) -> None:
            done[entry["index"]] = {k: v for k, v in entry.items() if k != "store_calls"}  # the run's, not the shard's
            if on_first is not None and len(run.scored) == 1:
                on_first()  # the first shard is finished: what overwrite set aside can go
            progress.scored(entry)
            shown(run)

        def given_up(failure: dict, run: PoolRun) -> None:
            shown(run)
            progress.due()

        for_actors = replace(prepared, shards=[])  # each actor gets its shards one at a time, not the whole plan
        try:
            return run_shards(lambda: actor_cls.remote(for_actors, cfg.teacher, cfg, version, key), pending, cfg.pool,
                              on_scored=scored, on_failed=given_up, on_status=bar.set_description_str)
        finally:
            bar.close()
    finally:
        if started_ray:
            ray.shutdown()


def _absolute_for_actors(cfg: ScoreJobConfig, prepared: Prepared, pending: list[ShardSpec]):
    """Local paths made absolute: the actors run in the shipped code's folder, not the driver's."""
    def absolute(path: str | None) -> str | None:
        return os.path.abspath(path) if path and not sfs.is_remote(path) and os.path.exists(path) else path

    output_dir = cfg.output_dir if sfs.is_remote(cfg.output_dir) else os.path.abspath(cfg.output_dir)
    teacher = replace(cfg.teacher, model=absolute(cfg.teacher.model), tokenizer=absolute(cfg.teacher.tokenizer))
    prepared = replace(prepared, scorer=replace(prepared.scorer, model=absolute(prepared.scorer.model)))
    return (replace(cfg, output_dir=output_dir, teacher=teacher), prepared,
            [replace(spec, path=absolute(spec.path)) for spec in pending])


def _local_inputs(cfg: ScoreJobConfig, prepared: Prepared, pending: list[ShardSpec]) -> list[str]:
    """The local paths the actors read: the teacher and tokenizer when they are folders or files
    here (a hub id is fetched by each node), and the corpus files of the pending shards."""
    teacher = [p for p in (cfg.teacher.model, cfg.teacher.tokenizer) if p and os.path.exists(p)]
    corpus = sorted({s.path for s in pending if not sfs.is_remote(s.path)})
    return [*teacher, *corpus]


def _local_output(output_dir: str) -> str | None:
    return None if sfs.is_remote(output_dir) else output_dir


def skipped_reasons(reasons: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in reasons.items() if k in SKIP_REASONS}
