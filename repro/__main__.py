"""``python -m repro [hydra overrides]`` (``make repro``): the paper's claims at toy scale.

Reads as a list of steps: build the corpora, teachers and students; score the student corpus
with each teacher (stage 1's job config and Ray job); train and evaluate every arm and seed (stage
2's job config and trainer); write the report and the README table. Stage configs come from
``conf/score_teacher.yaml`` and ``conf/train_student.yaml`` with overrides, so every run is
exactly what ``make score-teacher`` / ``make train-student`` would do with those arguments.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import hydra
from hydra import compose
from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from repro.build import (
    CorpusSpec,
    PretrainSpec,
    StudentSpec,
    TeacherSpec,
    build_corpora,
    build_student,
    build_student_corpus,
    build_teacher,
    describe_student_corpus,
)
from stages.common import exit_on_user_error, plain, quiet_libraries, raise_if

log = logging.getLogger("repro")
MAIN_CORPUS = "main"  # the student corpus of the corpus section (its noise share also makes the bases' mixture)
COMPLETION_SEED = 1000  # the held-out worked problems: one fixed set for every run, so seeds pair exactly


def check(cfg: DictConfig) -> None:
    problems = []
    if not any(cfg.seed_sets[arm.seeds] for arm in cfg.arms.values() if arm.seeds in cfg.seed_sets):
        problems.append("seed_sets: no arm has a seed to run")
    corpora = {MAIN_CORPUS, *cfg.student_corpora}
    for name, arm in cfg.arms.items():
        names = arm_teachers(arm)
        if not names:
            problems.append(f"arms.{name}.teacher: give a teacher name or a list of them")
        elif len(set(names)) < len(names):
            problems.append(f"arms.{name}.teacher: {names} names a teacher twice")
        for teacher in names:
            if teacher not in cfg.teachers:
                problems.append(f"arms.{name}.teacher: {teacher!r} is not one of {', '.join(cfg.teachers)}")
        if arm.student not in cfg.students:
            problems.append(f"arms.{name}.student: {arm.student!r} is not one of {', '.join(cfg.students)}")
        if arm.seeds not in cfg.seed_sets:
            problems.append(f"arms.{name}.seeds: {arm.seeds!r} is not one of {', '.join(cfg.seed_sets)}")
        if arm.get("corpus", MAIN_CORPUS) not in corpora:
            problems.append(f"arms.{name}.corpus: {arm.corpus!r} is not one of {', '.join(sorted(corpora))}")
    for name, share in cfg.student_corpora.items():
        if not 0.0 <= share <= 1.0:
            problems.append(f"student_corpora.{name}: noise share {share} is not in [0, 1]")
    if cfg.train_steps < 1:
        problems.append(f"train_steps: {cfg.train_steps} must be >= 1")
    raise_if(problems)


def arm_teachers(arm: DictConfig) -> list[str]:
    """An arm's teachers in order: ``teacher: strong`` or ``teacher: [strong, weak]`` (several
    teachers: their scored folders go to ``data.folders`` in this order, METHOD §2.6)."""
    teacher = arm.get("teacher")
    if teacher is None:
        return []
    return [str(teacher)] if isinstance(teacher, str) else [str(t) for t in teacher]


def teacher_label(arm: DictConfig) -> str:
    """The arm's teacher as results and run names show it: ``strong``, or ``strong+weak``."""
    return "+".join(arm_teachers(arm))


def corpus_name(name: str) -> str:
    """The scored dataset's corpus name for a student corpus variant."""
    return "repro-student" if name == MAIN_CORPUS else f"repro-student-{name}"


def score(cfg: DictConfig, teachers: dict[str, Path], pairs: set[tuple[str, str]],
          corpus_files: dict[str, list[Path]]) -> dict[tuple[str, str], str]:
    """Stage 1 for each (teacher, student corpus) pair the arms use (a finished folder is found
    complete and left as it is, without starting Ray)."""
    from pipeline.score_teacher.job import run_score_job
    from stages.score_teacher import job_config
    from storage_schemas import dataset_dir

    work = Path(to_absolute_path(cfg.work_dir))
    folders = {}
    for teacher, corpus in sorted(pairs):
        data_name = corpus_name(corpus)
        out = dataset_dir(work / "scored", data_name, teacher)
        if cfg.report_only:  # nothing is trained, so nothing is scored: a run can be finished only if its folder is
            folders[teacher, corpus] = os.path.abspath(out)
            continue
        stage_cfg = compose(config_name="score_teacher", overrides=[
            f"teacher.model={teachers[teacher]}", f"teacher.name=repro-{teacher}", "teacher.embedded=false",
            f"data.name={data_name}", "data.embedded=false", f"data.files=[{corpus_files[corpus][0].parent}/*.parquet]",
            "data.rows_per_shard=100", f"output_dir={out}", "progress=false", "pool.num_cpus=2",
            f"migrate_identity={bool(cfg.migrate_identity)}",
        ])
        t0 = time.perf_counter()
        summary = run_score_job(job_config(stage_cfg))
        log.info("scored %s with the %s teacher in %.0fs: %s", data_name, teacher, time.perf_counter() - t0, out)
        folders[teacher, corpus] = str(summary.output_dir)
    return folders


