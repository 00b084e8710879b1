"""One fraction of the rehearsal, step by step, each step a child process measured from here
(:mod:`rehearsal.measure`): the corpus, stage 1 with the rehearsal teacher (``make score-teacher``),
its rerun, stage 2's first token count, a training run on the real data loader (``make
train-student``), ``make export-student``, ``make inspect``'s summary and validation; for one
fraction also the S3 API (moto's server) and SIGKILLs at random moments of stage 1 and the export.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from rehearsal.config import RehearseConfig
from rehearsal.measure import StepResult, run_step

log = logging.getLogger("rehearse")
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Context:
    cfg: RehearseConfig
    work: Path
    teacher_tokenizer: Path  # a tokenizer folder (loads in a second; the .gguf takes tens)
    student: Path  # a random-weight micro Llama with the student's tokenizer
    env: dict

    def module(self, name: str, *args: str) -> list[str]:
        return [sys.executable, "-m", name, *args]


def tag_of(fraction: float) -> str:
    return f"{fraction * 100:g}pct"


def step(ctx: Context, name: str, command: list[str], outputs=(), **kw) -> StepResult:
    log.info("rehearse: %s", name)
    result = run_step(name, command, outputs=[str(o) for o in outputs], env=ctx.env, cwd=REPO,
                      interval=ctx.cfg.interval_s, timeout_s=ctx.cfg.step_timeout_s, **kw)
    log.info("rehearse: %s: %.1f s wall, %.1f CPU-s, exit %s", name, result.wall_s, result.cpu_s, result.returncode)
    return result


def require(result: StepResult, what: str) -> None:
    if result.returncode != 0 and result.killed_at_s is None:
        raise RuntimeError(f"{what} failed (exit {result.returncode}):\n{result.stdout_tail}")


def step_result_json(result: StepResult) -> dict:
    """The JSON line a ``rehearsal.steps`` child ends with."""
    lines = [ln for ln in result.stdout_tail.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{result.name}: no result line:\n{result.stdout_tail}")
    return json.loads(lines[-1].removeprefix("RESULT "))


# ---------------------------------------------------------------------------------------------
# Commands


def stage1_command(ctx: Context, files: str, out: str, name: str, logs: Path) -> list[str]:
    c = ctx.cfg
    return ctx.module("stages.score_teacher", "teacher=rehearsal-qwen2.5", f"teacher.model={ctx.teacher_tokenizer}",
                      "teacher.revision=null", f"teacher.window={c.window}", f"teacher.stride={c.stride}",
                      "data=open-web-math", f"data.name={name}", "data.source=files", "data.hub_id=null",
                      f"data.files=[{files}]", f"data.rows_per_shard={c.rows_per_shard}", "ray=local",
                      f"ray.num_cpus={c.actors}", f"pool.num_actors={c.actors}", "pool.num_cpus=1",
                      f"output_dir={out}", "progress=false", f"hydra.run.dir={logs}")


def student_args(ctx: Context, seq_len: int) -> list[str]:
    return ["student.embedded=false", "student.name=micro-llama", f"student.model={ctx.student}",
            f"student.seq_len={seq_len}", f"artifacts_dir={ctx.work / 'artifacts'}"]


def train_command(ctx: Context, scored: str, out: Path, logs: Path) -> list[str]:
    c = ctx.cfg
    return ctx.module("stages.train_student", *student_args(ctx, c.seq_len), f"data.folders=[{scored}]",
                      "data.allow_rehearsal=true", f"data.length_workers={c.length_workers}",
                      f"data.num_workers={c.loader_workers}", f"data.cache_dir={ctx.work / 'lengths'}",
                      f"train.max_steps={c.train_steps}", f"train.micro_batch_size={c.micro_batch_size}",
                      "train.learning_rate=1e-3", "train.min_learning_rate=1e-4", "train.warmup_steps=10",
                      "train.save_steps=1000000", "train.logging_steps=1", "train.report_to=[]", "train.cpu_threads=1",
                      "train.use_cpu=true", "train.progress=false", f"output_dir={out}", f"hydra.run.dir={logs}")


def export_command(ctx: Context, scored: str, out: str, logs: Path) -> list[str]:
    c = ctx.cfg
    return ctx.module("stages.export_student", *student_args(ctx, c.export_seq_len), f"data.folders=[{scored}]",
                      "data.allow_rehearsal=true", f"data.length_workers={c.length_workers}",
                      f"data.cache_dir={ctx.work / 'lengths'}", f"export.formats=[{','.join(c.export_formats)}]",
                      "export.progress=false", f"output_dir={out}", f"hydra.run.dir={logs}")


def inspect_command(ctx: Context, command: str, scored: str, logs: Path) -> list[str]:
    return ctx.module("stages.inspect", f"command={command}", f"path={scored}", "progress=false",
                      f"out_dir={logs / 'out'}", f"hydra.run.dir={logs}")


# ---------------------------------------------------------------------------------------------
# Reading what a step left


def stage1_summary(logs: Path) -> dict:
    return json.loads((logs / "summary.json").read_text())


def manifest_of(folder: str) -> dict:
    from storage_schemas import read_manifest

    return read_manifest(folder)


def markers(folder: Path) -> dict[str, str]:
    """Each marker's content (a marker rewritten means its shard was redone)."""
    return {p.name: p.read_text() for p in folder.glob("*.done.json")}


