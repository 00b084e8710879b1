"""The bill before the run (``make score-teacher ARGS="... plan=true"``): what a stage-1 job will do
and what it will cost, without starting Ray or loading the teacher (its tokenizer only).

* **Shards and documents**: the job's own plan (:func:`pipeline.score_teacher.shards.plan_shards`,
  from the files' footers), and how many shards an existing output folder already holds.
* **Teacher tokens**: counted when the corpus's text is small (at most ``count_bytes``), else
  estimated from a sample of row groups spread evenly over the files: the sample's teacher tokens
  per byte of the text column (as the footers record it, uncompressed) times the corpus's bytes.
  The error is the ratio estimator's: 1.96 standard errors over the sampled row groups (the row
  groups' own spread, corrected for the share sampled), as a share of the estimate.
* **The run's checks first**: the job is prepared as the run prepares it
  (:func:`pipeline.score_teacher.prepare.prepare`: the window against the teacher's positions, the
  stride, a served teacher, the identity) and the output folder checked as the run checks it, so a
  job the run would refuse is refused here with the run's own error; ``shards_done`` counts what
  the run would keep (none when ``overwrite`` rescores a folder of another setup).
* **Bytes on disk**: the sampled documents written as the run writes them, in shards of
  ``data.rows_per_shard`` documents with the job's storage settings and identity, each with its
  marker (:func:`pipeline.score_teacher.writer.write_shard`; a small shard compresses worse), their
  losses from the rehearsal function (spread as a teacher's:
  :mod:`pipeline.score_teacher.backends.rehearsal`): their bytes per teacher token times the
  tokens. A real teacher's losses column takes another size than the
  rehearsal's: when the teacher was timed (below), the losses column's bytes are scaled by the
  ratio of its losses' bytes to the rehearsal's on the documents it scored (the sample's shorter
  ones: within ~4% of the whole figure for the tiny teacher on real text); otherwise the bill gives
  the range measured for real teachers (:data:`REAL_LOSSES_RANGE`).
* **Wall time**: with ``measure``, the actual teacher on the actual device times a few chunks of
  the sampled documents (:func:`measure_teacher`): its teacher tokens per second per actor. Else
  the tokens at ``tokens_per_s`` per actor (given by the user, or what ``make gpu-bench`` measured;
  the front end says which).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from pipeline.runtime.cpu_threads import threads_for, torch_threads, usable_cores
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.factory import make_scorer
from pipeline.score_teacher.backends.rehearsal import RehearsalScorer
from pipeline.score_teacher.backends.server import api_key
from pipeline.score_teacher.corpus import Document, ShardSpec, SourceFile, open_location
from pipeline.score_teacher.corpus_sources import resolve_sources
from pipeline.score_teacher.job import kept_shards
from pipeline.score_teacher.prepare import Prepared, prepare, refuse_early
from pipeline.score_teacher.ray_cluster import actors_per_node
from pipeline.score_teacher.shards import read_shard
from pipeline.score_teacher.teacher import ShardResult, WindowSettings, score_documents
from pipeline.score_teacher.writer import SCORED, finished_shards, write_shard
from pipeline.folders.shard_folder import folder_problem
from pipeline.method.tokenization import load_tokenizer
from pipeline.method.windows import plan_windows
from storage_schemas import filesystem as sfs

COUNT_BYTES = 64 * 2**20  # text up to this size is counted whole
SAMPLE_BYTES = 16 * 2**20  # else about this much text is tokenized
MEASURE_S = 5.0  # a measured teacher is timed at least this long
CHUNK_TOKENS = 1024  # teacher tokens per timed chunk (at most; never more than the window)
# A real teacher's losses column against the rehearsal's, bytes per token at the default storage
# settings, the same documents in one shard: the embedded tiny teacher 0.96x (542,219 tokens),
# SmolLM2-135M 1.10x (399,472 tokens), on the real-math corpus of make repro-real. The bill's range.
REAL_LOSSES_RANGE = (0.96, 1.10)


@dataclass
class ScorePlan:
    """What :func:`plan_score_job` found; ``tokens_error`` is a share of ``teacher_tokens`` (0 when counted)."""

    files: int
    shards: int
    shards_done: int
    documents: int
    text_bytes: int
    teacher_tokens: int
    counted: bool
    tokens_error: float
    sample_groups: int
    sample_documents: int
    bytes_per_token: float
    bytes_on_disk: int
    tokens_per_s: float | None
    gpu_hours: float | None  # actor-hours at tokens_per_s (GPU-hours when each actor holds one GPU)
    seconds: float
    notes: list[str] = field(default_factory=list)
    measured: dict | None = None  # the teacher's own measurement (measure_teacher), None: not measured
    losses_bytes_per_token: float = 0.0  # of the losses column (the rehearsal teacher's), in bytes_per_token

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TextGroup:
    """One unit of the sample: a Parquet row group (or a whole JSONL file) and its text bytes."""

    source: SourceFile
    first_row: int
    rows: int
    text_bytes: int


def text_groups(sources: list[SourceFile], text_column: str, limit_docs: int | None) -> list[TextGroup]:
    """Every row group of the planned rows with its text column's uncompressed bytes (footers only);
    a JSONL file is one group whose bytes are the file's."""
    groups: list[TextGroup] = []
    remaining = limit_docs if limit_docs is not None else math.inf
    for src in sources:
        if remaining <= 0:
            break
        if src.kind == "jsonl":
            rows = int(min(src.rows, remaining))
            groups.append(TextGroup(src, 0, rows, int(src.bytes * rows / max(src.rows, 1))))
            remaining -= rows
            continue
        fs, path = open_location(src.path)
        with fs.open_input_file(path) as f:
            meta = pq.ParquetFile(f).metadata
        column = meta.schema.to_arrow_schema().get_field_index(text_column)
        row = 0
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            rows = int(min(group.num_rows, remaining))
            if rows <= 0:
                break
            size = group.column(column).total_uncompressed_size * rows / max(group.num_rows, 1)
            groups.append(TextGroup(src, row, rows, int(size)))
            row += group.num_rows
            remaining -= rows
    return groups