def tasks(cfg: DictConfig, scored: dict[tuple[str, str], str], students: dict[str, Path], held_out: list[str]):
    from repro.runner import RunTask
    from stages.train_student import job_config

    work = Path(to_absolute_path(cfg.work_dir))
    out = []
    for arm_name, arm, seed in run_order(cfg):
        corpus = arm.get("corpus", MAIN_CORPUS)
        overrides = [
            *cfg.train_overrides, *arm.overrides,
            f"student.model={students[arm.student]}", f"student.name={arm.student}", "student.embedded=false",
            f"data.folders=[{','.join(scored[t, corpus] for t in arm_teachers(arm))}]",
            f"data.teacher={teacher_label(arm)}", "data.corpus=repro",
            f"data.seed={seed}", f"train.seed={seed}", f"train.max_steps={cfg.train_steps}",
            f"data.cache_dir={work / 'cache'}", f"output_dir={work / 'students' / arm_name / f'seed{seed}'}",
            "train.report_to=[]", "train.progress=false", f"train.save_steps={10 * cfg.train_steps}",
            "overwrite=true",
        ]
        job = job_config(compose(config_name="train_student", overrides=overrides))
        out.append(RunTask(arm_name, seed, teacher_label(arm), arm.student, corpus, noise_share(cfg, corpus), job,
                           tuple(held_out), completion_seed=COMPLETION_SEED, n_completions=cfg.eval.completions,
                           window=cfg.eval.window))
    return out


def run_order(cfg: DictConfig) -> list[tuple[str, DictConfig, int]]:
    """(arm name, arm, seed) in the order the runs start: seed set by seed set as listed, and inside
    one, seed by seed, so that the arms compared with each other finish together."""
    order = []
    for set_name, seeds in cfg.seed_sets.items():
        for seed in seeds:
            order += [(name, arm, seed) for name, arm in cfg.arms.items() if arm.seeds == set_name]
    return order


def noise_share(cfg: DictConfig, corpus: str) -> float:
    return float(cfg.corpus.noise_share if corpus == MAIN_CORPUS else cfg.student_corpora[corpus])


