"""``python -m repro [hydra overrides]`` (``make repro``): the paper's claims at toy scale.

Reads as a list of steps: compose and check the study (:mod:`repro.config`, every problem at once);
build the corpora, teachers and students; score the student corpus with each teacher (stage 1's
job config and Ray job); train and evaluate every arm and seed (stage 2's job config and trainer);
write the report (``repro-results/``: report.md, report.json, summary.md, the plots). Stage configs
come from ``conf/score_teacher.yaml`` and ``conf/train_student.yaml`` with overrides, so every run
is exactly what ``make score-teacher`` / ``make train-student`` would do with those arguments.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from hydra import compose
from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from benchmarks.measure import LoadSampler
from repro.build import build_corpora, build_student, build_student_corpus, build_teacher, describe_student_corpus
from repro.config import MAIN_CORPUS, ArmConfig, ReproConfig, study_config
from stages.common import entry_point, quiet_libraries

log = logging.getLogger("repro")
COMPLETION_SEED = 1000  # the held-out worked problems: one fixed set for every run, so seeds pair exactly
# Where the study works and how it runs: the typed defaults; the design itself is conf/repro.yaml's.
DEFAULTS = {f.name: f.default for f in dataclasses.fields(ReproConfig) if f.default is not dataclasses.MISSING}


def corpus_name(name: str) -> str:
    """The scored dataset's corpus name for a student corpus variant."""
    return "repro-student" if name == MAIN_CORPUS else f"repro-student-{name}"


def score(study: ReproConfig, teachers: dict[str, Path], pairs: set[tuple[str, str]],
          corpus_files: dict[str, list[Path]]) -> dict[tuple[str, str], str]:
    """Stage 1 for each (teacher, student corpus) pair the arms use (a finished folder is found
    complete and left as it is, without starting Ray)."""
    from pipeline.score_teacher.job import run_score_job
    from stages.score_teacher import job_config
    from storage_schemas import dataset_dir

    work = Path(to_absolute_path(study.work_dir))
    folders = {}
    for teacher, corpus in sorted(pairs):
        data_name = corpus_name(corpus)
        out = dataset_dir(work / "scored", data_name, teacher)
        if study.report_only:  # nothing is trained, so nothing is scored: a run can be finished only if its folder is
            folders[teacher, corpus] = os.path.abspath(out)
            continue
        stage_cfg = compose(config_name="score_teacher", overrides=[
            f"teacher.model={teachers[teacher]}", f"teacher.name=repro-{teacher}", "teacher.embedded=false",
            f"data.name={data_name}", "data.embedded=false", f"data.files=[{corpus_files[corpus][0].parent}/*.parquet]",
            "data.rows_per_shard=100", f"output_dir={out}", "progress=false", "pool.num_cpus=2",
            # the study was run with losses stored as computed; stage 1's default rounds them to
            # bfloat16 (docs/storage-schema.md), which would change every figure of the report slightly
            "storage.loss_precision=float32", "storage.encodings=default",
        ])
        t0 = time.perf_counter()
        summary = run_score_job(job_config(stage_cfg))
        log.info("scored %s with the %s teacher in %.0fs: %s", data_name, teacher, time.perf_counter() - t0, out)
        folders[teacher, corpus] = str(summary.output_dir)
    return folders


def tasks(study: ReproConfig, scored: dict[tuple[str, str], str], students: dict[str, Path], held_out: list[str]):
    from repro.runner import RunTask
    from stages.train_student import job_config

    work = Path(to_absolute_path(study.work_dir))
    out = []
    for arm_name, arm, seed in run_order(study):
        overrides = [
            *study.train_overrides, *arm.overrides,
            f"student.model={students[arm.student]}", f"student.name={arm.student}", "student.embedded=false",
            f"data.folders=[{','.join(scored[t, arm.corpus] for t in arm.teachers)}]",
            f"data.teacher={arm.teacher_label}", "data.corpus=repro",
            f"data.seed={seed}", f"train.seed={seed}", f"train.max_steps={study.train_steps}",
            f"data.cache_dir={work / 'cache'}", f"output_dir={work / 'students' / arm_name / f'seed{seed}'}",
            "train.report_to=[]", "train.progress=false", f"train.save_steps={10 * study.train_steps}",
            "overwrite=true",
        ]
        job = job_config(compose(config_name="train_student", overrides=overrides))
        out.append(RunTask(arm_name, seed, arm.teacher_label, arm.student, arm.corpus, study.noise_share(arm.corpus), job,
                           tuple(held_out), completion_seed=COMPLETION_SEED, n_completions=study.eval.completions,
                           window=study.eval.window))
    return out


