"""Stage 1 entry point: ``python -m stages.score_teacher [hydra overrides]`` (``make score-teacher``).

Reads as a list of steps: compose and check the config (every problem at once, files included),
build the embedded default if it is the one chosen, check that the teacher can be had, run the Ray
job (:mod:`pipeline.score_teacher.job`), print the summary. The defaults are the typed configs';
``conf/score_teacher.yaml`` only overrides them.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.utils import to_absolute_path
from omegaconf import DictConfig
from rich.console import Console

from pipeline.embedded import ensure_sample_corpus, ensure_tiny_teacher, sample_corpus_dir, tiny_teacher_dir
from pipeline.embedded.tiny_teacher import TinyTeacherSpec
from pipeline.folders.model_source import check_teacher_source, check_tokenizer_source, resolve_gguf_teacher
from pipeline.folders.output_folder import check_writable
from pipeline.folders.rehearsal import NOTE as REHEARSAL_NOTE
from pipeline.folders.rehearsal import REHEARSAL_BACKEND
from pipeline.score_teacher.job import JobSummary, run_score_job
from pipeline.score_teacher.config import ScoreJobConfig, config_defaults, score_job_config
from pipeline.score_teacher.plan import (
    REAL_LOSSES_RANGE,
    ScorePlan,
    local_actors,
    measure_decision,
    plan_score_job,
    size,
)
from stages.common import (
    ConfigError,
    duration,
    entry_point,
    named_teacher,
    make_command,
    override,
    plain,
    python_command,
    quiet_libraries,
    same_path,
    show_summary,
    store_row,
    with_problems,
)
from storage_schemas import SKIP_REASONS, ZERO_TOKEN_REASONS
from storage_schemas.filesystem import join

log = logging.getLogger("score_teacher")


def job_config(cfg: DictConfig) -> ScoreJobConfig:
    """The typed job; every problem in the config is reported at once (:func:`score_job_config`)."""
    cfg = named_teacher(cfg)
    return with_problems(embedded_problems(cfg), lambda: score_job_config(plain(cfg)))


SAMPLE_NAME = "owm-sample"  # the embedded sample's data.name (conf/data/sample.yaml)
def embedded_problems(cfg: DictConfig) -> list[str]:
    """Your own corpus files or teacher given while the embedded sample or tiny teacher is chosen:
    the corpus would be labelled (and its folder named) as the sample, the teacher ignored."""
    found = []
    d, t = cfg.get("data") or {}, cfg.get("teacher") or {}
    if d.get("embedded") and d.get("build"):
        files = [str(f) for f in d.get("files") or []]
        sample = sample_corpus_dir(cfg.artifacts_dir, d.build.n_docs, d.build.seed)
        if not (len(files) == 1 and os.path.basename(files[0]) == "*.parquet"
                and same_path(os.path.dirname(files[0]), sample)):
            if d.get("name") != SAMPLE_NAME:  # a name of your own given: only the word that it is no sample lacks
                found.append(f"data.files: your own corpus {d.get('name')!r} still has the embedded sample's settings "
                             "(data=sample, the default): add data.embedded=false to score it as your own")
            else:
                found.append(f"data.files: your own corpus, while data.name is {d.get('name')!r}, the embedded "
                             "sample's: give it a name of its own and say it is no sample, data.name=<a name for "
                             "your corpus> data.embedded=false (its folder is then named after it)")
    if t.get("embedded") and t.get("build"):
        built = tiny_teacher_dir(cfg.artifacts_dir, t.build.corpus_docs, t.build.seed)
        if t.get("model") and not same_path(t.model, built):
            found.append(f"teacher.model: {t.model} is not the embedded tiny teacher (built at {built}); to score "
                         "with that model, add teacher.embedded=false and teacher.name=<its name>, or pick a preset "
                         "(teacher=deepseekmath-7b ...)")
    return found


def output_folders(cfg: DictConfig, job: ScoreJobConfig) -> dict[str, str]:
    """The folders the run writes: the scored dataset's, and ``artifacts_dir`` where it does not
    exist yet (the embedded default and a GGUF teacher's converted copy are built there; a cache
    that exists may be read-only)."""
    artifacts = to_absolute_path(cfg.artifacts_dir)
    return {"output_dir": job.output_dir, **({} if os.path.isdir(artifacts) else {"artifacts_dir": artifacts})}


def build_embedded(cfg: DictConfig) -> None:
    """Build (or find cached) the sample corpus and tiny teacher when the config uses them."""

    artifacts = to_absolute_path(cfg.artifacts_dir)
    if cfg.data.get("embedded"):
        b = cfg.data.build
        ensure_sample_corpus(artifacts, n_docs=b.n_docs, seed=b.seed, n_files=b.n_files)
    if cfg.teacher.get("embedded"):
        b = cfg.teacher.build
        spec = TinyTeacherSpec(vocab_size=b.vocab_size, steps=b.steps, seed=b.seed)
        built = ensure_tiny_teacher(artifacts, corpus_docs=b.corpus_docs, seed=b.seed, spec=spec)
        if Path(built).resolve() != Path(to_absolute_path(cfg.teacher.model)).resolve():
            raise ConfigError(f"teacher.model {cfg.teacher.model} is not where the tiny teacher is built ({built})")


def print_summary(s: JobSummary, console: Console | None = None) -> None:
    status = "complete" if s.complete else f"partial: {s.shards_complete}/{s.shards_planned} shards"
    rows = [("REHEARSAL", REHEARSAL_NOTE)] if s.rehearsal else []
    rows += [
        ("dataset", status),
        ("shards", f"{s.shards_scored} scored now, {s.shards_done_before} already done, {s.shards_planned} planned"),
        ("actors", ", ".join(f"{a['hostname']} ({a['node_ip']})" for a in s.actors) or "none this run"),
        ("documents", f"{s.documents:,} stored ({s.documents_this_run:,} this run)"),
        ("teacher tokens", f"{s.tokens:,} ({s.tokens_this_run:,} this run)"),
        ("throughput", f"{s.tokens_per_s:,.0f} tokens/s over {s.seconds:.1f}s (this run, set-up included)"),
    ]
    for title, group in (("skipped", SKIP_REASONS), ("zero tokens", ZERO_TOKEN_REASONS)):
        counts = {k: v for k, v in s.reasons.items() if k in group}
        rows.append((f"{title} (by reason)", ", ".join(f"{k}: {v}" for k, v in counts.items()) or "none"))
    notes = {k: v for k, v in s.reasons.items() if k not in SKIP_REASONS + ZERO_TOKEN_REASONS}
    if notes:
        rows.append(("scored, noted", ", ".join(f"{k}: {v}" for k, v in notes.items())))
    rows += store_row(s.store_calls)
    if s.failed:
        rows.append(("failed, skipped", "; ".join(f"shard {f['index']} after {f['attempts']} tries: {f['error']}"
                                                  for f in s.failed) + " (rerun the same command to score them)"))
    glob = join(s.output_dir, "shard-*.parquet")  # a local path or an s3:// / gs:// URI
    code = (
        "import polars as pl; print(pl.scan_parquet(" + json.dumps(glob) + ")"
        ".select(\"doc_id\", pl.col(\"token_ids\").list.len().alias(\"tokens\"), "
        "pl.col(\"losses\").list.eval(pl.element().fill_nan(None)).list.mean().alias(\"mean_loss\"))"
        ".sort(\"mean_loss\", nulls_last=True).collect())"
    )
    show_summary("score-teacher", rows, [
        ("the scored dataset", str(s.output_dir)),
        ("look at it with Polars (per-document token count and mean teacher loss)",
         f"{python_command()} -c {shlex.quote(code)}"),
        ("or in the terminal", make_command("inspect", override("path", s.output_dir))),
    ], console)


# Teacher tokens/s of one GPU when neither plan_tokens_per_s nor make gpu-bench gives one: a 7B
# forward at 70% MFU on an H100 (989 dense bf16 TFLOPS; ~17 GFLOPs per token at windows of 4096).
REFERENCE_TOKENS_PER_S = 39_000.0
GPU_BENCH_RESULT = Path("bench-results/gpu-latest.json")


def bill_rate(job: ScoreJobConfig) -> tuple[float, str]:
    """The teacher tokens/s per GPU the bill uses, and where it comes from."""
    if job.plan_tokens_per_s:
        return job.plan_tokens_per_s, "plan_tokens_per_s"
    if GPU_BENCH_RESULT.is_file():
        result = json.loads(GPU_BENCH_RESULT.read_text())
        # the scorer at the paper teachers' window of 4096 (benchmarks/gpu.py's figure keys)
        value = next((f.get("value") for f in result.get("figures", [])
                      if f.get("key") == "scorer_tokens_per_s_teacher_w4096"), None)
        if value:
            device = (result.get("machine") or {}).get("device") or "a GPU"
            return float(value), (f"measured by make gpu-bench on {device} (the scorer at the Qwen2.5-7B shape, "
                                  f"window 4096, bf16; {GPU_BENCH_RESULT})")
    return REFERENCE_TOKENS_PER_S, "a 7B forward at 70% MFU on an H100; plan_tokens_per_s=<yours> to change it"


def print_plan(p: ScorePlan, job: ScoreJobConfig, rate_source: str | None, console: Console | None = None) -> None:
    """The bill; ``rate_source``: where ``p.tokens_per_s`` comes from (None: there is no rate)."""
    tokens = (f"{p.teacher_tokens:,} (counted)" if p.counted else
              f"about {p.teacher_tokens:,} ± {p.tokens_error:.1%} (95%; {'; '.join(p.notes)})")
    s = job.storage
    rows = [("REHEARSAL", REHEARSAL_NOTE)] if job.scorer.backend == REHEARSAL_BACKEND else []
    done = f"{p.shards_done:,} already done" + (" (kept)" if p.shards_done else "")
    rows += [
        ("corpus", f"{p.files:,} file(s), {p.documents:,} documents, {p.text_bytes / 2**30:,.2f} GiB of text"),
        ("shards", f"{p.shards:,} of up to {job.corpus.rows_per_shard:,} documents; {done}"),
        ("teacher tokens", tokens),
        ("on disk", f"about {size(p.bytes_on_disk)}: {p.bytes_per_token:.2f} bytes per teacher token "
                    f"({s.encodings} encodings, {s.loss_precision} losses, {s.compression}), measured on "
                    f"{p.sample_documents:,} documents; {2 * p.shards + 2:,} files; " + losses_basis(p)),
        *hours_rows(p, job, rate_source),
    ]
    show_summary("score-teacher: the bill before the run (nothing was scored)", rows, [
        ("the output folder", str(job.output_dir)),
        ("run it", "the same command without plan=true"),
    ], console)


def losses_basis(p: ScorePlan) -> str:
    """Whose losses priced the bytes, and the estimate's error when they were the rehearsal teacher's."""
    if p.measured and p.measured.get("losses_ratio"):
        return (f"written in shards of data.rows_per_shard documents; the losses column priced with this teacher's "
                f"own losses on the {p.measured['n_documents']:,} documents timed ({p.measured['losses_ratio']:.2f}x "
                "the rehearsal teacher's bytes)")
    low, high = (p.bytes_on_disk + p.losses_bytes_per_token * (r - 1) * p.teacher_tokens for r in REAL_LOSSES_RANGE)
    return (f"written in shards of data.rows_per_shard documents; the losses priced with the rehearsal teacher's: "
            f"real teachers' losses took {REAL_LOSSES_RANGE[0]:.2f}-{REAL_LOSSES_RANGE[1]:.2f}x their bytes (measured), "
            f"so {size(low)} to {size(high)}; a far weaker teacher's compress better (plan_measure=true prices this one's)")


def hours_rows(p: ScorePlan, job: ScoreJobConfig, rate_source: str | None) -> list[tuple[str, str]]:
    """Actor-hours (GPU-hours when each actor holds a GPU) and the wall time, or why there are none."""
    if not p.tokens_per_s:
        return [("wall time", f"no rate: {rate_source}; plan_measure=true times this teacher here, "
                              "plan_tokens_per_s=<teacher tokens/s of one actor> prices it")]
    gpu = gpu_priced(job)
    unit, per = ("GPU-hours", "GPU") if gpu else ("actor-hours", f"actor ({job.pool.num_cpus:g} CPU)")
    seconds = p.teacher_tokens / p.tokens_per_s
    # a rehearsal priced at a GPU's rate stands for the real teacher's GPUs, not this machine's actors
    actors = None if job.scorer.backend == REHEARSAL_BACKEND and not p.measured else local_actors(job)
    wall = (f"about {duration(seconds / actors)} with the {actors} actor(s) of this machine's local Ray cluster"
            if actors else f"about {duration(seconds / 8)} on 8 {'GPUs' if gpu else 'actors'}")
    start = (f"Ray's start and each actor's load of the teacher ({duration(p.measured['load_s'])} here) not included"
             if p.measured and "load_s" in p.measured else "Ray's start and the teacher's load not included")
    return [(f"{'GPU' if gpu else 'actor'} time", f"{duration(seconds)} ({seconds / 3600:,.2f} {unit}) at "
                                                  f"{p.tokens_per_s:,.0f} teacher tokens/s per {per} ({rate_source})"),
            ("wall time", f"{wall} (scoring only: {start})")]


def plan_rate(job: ScoreJobConfig, measure: bool) -> float | None:
    """The rate the bill is given before any measurement: plan_tokens_per_s; a GPU job the teacher
    is not measured for, :func:`bill_rate`'s; else none (the measurement's, or no rate)."""
    if job.plan_tokens_per_s or measure or not gpu_priced(job):
        return job.plan_tokens_per_s
    return bill_rate(job)[0]


def gpu_priced(job: ScoreJobConfig) -> bool:
    """Priced in GPU-hours: each actor holds a GPU, or a rehearsal stands in for a GPU teacher."""
    return job.pool.num_gpus > 0 or job.scorer.backend == REHEARSAL_BACKEND


def rate_source(p: ScorePlan, job: ScoreJobConfig, why: str) -> str:
    if job.plan_tokens_per_s:
        return "plan_tokens_per_s"
    m = p.measured
    if m:
        together = (f"{m['actors']} actors running together, as the run runs them" if m.get("actors", 1) > 1
                    else "one actor")
        load = (f"; the machine's load average was {m['load_average']:.1f} on {m['cpus']} CPU(s) meanwhile (its other "
                "work included): the rate holds for a machine about that busy" if "load_average" in m else "")
        return (f"measured here: {together}, {m['forwarded']:,} positions in {m['seconds']:.1f} s on {m['device']} "
                f"({m['backend']}, {m['dtype']}, {m['threads']} torch thread(s) each), times the sample's "
                f"{m['stored_per_forwarded']:.3f} stored tokens per position{load}; {why}")
    if p.tokens_per_s:
        return f"{bill_rate(job)[1]}; this teacher not measured: {why}"
    return f"this CPU job's teacher not measured ({why})"


@entry_point("score_teacher", config_defaults(), check=job_config)
def main(cfg: DictConfig) -> None:
    quiet_libraries()
    job = job_config(cfg)
    cfg = named_teacher(cfg, say=True)  # as job_config named it
    check_writable(output_folders(cfg, job))  # one line before anything is built, loaded or started
    build_embedded(cfg)
    if job.scorer.backend != REHEARSAL_BACKEND:  # a GGUF teacher: its converted folder (pipeline.folders.model_source)
        job = replace(job, teacher=resolve_gguf_teacher(job.teacher, to_absolute_path(cfg.artifacts_dir)))
    if job.scorer.backend == REHEARSAL_BACKEND:  # no model: only its tokenizer is loaded
        check_tokenizer_source("teacher.model", job.teacher.tokenizer or job.teacher.model, job.teacher.revision)
    else:
        check_teacher_source(job.teacher)  # one clear line, before Ray, if the teacher cannot be had
    if job.plan:  # the bill only, after the run's own checks: no Ray; the teacher only when measured
        measure, why = measure_decision(job)
        p = plan_score_job(job, tokens_per_s=plan_rate(job, measure), measure=measure)
        print_plan(p, job, rate_source(p, job, why))
        return
    summary = run_score_job(job)
    print_summary(summary)
    (Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir) / "summary.json").write_text(
        json.dumps({**summary.__dict__, "tokens_per_s": summary.tokens_per_s}, indent=1)
    )


if __name__ == "__main__":
    sys.exit(main())