def sample_groups(groups: list[TextGroup], budget_bytes: int) -> list[int]:
    """Indices of groups spread evenly over the corpus, about ``budget_bytes`` of text in all
    (every group when the corpus is no larger)."""
    total = sum(g.text_bytes for g in groups)
    if total <= budget_bytes:
        return list(range(len(groups)))
    k = max(2, min(len(groups), math.ceil(len(groups) * budget_bytes / total)))
    return sorted(set(np.round(np.linspace(0, len(groups) - 1, k)).astype(int).tolist()))


def ratio_estimate(tokens: np.ndarray, sizes: np.ndarray, total_size: float, population: int) -> tuple[float, float]:
    """Total tokens and its relative 95% error from sampled groups' ``tokens`` and ``sizes`` (the
    ratio estimator, with the finite-population correction for ``population`` groups)."""
    n = tokens.size
    ratio = tokens.sum() / sizes.sum()
    estimate = ratio * total_size
    if n < 2 or n >= population:
        return float(estimate), 0.0
    residuals = tokens - ratio * sizes
    variance = (1 - n / population) * residuals.var(ddof=1) / n / sizes.mean() ** 2
    return float(estimate), float(1.96 * math.sqrt(variance) / ratio)


def _group_documents(group: TextGroup, index: int, text_column: str) -> list[Document]:
    spec = ShardSpec(index, group.source.path, group.source.kind, group.source.label, group.first_row,
                     group.first_row + group.rows, group.source.row_offset)
    return read_shard(spec, text_column)