@hydra.main(version_base="1.3", config_path="../conf", config_name="repro")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    from tqdm import tqdm

    from repro.diagnose import diagnose_selection
    from repro.report import write_report
    from repro.runner import run_tasks
    from repro.teachers_report import write_teachers_report

    quiet_libraries()
    check(cfg)
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared: say how busy it was
    t0 = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    artifacts = Path(to_absolute_path(cfg.artifacts_dir))
    spec = CorpusSpec(**plain(cfg, "corpus"))
    corpora = build_corpora(artifacts, spec)
    arms = {name: arm for name, arm in cfg.arms.items() if cfg.seed_sets[arm.seeds]}  # an empty seed set: not run
    used_corpora = {arm.get("corpus", MAIN_CORPUS) for arm in arms.values()}
    corpus_files = {name: corpora.student_files if name == MAIN_CORPUS else
                    build_student_corpus(artifacts, spec, noise_share(cfg, name)) for name in sorted(used_corpora)}
    used_teachers = sorted({t for arm in arms.values() for t in arm_teachers(arm)})  # only what the arms need
    used_students = sorted({arm.student for arm in arms.values()})
    teachers = {name: build_teacher(artifacts, TeacherSpec(name=name, **plain(cfg.teachers[name])), corpora)
                for name in used_teachers}
    pretrain = PretrainSpec(**plain(cfg, "pretrain"))
    students = {name: build_student(artifacts, StudentSpec(name=name, **plain(cfg.students[name])), corpora, pretrain)
                for name in used_students}
    build_s = time.perf_counter() - t0
    pairs = {(t, arm.get("corpus", MAIN_CORPUS)) for arm in arms.values() for t in arm_teachers(arm)}
    scored = score(cfg, teachers, pairs, corpus_files)
    score_s = time.perf_counter() - t0 - build_s

    run_list = tasks(cfg, scored, students, corpora.held_out)
    bar = tqdm(total=len(run_list), desc="student runs", unit="run")
    from_cache = []

    def progress(result: dict, cached: bool) -> None:
        bar.update(1)
        from_cache.append(cached)
        bar.write(f"{result['arm']:>20} seed {result['seed']}: {result['bits_per_byte']:.4f} bits/byte"
                  + (" (cached)" if cached else f" ({result['train_seconds']:.0f}s)"))

    results = run_tasks(run_list, cfg.parallel, on_result=progress, train=not cfg.report_only)
    bar.close()
    if not results:
        raise SystemExit("report_only: no finished run to report")
    baselines = {name: base_scores(folder, corpora.held_out, cfg) for name, folder in students.items()}
    diagnosis = {}
    if cfg.diagnose.teacher in teachers and (cfg.diagnose.teacher, MAIN_CORPUS) in scored:
        t1 = time.perf_counter()
        diagnosis = {name: diagnose_selection(folder, scored[cfg.diagnose.teacher, MAIN_CORPUS], corpora.student_files,
                                              ratio=cfg.diagnose.ratio, block=cfg.eval.window)
                     for name, folder in students.items()}
        log.info("selection diagnosed in %.0fs", time.perf_counter() - t1)

    setup = {
        "started": started, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t0, 1), "build_seconds": round(build_s, 1),
        "score_seconds": round(score_s, 1), "machine": f"{platform.machine()}, {_cpus()} CPU cores",
        "load_average_at_start": load_at_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "runs_read_from_cache": sum(from_cache), "runs_planned": len(run_list),
        "seed_sets": plain(cfg, "seed_sets"), "n_runs": len(results), "parallel": cfg.parallel,
        "train_steps": cfg.train_steps, "train_tokens_per_run": results[0]["tokens_trained"] if results else 0,
        "corpora": corpora.describe(),
        "student_corpora": {name: {"noise_share": noise_share(cfg, name), **describe_student_corpus(files)}
                            for name, files in corpus_files.items()},
        "teachers": {n: json.loads((p / "_BUILD.json").read_text()) for n, p in teachers.items()},
        "students": {n: plain(cfg.students[n]) for n in used_students},
        "pretrain": plain(cfg, "pretrain"),
        "power": plain(cfg, "power"),
        "base_students": baselines,
        "train_overrides": list(cfg.train_overrides),
    }
    readme = Path(to_absolute_path(cfg.readme)) if cfg.readme else None
    record = write_report(results, list(cfg.arms), setup, Path(to_absolute_path(cfg.report_dir)), readme,
                          diagnosis=diagnosis)
    for c in record["claims"]:
        print(f"claim {c['claim']}: {c['verdict']:<14} {c['text']}")
    several = write_teachers_report(results, setup, Path(to_absolute_path(cfg.report_dir)))
    if several is not None:
        print(f"several teachers: default loss.combine {several['default_choice']['default']}: "
              f"{several['default_choice']['reason']} ({Path(cfg.report_dir) / 'teachers.md'})")
    print(f"report: {Path(cfg.report_dir) / 'report.md'} ({setup['seconds'] / 60:.1f} min)")


def base_scores(folder: Path, held_out: list[str], cfg: DictConfig) -> dict:
    """The base student's scores before continual pretraining (cached next to it)."""
    from repro.evaluate import completion_items, evaluate_model
    from repro.runner import EVALUATION

    cache = folder / "repro_base_scores.json"
    key = {"held_out": len(held_out), "completions": cfg.eval.completions, "window": cfg.eval.window,
           "completion_seed": COMPLETION_SEED, "measures": EVALUATION}
    if cache.is_file() and json.loads(cache.read_text()).get("key") == key:
        return json.loads(cache.read_text())["scores"]
    scores = evaluate_model(str(folder), held_out, completion_items(cfg.eval.completions, COMPLETION_SEED), cfg.eval.window)
    cache.write_text(json.dumps({"key": key, "scores": scores}))
    return scores


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


if __name__ == "__main__":
    sys.exit(main())