def sweep_tasks(run_list: list, study: ReproConfig) -> list:
    """The runs claim 7's diagnosis looks at: on the sweep seeds, every run that differs from
    ``guided`` only in its selection's mode, ratio and ranking (cpt, random, guided_r<x>, ...)."""
    ref = next((t for t in run_list if t.arm == "guided"), None)
    if ref is None:
        return []
    seeds = set(study.seed_sets.get("sweep", []))
    same = lambda t: (t.student, t.corpus, t.teacher, t.job.alignment, list(t.job.data.folders),  # noqa: E731
                      t.job.selection.unmapped)
    return [t for t in run_list if t.seed in seeds and same(t) == same(ref)]


def run_order(study: ReproConfig) -> list[tuple[str, ArmConfig, int]]:
    """(arm name, arm, seed) in the order the runs start: seed set by seed set as listed, and inside
    one, seed by seed, so that the arms compared with each other finish together."""
    order = []
    for set_name, seeds in study.seed_sets.items():
        for seed in seeds:
            order += [(name, arm, seed) for name, arm in study.arms.items() if arm.seeds == set_name]
    return order


@entry_point("repro", DEFAULTS, check=study_config)
def main(cfg: DictConfig) -> None:
    from tqdm import tqdm

    from repro.diagnose import diagnose_selection, diagnose_sweep
    from repro.report import write_report
    from repro.runner import run_tasks
    from repro.teachers_report import write_teachers_report

    quiet_libraries()
    design = study_config(cfg)
    study = design.as_pilot() if design.pilot else design.as_part() if design.part else design
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared: say how busy it was
    load = LoadSampler()
    t0 = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    artifacts = Path(to_absolute_path(study.artifacts_dir))
    corpora = build_corpora(artifacts, study.corpus)
    arms = study.arms_to_run()  # an empty seed set: not run
    used_corpora = {arm.corpus for arm in arms.values()}
    corpus_files = {name: corpora.student_files if name == MAIN_CORPUS else
                    build_student_corpus(artifacts, study.corpus, study.noise_share(name)) for name in sorted(used_corpora)}
    used_teachers = sorted({t for arm in arms.values() for t in arm.teachers})  # only what the arms need
    used_students = sorted({arm.student for arm in arms.values()})
    teachers = {name: build_teacher(artifacts, study.teachers[name], corpora) for name in used_teachers}
    students = {name: build_student(artifacts, study.students[name], corpora, study.pretrain) for name in used_students}
    build_s = time.perf_counter() - t0
    pairs = {(t, arm.corpus) for arm in arms.values() for t in arm.teachers}
    scored = score(study, teachers, pairs, corpus_files)
    score_s = time.perf_counter() - t0 - build_s

    run_list = tasks(study, scored, students, corpora.held_out)
    bar = tqdm(total=len(run_list), desc="student runs", unit="run")
    from_cache = []

    def progress(result: dict, cached: bool) -> None:
        bar.update(1)
        from_cache.append(cached)
        bar.write(f"{result['arm']:>20} seed {result['seed']}: {result['bits_per_byte']:.4f} bits/byte"
                  + (" (cached)" if cached else f" ({result['train_seconds']:.0f}s)"))

    results = run_tasks(run_list, study.parallel, on_result=progress, train=not study.report_only)
    bar.close()
    if not results:
        raise SystemExit("report_only: no finished run to report")
    if study.pilot:
        write_pilot(results, design, Path(to_absolute_path(study.report_dir)), started, t0, load_at_start)
        return
    baselines = {name: base_scores(folder, corpora.held_out, study) for name, folder in students.items()}
    diagnosis = {}
    if study.diagnose.teacher in teachers and (study.diagnose.teacher, MAIN_CORPUS) in scored:
        t1 = time.perf_counter()
        diagnosis = {name: diagnose_selection(folder, scored[study.diagnose.teacher, MAIN_CORPUS], corpora.student_files,
                                              ratio=study.diagnose.ratio, block=study.eval.window)
                     for name, folder in students.items()}
        log.info("selection diagnosed in %.0fs", time.perf_counter() - t1)
    sweep_diagnosis = {}
    mine = sweep_tasks(run_list, study)
    if mine:
        t1 = time.perf_counter()
        sweep_diagnosis = diagnose_sweep(mine, students[mine[0].student], corpus_files[mine[0].corpus],
                                         study.seed_sets.get("sweep", []), study.diagnose.batches,
                                         cache_dir=Path(to_absolute_path(study.work_dir)) / "diagnosis")
        log.info("sweep selection diagnosed in %.0fs", time.perf_counter() - t1)

    setup = {
        "started": started, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t0, 1), "build_seconds": round(build_s, 1),
        "score_seconds": round(score_s, 1), "machine": f"{platform.machine()}, {_cpus()} CPU cores",
        "load_average_at_start": load_at_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "load_average_during": load.stop(), "runs_read_from_cache": sum(from_cache), "runs_planned": len(run_list),
        "seed_sets": dict(study.seed_sets), "n_runs": len(results), "parallel": study.parallel,
        "train_steps": study.train_steps, "train_tokens_per_run": results[0]["tokens_trained"] if results else 0,
        "corpora": corpora.describe(),
        "student_corpora": {name: {"noise_share": study.noise_share(name), **describe_student_corpus(files)}
                            for name, files in corpus_files.items()},
        "teachers": {n: json.loads((p / "_BUILD.json").read_text()) for n, p in teachers.items()},
        "students": {n: dataclasses.asdict(study.students[n]) for n in used_students},
        "pretrain": dataclasses.asdict(study.pretrain),
        "power": dataclasses.asdict(study.power),
        "base_students": baselines,
        "train_overrides": list(study.train_overrides),
    }
    report_dir = Path(to_absolute_path(study.report_dir))
    record = write_report(results, list(study.arms), setup, report_dir, diagnosis=diagnosis,
                          sweep_diagnosis=sweep_diagnosis)
    for c in record["claims"]:
        print(f"claim {c['claim']}: {c['verdict']:<14} {c['text']}")
    several = write_teachers_report(results, setup, report_dir)
    if several is not None:
        print(f"several teachers: default loss.combine {several['default_choice']['default']}: "
              f"{several['default_choice']['reason']} ({Path(study.report_dir) / 'teachers.md'})")
    print(f"report: {Path(study.report_dir) / 'report.md'}, summary: {Path(study.report_dir) / 'summary.md'} "
          f"({setup['seconds'] / 60:.1f} min)")