def plan_score_job(cfg, tokens_per_s: float | None = None, count_bytes: int = COUNT_BYTES,
                   sample_bytes: int = SAMPLE_BYTES, measure: bool = False, measure_s: float = MEASURE_S) -> ScorePlan:
    """The bill of the job ``cfg`` (a :class:`pipeline.score_teacher.config.ScoreJobConfig`; module docstring).
    Raises what the run would raise before its first shard (a window past the teacher's positions,
    a folder scored with another setup...). With ``measure`` the teacher is loaded and timed, and
    its rate replaces ``tokens_per_s`` unless that was given."""
    t0 = time.perf_counter()
    prepared = prepare(cfg)  # the run's own checks, in the run's order
    refuse_early(cfg, prepared)
    sources = resolve_sources(cfg.corpus)
    shards = prepared.shards
    done = _kept_shards(cfg, prepared)
    tokenizer = load_tokenizer(cfg.teacher.tokenizer or cfg.teacher.model, revision=cfg.teacher.revision,
                               trust_remote_code=cfg.teacher.trust_remote_code)
    groups = text_groups(sources, cfg.corpus.text_column, cfg.corpus.limit_docs)
    total_bytes = sum(g.text_bytes for g in groups)
    counted = total_bytes <= count_bytes
    picked = sample_groups(groups, total_bytes if counted else sample_bytes)
    settings = prepared.settings  # the run's window and stride (the count does not depend on them)
    scorer = RehearsalScorer(ScorerConfig(backend="rehearsal", window=settings.window))
    tokens, sizes, documents, raw = [], [], [], []
    for i in picked:
        read = _group_documents(groups[i], i, cfg.corpus.text_column)
        result = score_documents(read, tokenizer, scorer, settings)
        tokens.append(sum(len(d.ids) for d in result.documents))
        sizes.append(groups[i].text_bytes)
        documents += result.documents
        raw += read
    teacher_tokens, error = (sum(tokens), 0.0) if counted else ratio_estimate(
        np.asarray(tokens, float), np.asarray(sizes, float), total_bytes, len(groups))
    per_token, losses_per_token = _disk_model(documents, cfg, prepared.identity)
    measured = measure_teacher(cfg, prepared, tokenizer, raw, documents, measure_s) if measure else None
    if measured and measured["documents"]:  # the teacher's losses against the rehearsal's, same documents
        rehearsed = score_documents(measured["raw"], tokenizer, scorer, settings).documents
        rehearsal_losses = _bytes_per_token(rehearsed, cfg, prepared.identity)[1]
        if rehearsal_losses > 0:  # the losses column scaled by the teacher's own bytes against the rehearsal's
            measured["losses_ratio"] = _bytes_per_token(measured["documents"], cfg, prepared.identity)[1] / rehearsal_losses
            per_token += losses_per_token * (measured["losses_ratio"] - 1)
    if measured:
        measured = {k: v for k, v in measured.items() if k not in ("documents", "raw")}
        tokens_per_s = tokens_per_s or measured["tokens_per_s"] or None
    gpu_hours = teacher_tokens / tokens_per_s / 3600 if tokens_per_s else None
    notes = [] if counted else [f"teacher tokens estimated from {len(picked)} of {len(groups)} row groups "
                                f"({sum(sizes) / 2**20:,.1f} MiB of text)"]
    return ScorePlan(files=len(sources), shards=len(shards), shards_done=len(done),
                     documents=sum(s.stop - s.start for s in shards), text_bytes=total_bytes,
                     teacher_tokens=int(round(teacher_tokens)), counted=counted, tokens_error=error,
                     sample_groups=len(picked), sample_documents=len(documents),
                     bytes_per_token=per_token, bytes_on_disk=int(per_token * teacher_tokens), tokens_per_s=tokens_per_s,
                     gpu_hours=gpu_hours,
                     seconds=time.perf_counter() - t0, notes=notes, measured=measured,
                     losses_bytes_per_token=losses_per_token)