def data_files(folder: Path) -> dict[str, str]:
    """sha256 of every shard file and part (markers, manifest and card left out: they hold timings,
    hosts and tries)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.name.startswith("shard-") and not p.name.endswith(".json")}


# ---------------------------------------------------------------------------------------------
# A fraction


def run_fraction(ctx: Context, fraction: float) -> dict:
    c, tag = ctx.cfg, tag_of(fraction)
    here = ctx.work / tag
    shutil.rmtree(here, ignore_errors=True)
    here.mkdir(parents=True)
    corpus_dir = ctx.work / "corpora" / tag
    out: dict = {"fraction": fraction, "tag": tag, "steps": {}, "checks": {}}
    steps = out["steps"]

    if "corpus" in c.steps or not (corpus_dir / "data").is_dir():
        r = step(ctx, "corpus", ctx.module("rehearsal.steps", "corpus", json.dumps(
            {"out": str(corpus_dir), "fraction": fraction, "teacher_tokenizer": str(ctx.teacher_tokenizer),
             "seed": c.seed, "pool_pages": c.pool_pages})), outputs=[corpus_dir])
        require(r, "the corpus")
        steps["corpus"] = {**r.to_dict(), "result": step_result_json(r)}
    out["corpus"] = json.loads((corpus_dir / "_REHEARSAL_CORPUS.json").read_text())
    files = str(corpus_dir / "data" / "*.parquet")
    scored = here / "scored"
    name = f"owm-rehearsal-{tag}"

    r = step(ctx, "stage1", stage1_command(ctx, files, str(scored), name, here / "logs" / "stage1"), outputs=[scored])
    require(r, "stage 1")
    steps["stage1"] = {**r.to_dict(), "summary": stage1_summary(here / "logs" / "stage1")}
    manifest = manifest_of(str(scored))
    out.update(documents=manifest["totals"]["documents"], teacher_tokens=manifest["totals"]["tokens"],
               shards=len(manifest["shards"]), scored_bytes=manifest["totals"]["bytes"],
               manifest_bytes=(scored / "manifest.json").stat().st_size)

    if "rerun" in c.steps:
        r = step(ctx, "rerun", stage1_command(ctx, files, str(scored), name, here / "logs" / "rerun"))
        require(r, "the rerun")
        steps["rerun"] = {**r.to_dict(), "summary": stage1_summary(here / "logs" / "rerun")}
        out["checks"]["rerun_scored_nothing"] = steps["rerun"]["summary"]["shards_scored"] == 0

    if "count" in c.steps:
        shutil.rmtree(ctx.work / "lengths", ignore_errors=True)
        r = step(ctx, "count", ctx.module("rehearsal.steps", "count", json.dumps(
            {"scored": str(scored), "student_tokenizer": str(ctx.student), "cache_dir": str(ctx.work / "lengths"),
             "workers": c.length_workers})), outputs=[ctx.work / "lengths"])
        require(r, "the token count")
        steps["count"] = {**r.to_dict(), "result": step_result_json(r)}
        out["student_tokens"] = steps["count"]["result"]["student_tokens"]

    if "train" in c.steps:
        run_dir = here / "student"
        metrics = run_dir / "metrics.jsonl"
        r = step(ctx, "train", train_command(ctx, str(scored), run_dir, here / "logs" / "train"), outputs=[run_dir],
                 watch={"first_step_s": lambda: metrics.is_file() and metrics.stat().st_size > 0})
        require(r, "the training run")
        steps["train"] = r.to_dict()

    if "export" in c.steps:
        export_dir = here / "export"
        r = step(ctx, "export", export_command(ctx, str(scored), str(export_dir), here / "logs" / "export"),
                 outputs=[export_dir])
        require(r, "the export")
        steps["export"] = {**r.to_dict(), "manifest_totals": manifest_of_export(export_dir)}

    for command in ("summary", "validate"):
        if command in c.steps:
            r = step(ctx, command, inspect_command(ctx, command, str(scored), here / "logs" / command))
            require(r, f"make inspect command={command}")
            steps[command] = r.to_dict()

    if "kills" in c.steps and c.kill_fraction is not None and abs(fraction - c.kill_fraction) < 1e-12:
        out["kills"] = kill_and_rerun(ctx, files, name, scored, here, steps)
    if "s3" in c.steps and c.s3_fraction is not None and abs(fraction - c.s3_fraction) < 1e-12:
        out["s3"] = on_s3(ctx, corpus_dir, name, here)
    return out


def manifest_of_export(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())["totals"]


# ---------------------------------------------------------------------------------------------
# Kills


def kill_and_rerun(ctx: Context, files: str, name: str, reference: Path, here: Path, steps: dict) -> dict:
    """Stage 1, then the export, each SIGKILLed ``kills`` times at random moments (as soon as a
    random number of shards carry their marker, more than at the kill before, plus a random
    fraction of a second) and rerun to the end: the output must equal the uninterrupted run's byte for byte, and no shard marked
    before a kill may be written again."""
    rng = random.Random(ctx.cfg.seed)
    scored = here / "scored-killed"
    planned = manifest_of(str(reference))["n_shards_planned"]
    stage1 = kill_loop(ctx, "stage1", lambda logs: stage1_command(ctx, files, str(scored), name, logs), scored,
                       planned, rng, here)
    stage1["identical"] = data_files(scored) == data_files(reference)
    export_ref = here / "export"
    exported = here / "export-killed"
    n_export = len(json.loads((export_ref / "manifest.json").read_text())["shards"]) if export_ref.is_dir() else 0
    export = None
    if n_export > 1:
        export = kill_loop(ctx, "export", lambda logs: export_command(ctx, str(reference), str(exported), logs),
                           exported, n_export, rng, here)
        export["identical"] = data_files(exported) == data_files(export_ref)
        export["manifest_identical"] = (exported / "manifest.json").read_bytes() == (export_ref / "manifest.json").read_bytes()
    steps.update({f"{k} (kills)": v for k, v in (("stage1", stage1.pop("final")),
                                                 ("export", export.pop("final") if export else None)) if v})
    return {"stage1": stage1, "export": export}


def kill_loop(ctx: Context, what: str, command, folder: Path, planned: int, rng: random.Random, here: Path) -> dict:
    kills, seen = [], {}
    for k in range(ctx.cfg.kills):
        if len(seen) >= planned - 1:
            break
        target = rng.randint(len(seen) + 1, planned - 1)  # more marked than at the last kill, never all
        delay = rng.uniform(0.0, 1.0)
        state = {"at": None}

        def kill_when(elapsed: float, target=target, delay=delay, state=state) -> bool:
            if state["at"] is None and len(list(folder.glob("*.done.json"))) >= target:
                state["at"] = elapsed
            return state["at"] is not None and elapsed >= state["at"] + delay

        r = step(ctx, f"{what} killed {k + 1}", command(here / "logs" / f"{what}-killed-{k + 1}"), kill_when=kill_when)
        now = markers(folder)
        redone = sorted(n for n, text in seen.items() if now.get(n) != text)
        kills.append({"target_markers": target, "delay_s": delay, "killed_at_s": r.killed_at_s,
                      "finished_first": r.killed_at_s is None, "markers_after": len(now),
                      "marked_shards_rewritten": redone, "wall_s": r.wall_s, "cpu_s": r.cpu_s})
        seen = now
    logs = here / "logs" / f"{what}-after-kills"
    final = step(ctx, f"{what} after kills", command(logs))
    require(final, f"{what} after the kills")
    now = markers(folder)
    rewritten = sorted(n for n, text in seen.items() if now.get(n) != text)
    scored_by_final = len(now) - len(seen)
    return {"planned": planned, "kills": kills, "final": final.to_dict(), "marked_before_final": len(seen),
            "written_by_final": scored_by_final, "marked_shards_rewritten": rewritten,
            "redone_at_most_in_flight": not rewritten and all(not k["marked_shards_rewritten"] for k in kills)}


# ---------------------------------------------------------------------------------------------
# The S3 API


def on_s3(ctx: Context, corpus_dir: Path, name: str, here: Path) -> dict:
    """The fraction's stage 1 (corpus and output on the store), its rerun, the export and the
    validation through moto's S3 server on 127.0.0.1 (run in this process: its CPU is this
    process's, reported apart)."""
    import time

    import pyarrow.fs as pafs

    from local_s3 import local_s3_server

    steps = {}
    c0 = time.process_time()
    with local_s3_server("rehearse") as make_bucket:
        env_before = ctx.env
        ctx.env = {**ctx.env, **{k: os.environ[k] for k in os.environ if k.startswith("AWS_")}}
        try:
            bucket = make_bucket("rehearse")
            fs, _ = pafs.FileSystem.from_uri(bucket)
            for path in sorted((corpus_dir / "data").glob("*.parquet")):
                with fs.open_output_stream(f"rehearse/corpus/{path.name}") as f:
                    f.write(path.read_bytes())
            files, scored, exported = f"{bucket}/corpus/*.parquet", f"{bucket}/scored", f"{bucket}/export"
            logs = here / "logs"
            for label, command, outputs in (
                    ("s3 stage1", stage1_command(ctx, files, scored, name, logs / "s3-stage1"), [scored]),
                    ("s3 rerun", stage1_command(ctx, files, scored, name, logs / "s3-rerun"), []),
                    ("s3 export", export_command(ctx, scored, exported, logs / "s3-export"), [exported]),
                    ("s3 validate", inspect_command(ctx, "validate", scored, logs / "s3-validate"), [])):
                r = step(ctx, label, command, outputs=outputs)
                require(r, label)
                steps[label] = r.to_dict()
            steps["s3 rerun"]["summary"] = stage1_summary(logs / "s3-rerun")
        finally:
            ctx.env = env_before
    return {"steps": steps, "moto_cpu_s": time.process_time() - c0,
            "rerun_scored_nothing": steps["s3 rerun"]["summary"]["shards_scored"] == 0}


def prepare_models(cfg: RehearseConfig, work: Path) -> tuple[Path, Path]:
    """The teacher's tokenizer as a folder and the micro student (a random-weight Llama with the
    student's tokenizer, 2,048 positions), both built once under ``work``."""
    from benchmarks.inputs import RandomModelShape, random_causal_lm, real_tokenizer, real_tokenizer_folder

    real_tokenizer(cfg.teacher_tokenizer, cfg.tokenizers_dir, work / "tokenizers")  # saves its folder
    teacher = work / "tokenizers" / cfg.teacher_tokenizer
    student_tok = real_tokenizer(cfg.student_tokenizer, cfg.tokenizers_dir, work / "tokenizers")
    real_tokenizer_folder(cfg.student_tokenizer, cfg.tokenizers_dir, work / "tokenizers")
    shape = RandomModelShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, context=2048,
                             tie_word_embeddings=True)
    student = random_causal_lm(work / "student-model", shape, student_tok)
    return teacher, student