def write_pilot(results: list[dict], design: ReproConfig, report_dir: Path, started: str, t0: float,
                load_at_start: list[float]) -> None:
    """``pilot.json`` (:mod:`repro.power`): the pilot's differences, sds and the seeds they ask for."""
    from repro.power import pilot_record

    sized = design.power.sized
    pending = {name for name, s in sized.items() if any(v is None for v in s.pilot_sd.values())}
    arms_of = {name: [a for a, arm in design.arms.items() if arm.seeds == name] for name in sized}
    other = sum(len(design.seed_sets.get(arm.seeds, [])) for arm in design.arms.values() if arm.seeds not in pending)
    limits = {}
    for name in pending:  # a comparison pairs seeds: a set can use no more seeds than the other arm's set has
        partners = {design.arms[x].seeds for a, b in sized[name].comparisons() for x in (a, b)} - {name}
        if partners:
            limits[name] = min(len(design.seed_sets[p]) for p in partners)
    record = pilot_record(results, design, {n: len(a) for n, a in arms_of.items()}, other, limits)
    record["setup"] = {"started": started, "seconds": round(time.perf_counter() - t0, 1),
                       "machine": f"{platform.machine()}, {_cpus()} CPU cores", "load_average_at_start": load_at_start,
                       "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "n_runs": len(results)}
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "pilot.json").write_text(json.dumps(record, indent=1) + "\n")
    for name, s in record["sets"].items():
        print(f"{name}: seeds needed {s['seeds_needed']}" + (f", allotted {s['seeds_allotted']}" if "seeds_allotted" in s else "")
              + "; " + ", ".join(f"{k}: sd {c['sd']:.4f} -> {c['seeds_needed']}" for k, c in s["comparisons"].items() if c))
    print(f"pilot: {report_dir / 'pilot.json'}")


def base_scores(folder: Path, held_out: list[str], study: ReproConfig) -> dict:
    """The base student's scores before continual pretraining (cached next to it)."""
    from repro.evaluate import completion_items, evaluate_model
    from repro.runner import EVALUATION

    cache = folder / "repro_base_scores.json"
    key = {"held_out": len(held_out), "completions": study.eval.completions, "window": study.eval.window,
           "completion_seed": COMPLETION_SEED, "measures": EVALUATION}
    if cache.is_file() and json.loads(cache.read_text()).get("key") == key:
        return json.loads(cache.read_text())["scores"]
    scores = evaluate_model(str(folder), held_out, completion_items(study.eval.completions, COMPLETION_SEED),
                            study.eval.window)
    cache.write_text(json.dumps({"key": key, "scores": scores}))
    return scores


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


if __name__ == "__main__":
    sys.exit(main())