def _kept_shards(cfg, prepared: Prepared) -> dict:
    """The finished shards the run would keep: none in a folder that ``overwrite`` rescores."""
    if not sfs.is_dir(cfg.output_dir):
        return {}
    if cfg.overwrite and folder_problem(cfg.output_dir, prepared.identity, SCORED):
        return {}
    return kept_shards(finished_shards(cfg.output_dir), cfg.rescore_shards)


def forwarded_tokens(documents: list, settings: WindowSettings) -> int:
    """Positions the teacher forwards for ``documents`` (scored ones): every window of each
    document's ``[BOS] + ids`` as the run plans them, overlaps included."""
    bos = int(settings.bos_id is not None)
    return sum(w.stop - w.start for d in documents
               for w in plan_windows(len(d.ids) + bos, settings.window, settings.stride))


def measure_teacher(cfg, prepared: Prepared, tokenizer, raw: list[Document], scored: list,
                    measure_s: float = MEASURE_S, actors: int | None = None) -> dict:
    """The actual teacher's speed here, timed as the run's actors will run: ``actors`` of them (unset:
    this machine's local actors of a CPU job, :func:`concurrent_actors`) at once, each in a process of
    its own with its torch threads, all loaded before any is timed. Each builds the scorer the run's
    actors build and scores chunks of the sampled documents ``raw`` (``scored``: the same, scored by
    the rehearsal, for their token counts), each of documents no longer than :data:`CHUNK_TOKENS` (and
    the window) adding up to about that many, until ``measure_s`` seconds have passed; on a GPU one
    untimed chunk first. The actors' speeds add up; in forwarded positions per second, turned into
    stored teacher tokens per second by the whole sample's stored/forwarded ratio, so long documents'
    overlapping windows cost what they cost in the run. The machine's load average while they ran
    (its other work included) is recorded with it: the rate holds for a machine about that busy."""
    settings = prepared.settings
    n = actors or concurrent_actors(cfg)
    threads = threads_for(cfg.pool.num_cpus)
    key = api_key(cfg.scorer) if cfg.scorer.backend == "server" else None  # read as the run's driver reads it
    sizes = {d.doc_id: len(d.ids) for d in scored}
    jobs = [dict(scorer=prepared.scorer, key=key, threads=threads, tokenizer=tokenizer, settings=settings,
                 raw=raw, sizes=sizes, gpu_budget=cfg.scorer.max_batch_tokens, measure_s=measure_s, turn=i, of=n,
                 keep=i == 0) for i in range(n)]
    load_before = os.getloadavg()[0]
    timed = [_timed_actor(jobs[0])] if n == 1 else _together(jobs)
    first = timed[0]
    rate = sum(t["forwarded"] / max(t["seconds"], 1e-9) for t in timed) / n  # positions/s of one actor, all running
    stored_per_forwarded = sum(len(d.ids) for d in scored) / max(forwarded_tokens(scored, settings), 1)
    return {"tokens_per_s": rate * stored_per_forwarded, "forwarded": sum(t["forwarded"] for t in timed),
            "stored_per_forwarded": stored_per_forwarded, "seconds": max(t["seconds"] for t in timed),
            "load_s": max(t["load_s"] for t in timed), "actors": n, "cpus": usable_cores(),
            "load_average": max(load_before, os.getloadavg()[0]),
            "n_documents": len(first["raw"]), "device": first["device"], "dtype": first["dtype"] or cfg.scorer.dtype,
            "backend": cfg.scorer.backend, "threads": threads, "documents": first["documents"], "raw": first["raw"]}


def concurrent_actors(cfg) -> int:
    """How many actors the run starts at once on this machine's CPUs: the local cluster's actors of
    a CPU job; 1 for a GPU job (each actor has a GPU of its own) or one that joins a cluster."""
    if cfg.pool.num_gpus > 0 or cfg.ray.address is not None:
        return 1
    return max(1, min(local_actors(cfg) or 1, cfg.pool.num_actors or 1 << 30))


