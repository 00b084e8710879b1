"""Stage 1's preparation, before Ray starts: everything that can fail on bad input or a bad
folder is done on the driver first: resolve the corpus and plan its shards, load the teacher's
tokenizer and config, fit the window to the teacher's positions, check a served teacher or the
vLLM engine's settings, and compare the dataset's identity with the output folder's.

The identity (what the teacher, tokenizer, windows and corpus *are*: digests and hub ids,
:mod:`pipeline.folders.provenance`) is compared on every rerun; where they were found is written to the
manifest's ``location`` and never compared, so a moved or copied project resumes where it stopped.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.runtime.config import ConfigError, MissingPathError
from pipeline.folders.model_source import teacher_origin
from pipeline.folders.output_folder import has_aside, overlap_problem
from pipeline.folders.provenance import is_local_model, model_identity
from pipeline.folders.rehearsal import REHEARSAL_BACKEND
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.rehearsal import rehearsal_identity
from pipeline.score_teacher.backends.server import ServedTeacher, api_key, check_server
from pipeline.score_teacher.backends.vllm import check_installed, engine_args, engine_window
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig, local_path_problems
from pipeline.score_teacher.corpus import ShardSpec, SourceFile
from pipeline.score_teacher.corpus_sources import resolve_sources
from pipeline.score_teacher.shards import corpus_identity, plan_shards
from pipeline.score_teacher.teacher import WindowSettings
from pipeline.score_teacher.writer import DatasetMismatchError, refuse_mismatch
from pipeline.method.tokenization import bos_token_id, fingerprint, load_tokenizer
from storage_schemas import IDENTITY_FORMAT
from storage_schemas import filesystem as sfs


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
# The output folder, before anything is created in it


def refuse_early(cfg: ScoreJobConfig, prepared: Prepared) -> None:
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
