"""``python -m stages.repro [hydra overrides]`` (``make repro``): the paper's claims at toy scale.

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

from pipeline.lab.repro.build import (
    CorpusSpec,
    PretrainSpec,
    StudentSpec,
    TeacherSpec,
    build_corpora,
    build_student,
    build_teacher,
)
from stages.common import exit_on_user_error, plain, quiet_libraries, raise_if

log = logging.getLogger("repro")


def check(cfg: DictConfig) -> None:
    problems = []
    if not cfg.seeds:
        problems.append("seeds: at least one seed is needed")
    for name, arm in cfg.arms.items():
        if arm.teacher not in cfg.teachers:
            problems.append(f"arms.{name}.teacher: {arm.teacher!r} is not one of {', '.join(cfg.teachers)}")
        if arm.student not in cfg.students:
            problems.append(f"arms.{name}.student: {arm.student!r} is not one of {', '.join(cfg.students)}")
    if cfg.train_steps < 1:
        problems.append(f"train_steps: {cfg.train_steps} must be >= 1")
    raise_if(problems)


def score(cfg: DictConfig, teachers: dict[str, Path], corpus_files: list[Path]) -> dict[str, str]:
    """Stage 1 for each teacher over the student corpus (a finished folder is found complete and
    left as it is, without starting Ray)."""
    from pipeline.score_teacher.job import run_score_job
    from stages.score_teacher import job_config
    from storage_schemas import dataset_dir

    work = Path(to_absolute_path(cfg.work_dir))
    folders = {}
    for name, folder in teachers.items():
        out = dataset_dir(work / "scored", "repro-student", name)
        stage_cfg = compose(config_name="score_teacher", overrides=[
            f"teacher.model={folder}", f"teacher.name=repro-{name}", "teacher.embedded=false",
            "data.name=repro-student", "data.embedded=false", f"data.files=[{corpus_files[0].parent}/*.parquet]",
            "data.rows_per_shard=100", f"output_dir={out}", "progress=false", "pool.num_cpus=2",
            f"migrate_identity={bool(cfg.migrate_identity)}",
        ])
        t0 = time.perf_counter()
        summary = run_score_job(job_config(stage_cfg))
        log.info("scored with the %s teacher in %.0fs: %s", name, time.perf_counter() - t0, out)
        folders[name] = str(summary.output_dir)
    return folders


def tasks(cfg: DictConfig, scored: dict[str, str], students: dict[str, Path], held_out: list[str]):
    from pipeline.lab.repro.runner import RunTask
    from stages.train_student import job_config

    work = Path(to_absolute_path(cfg.work_dir))
    out = []
    for seed in cfg.seeds:
        for arm_name, arm in cfg.arms.items():
            overrides = [
                *cfg.train_overrides, *arm.overrides,
                f"student.model={students[arm.student]}", f"student.name={arm.student}", "student.embedded=false",
                f"data.folders=[{scored[arm.teacher]}]", f"data.teacher={arm.teacher}", "data.corpus=repro",
                f"data.seed={seed}", f"train.seed={seed}", f"train.max_steps={cfg.train_steps}",
                f"data.cache_dir={work / 'cache'}", f"output_dir={work / 'students' / arm_name / f'seed{seed}'}",
                "train.report_to=[]", "train.progress=false", f"train.save_steps={10 * cfg.train_steps}",
                "overwrite=true",
            ]
            job = job_config(compose(config_name="train_student", overrides=overrides))
            out.append(RunTask(arm_name, seed, arm.teacher, arm.student, job, tuple(held_out),
                               completion_seed=1000 + seed, n_completions=cfg.eval.completions, window=cfg.eval.window))
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="repro")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    from tqdm import tqdm

    from pipeline.lab.repro.report import write_report
    from pipeline.lab.repro.runner import run_tasks

    quiet_libraries()
    check(cfg)
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared: say how busy it was
    t0 = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    artifacts = Path(to_absolute_path(cfg.artifacts_dir))
    corpora = build_corpora(artifacts, CorpusSpec(**plain(cfg, "corpus")))
    used_teachers = sorted({arm.teacher for arm in cfg.arms.values()})  # only what the arms need
    used_students = sorted({arm.student for arm in cfg.arms.values()})
    teachers = {name: build_teacher(artifacts, TeacherSpec(name=name, **plain(cfg.teachers[name])), corpora)
                for name in used_teachers}
    pretrain = PretrainSpec(**plain(cfg, "pretrain"))
    students = {name: build_student(artifacts, StudentSpec(name=name, **plain(cfg.students[name])), corpora, pretrain)
                for name in used_students}
    build_s = time.perf_counter() - t0
    scored = score(cfg, teachers, corpora.student_files)
    score_s = time.perf_counter() - t0 - build_s

    run_list = tasks(cfg, scored, students, corpora.held_out)
    bar = tqdm(total=len(run_list), desc="student runs", unit="run")
    from_cache = []

    def progress(result: dict, cached: bool) -> None:
        bar.update(1)
        from_cache.append(cached)
        bar.write(f"{result['arm']:>20} seed {result['seed']}: {result['bits_per_byte']:.4f} bits/byte"
                  + (" (cached)" if cached else f" ({result['train_seconds']:.0f}s)"))

    results = run_tasks(run_list, cfg.parallel, on_result=progress)
    bar.close()
    baselines = {name: base_scores(folder, corpora.held_out, cfg) for name, folder in students.items()}

    setup = {
        "started": started, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t0, 1), "build_seconds": round(build_s, 1),
        "score_seconds": round(score_s, 1), "machine": f"{platform.machine()}, {_cpus()} CPU cores",
        "load_average_at_start": load_at_start, "runs_read_from_cache": sum(from_cache),
        "seeds": list(cfg.seeds), "n_runs": len(results), "parallel": cfg.parallel,
        "train_steps": cfg.train_steps, "train_tokens_per_run": results[0]["tokens_trained"] if results else 0,
        "corpora": corpora.describe(),
        "teachers": {n: json.loads((p / "_BUILD.json").read_text()) for n, p in teachers.items()},
        "students": {n: plain(cfg.students[n]) for n in used_students},
        "pretrain": plain(cfg, "pretrain"),
        "base_students": baselines,
        "train_overrides": list(cfg.train_overrides),
    }
    readme = Path(to_absolute_path(cfg.readme)) if cfg.readme else None
    record = write_report(results, list(cfg.arms), setup, Path(to_absolute_path(cfg.report_dir)), readme)
    for c in record["claims"]:
        print(f"claim {c['claim']}: {c['verdict']:<14} {c['text']}")
    print(f"report: {Path(cfg.report_dir) / 'report.md'} ({setup['seconds'] / 60:.1f} min)")


def base_scores(folder: Path, held_out: list[str], cfg: DictConfig) -> dict:
    """The base student's scores before continual pretraining (cached next to it)."""
    from pipeline.lab.repro.evaluate import completion_items, evaluate_model

    cache = folder / "repro_base_scores.json"
    key = {"held_out": len(held_out), "completions": cfg.eval.completions, "window": cfg.eval.window,
           "seeds": list(cfg.seeds)}
    if cache.is_file() and json.loads(cache.read_text()).get("key") == key:
        return json.loads(cache.read_text())["scores"]
    items = [i for seed in cfg.seeds for i in completion_items(cfg.eval.completions, 1000 + seed)]
    scores = evaluate_model(str(folder), held_out, items, cfg.eval.window)
    scores.pop("completions")
    cache.write_text(json.dumps({"key": key, "scores": scores}))
    return scores


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


if __name__ == "__main__":
    sys.exit(main())