def _together(jobs: list[dict]) -> list[dict]:
    """:func:`_timed_actor` of every job at once, each in a process of its own (as Ray's actors are),
    started together once all have loaded the teacher; their results in the jobs' order."""
    context = multiprocessing.get_context("spawn")  # torch in a forked process is not safe
    ready, results = context.Barrier(len(jobs)), context.Queue()
    workers = [context.Process(target=_timed_actor_process, args=(job, ready, results), daemon=True) for job in jobs]
    for worker in workers:
        worker.start()
    try:
        found = dict(results.get(timeout=MEASURE_TIMEOUT_S) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    failed = [v for v in found.values() if isinstance(v, str)]
    if failed:
        raise RuntimeError(f"timing the teacher failed in an actor's process: {failed[0]}")
    return [found[i] for i in range(len(jobs))]


MEASURE_TIMEOUT_S = 1800.0  # the longest the timed actors' processes may take in all (loading included)


def _timed_actor_process(job: dict, ready, results) -> None:
    try:
        results.put((job["turn"], _timed_actor(job, ready)))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it; a broken barrier frees the others
        ready.abort()
        results.put((job["turn"], f"{type(exc).__name__}: {exc}"))


def _timed_actor(job: dict, ready=None) -> dict:
    """One actor's part of :func:`measure_teacher`: load the scorer, wait for the others (``ready``),
    then score chunks (its own turn of them first) until ``measure_s`` seconds have passed."""
    settings, tokenizer = job["settings"], job["tokenizer"]
    with torch_threads(job["threads"]):
        l0 = time.perf_counter()
        scorer = make_scorer(job["scorer"], job["key"])
        load_s = time.perf_counter() - l0
        described = scorer.describe()
        device = described.get("device") or "the device"
        chunks = _chunks(job["raw"], job["sizes"], CHUNK_TOKENS if device == "cpu" else job["gpu_budget"])
        at = job["turn"] * len(chunks) // job["of"]
        chunks = chunks[at:] + chunks[:at]
        if device != "cpu" and len(chunks) > 1:
            score_documents(chunks.pop(0), tokenizer, scorer, settings)  # warm-up: not timed
        if ready is not None:
            ready.wait()
        timed, done, used = 0.0, [], []
        for chunk in chunks:
            t0 = time.perf_counter()
            result = score_documents(chunk, tokenizer, scorer, settings)
            timed += time.perf_counter() - t0
            done += result.documents
            used += chunk
            if timed >= job["measure_s"]:
                break
    return {"forwarded": forwarded_tokens(done, settings), "seconds": timed, "load_s": load_s, "device": device,
            "dtype": described.get("dtype"), "documents": done if job["keep"] else [],
            "raw": used if job["keep"] else []}


def _chunks(raw: list[Document], sizes: dict[str, int], budget: int) -> list[list[Document]]:
    """``raw`` in chunks of documents of at most ``budget`` teacher tokens in all (``sizes``: each
    document's, by id), each no longer than ``budget`` (the shortest alone when none is that short)."""
    fits = [d for d in raw if 0 < sizes.get(d.doc_id, 0) <= budget]
    if not fits:
        nonempty = [d for d in raw if sizes.get(d.doc_id, 0) > 0]
        return [[min(nonempty, key=lambda d: sizes[d.doc_id])]] if nonempty else []
    chunks, chunk, size = [], [], 0
    for doc in fits:
        if size + sizes[doc.doc_id] > budget and chunk:
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append(doc)
        size += sizes[doc.doc_id]
    return chunks + ([chunk] if chunk else [])


def teacher_parameters(teacher) -> int | None:
    """About how many parameters the teacher has, from its config alone (None: it does not say):
    embeddings plus 4 h^2 of attention and 3 h x intermediate of MLP per layer."""
    from transformers import AutoConfig  # lazy: seconds to import; a config error is refused first
    try:
        c = AutoConfig.from_pretrained(teacher.model, revision=teacher.revision, trust_remote_code=teacher.trust_remote_code)
    except Exception:  # noqa: BLE001 - the run's own check has passed; a config it cannot read is just not sized
        return None
    c = getattr(c, "text_config", None) or c
    h, layers = getattr(c, "hidden_size", None), getattr(c, "num_hidden_layers", None)
    if not h or not layers:
        return None
    mlp = getattr(c, "intermediate_size", None) or 4 * h
    return int(layers * (4 * h * h + 3 * h * mlp) + (getattr(c, "vocab_size", 0) or 0) * h)


def _disk_model(documents: list, cfg, identity: dict) -> tuple[float, float]:
    """Bytes per teacher token (in all, and of the losses column) of ``documents`` written as the
    run writes them: shards of ``data.rows_per_shard`` documents with the job's storage settings and
    identity, each with its marker (a shard's size changes how well it compresses)."""
    rows = max(1, cfg.corpus.rows_per_shard)
    parts = [documents[i:i + rows] for i in range(0, len(documents), rows)]
    tokens = sum(len(d.ids) for d in documents)
    if not tokens:
        return 0.0, 0.0
    sums = np.zeros(2)
    for part in parts:
        sums += np.asarray(_bytes_per_token(part, cfg, identity)) * sum(len(d.ids) for d in part)
    return float(sums[0] / tokens), float(sums[1] / tokens)


def _bytes_per_token(documents: list, cfg, identity: dict) -> tuple[float, float]:
    """Bytes per teacher token of ``documents`` written as one shard with the job's storage settings
    and ``identity`` (the footer holds it): in all (marker included), and of the losses column alone."""
    tokens = sum(len(d.ids) for d in documents)
    if not tokens:
        return 0.0, 0.0
    with tempfile.TemporaryDirectory(prefix="plan-") as scratch:
        entry = write_shard(scratch, 0, ShardResult(documents=documents), identity, {}, "plan", storage=cfg.storage)
        meta = pq.ParquetFile(os.path.join(scratch, "shard-000000.parquet")).metadata
        losses = sum(meta.row_group(g).column(c).total_compressed_size for g in range(meta.num_row_groups)
                     for c in range(meta.num_columns) if meta.schema.column(c).path.startswith("losses"))
        return (entry["bytes"] + os.path.getsize(os.path.join(scratch, "shard-000000.done.json"))) / tokens, losses / tokens


MEASURE_MAX_PARAMETERS = 1_000_000_000  # plan_measure unset: a teacher up to this size is loaded and timed


def measure_decision(cfg) -> tuple[bool, str]:
    """Whether the bill times the actual teacher here, and why (``plan_measure``; unset: a
    transformers teacher of at most :data:`MEASURE_MAX_PARAMETERS` parameters, which loads in
    seconds on a CPU; a 7B teacher is never loaded just to plan unless asked)."""
    if cfg.plan_measure is not None:
        return bool(cfg.plan_measure), f"plan_measure={str(bool(cfg.plan_measure)).lower()}"
    if cfg.scorer.backend != "transformers":
        return False, f"scorer.backend={cfg.scorer.backend} is not loaded to plan"
    params = teacher_parameters(cfg.teacher)
    if params is None:
        return False, "its config gives no size"
    if params > MEASURE_MAX_PARAMETERS:
        return False, f"a teacher of about {params / 1e9:,.1f}B parameters is not loaded to plan"
    return True, f"a teacher of about {params:,.2g} parameters, measured unless plan_measure=false"


def local_actors(cfg) -> int | None:
    """The actors the run starts on this machine's local Ray cluster (None: it joins a cluster)."""
    import torch  # lazy: seconds to import; a config error is refused first
    if cfg.ray.address is not None:
        return None
    have = {"CPU": float(cfg.ray.num_cpus or os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}
    fits = actors_per_node(have, cfg.pool.per_actor())
    return min(cfg.pool.num_actors or fits, fits) or None


def size(n: float) -> str:
    """``n`` bytes in MiB below a GiB, else GiB."""
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"
