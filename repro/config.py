"""The study's typed configuration (``make repro``): where it works, and its design.

Where the study works and how it runs (folders, parallel runs, ``report_only``) have their defaults
here. The design itself (corpus sizes, teachers, students, pretraining, seed sets, steps,
evaluation, power, arms) is the study's content: it is written once, in ``conf/repro.yaml``, and
these classes give it types and check it, every problem at once (:func:`study_config`). Teachers
and students are named by their keys; their unset sizes are the tiny teacher's and the model
shape's defaults (:mod:`pipeline.embedded`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from pipeline.config import build, check_at_least, check_choice, raise_if
from repro.build import CorpusSpec, PretrainSpec, StudentSpec, TeacherSpec

MAIN_CORPUS = "main"  # the student corpus of the corpus section (its noise share also makes the bases' mixture)


@dataclass(frozen=True)
class ArmConfig:
    """One arm: its teacher(s), student and seed set by name, its student corpus, its stage-2 overrides."""

    teacher: str | list[str] | None  # a name, or several: their scored folders go to data.folders in this order
    student: str
    seeds: str  # a seed set's name
    corpus: str = MAIN_CORPUS  # MAIN_CORPUS or a name of student_corpora
    overrides: list[str] = field(default_factory=list)  # stage-2 overrides (conf/train_student.yaml)

    @property
    def teachers(self) -> list[str]:
        """The teachers in order (METHOD §2.6)."""
        if self.teacher is None:
            return []
        return [self.teacher] if isinstance(self.teacher, str) else list(self.teacher)

    @property
    def teacher_label(self) -> str:
        """The teacher as results and run names show it: ``strong``, or ``strong+weak``."""
        return "+".join(self.teachers)

    def problems(self) -> list[str]:
        if not self.teachers:
            return ["teacher: give a teacher name or a list of them"]
        if len(set(self.teachers)) < len(self.teachers):
            return [f"teacher: {self.teachers} names a teacher twice"]
        return []


@dataclass(frozen=True)
class EvalConfig:
    completions: int  # held-out worked problems of each kind (one fixed set for every run)
    window: int  # student context for bits per byte

    def problems(self) -> list[str]:
        problems: list[str] = []
        check_at_least(problems, "completions", self.completions, 1)
        check_at_least(problems, "window", self.window, 2)
        return problems


@dataclass(frozen=True)
class DiagnoseConfig:
    """What the guided selection keeps, per base student (a report section)."""

    teacher: str
    ratio: float

    def problems(self) -> list[str]:
        return [] if 0.0 < self.ratio <= 1.0 else [f"ratio: {self.ratio} is not in (0, 1]"]


@dataclass(frozen=True)
class PowerConfig:
    """The pilot that sized the main seed set, and what the report says about it."""

    pilot_sd: float  # sd of the pilot's paired differences (bits/byte)
    pilot_seeds: int
    pilot_note: str
    delta: float  # bits/byte the main comparison should detect
    power: float
    settings_note: str | None = None  # when the settings were fixed (None: the report says nothing)

    def problems(self) -> list[str]:
        problems = [f"{name}: {getattr(self, name)} must be > 0" for name in ("pilot_sd", "delta")
                    if getattr(self, name) <= 0]
        check_at_least(problems, "pilot_seeds", self.pilot_seeds, 2)
        if not 0.0 < self.power < 1.0:
            problems.append(f"power: {self.power} is not in (0, 1)")
        return problems


@dataclass(frozen=True)
class ReproConfig:
    corpus: CorpusSpec
    teachers: dict[str, TeacherSpec]  # by name
    students: dict[str, StudentSpec]  # by name
    pretrain: PretrainSpec
    seed_sets: dict[str, list[int]]  # each seed: data order and random selection of the continual pretraining
    train_steps: int  # every arm trains on the same number of tokens
    eval: EvalConfig
    diagnose: DiagnoseConfig
    power: PowerConfig
    student_corpora: dict[str, float]  # variants of the student corpus by noise share (besides MAIN_CORPUS)
    train_overrides: list[str]  # stage-2 settings shared by every arm
    arms: dict[str, ArmConfig]  # by name (the report finds arms by their names: repro/report.py)
    artifacts_dir: str = "artifacts/repro"  # corpora, teachers, students (cached builds)
    work_dir: str = "outputs/repro"  # scored datasets and student runs (cached by recipe)
    report_dir: str = "repro-results"  # report.md, report.json, summary.md, the plots (committed)
    parallel: int = 2  # student runs at once (one CPU thread each)
    report_only: bool = False  # train nothing, report the runs already finished (marked partial)

    def corpora(self) -> list[str]:
        return [MAIN_CORPUS, *self.student_corpora]

    def noise_share(self, corpus: str) -> float:
        return float(self.corpus.noise_share if corpus == MAIN_CORPUS else self.student_corpora[corpus])

    def arms_to_run(self) -> dict[str, ArmConfig]:
        """The arms whose seed set is not empty."""
        return {name: arm for name, arm in self.arms.items() if self.seed_sets.get(arm.seeds)}

    def problems(self) -> list[str]:
        problems: list[str] = []
        if not self.arms_to_run():
            problems.append("seed_sets: no arm has a seed to run")
        for name, seeds in self.seed_sets.items():
            if not isinstance(seeds, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
                problems.append(f"seed_sets.{name}: {seeds!r} is not a list of integers")
        for name, arm in self.arms.items():
            problems += [f"arms.{name}.teacher: {t!r} is not one of {', '.join(self.teachers)}"
                         for t in arm.teachers if t not in self.teachers]
            check_choice(problems, f"arms.{name}.student", arm.student, self.students)
            check_choice(problems, f"arms.{name}.seeds", arm.seeds, self.seed_sets)
            check_choice(problems, f"arms.{name}.corpus", arm.corpus, sorted(self.corpora()))
        for name, share in self.student_corpora.items():
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
                problems.append(f"student_corpora.{name}: noise share {share} is not in [0, 1]")
        if MAIN_CORPUS in self.student_corpora:
            problems.append(f"student_corpora.{MAIN_CORPUS}: the name of the corpus section's corpus; use another")
        check_choice(problems, "diagnose.teacher", self.diagnose.teacher, self.teachers)
        check_at_least(problems, "train_steps", self.train_steps, 1)
        check_at_least(problems, "parallel", self.parallel, 1)
        return problems


# Fields holding a mapping of name -> typed entry, built entry by entry (the name is the key).
NAMED = {"teachers": TeacherSpec, "students": StudentSpec, "arms": ArmConfig}


def study_config(values: Mapping[str, Any]) -> ReproConfig:
    """The typed study from a composed config (or a plain mapping); every problem of the types, the
    values and the references between sections is reported at once (:class:`ConfigError`)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(values, DictConfig):
        values = OmegaConf.to_container(values, resolve=True)
    values = dict(values)
    problems: list[str] = []
    for key, cls in NAMED.items():
        if isinstance(values.get(key), Mapping):
            values[key] = _named(cls, values[key], key, problems)
    typed = build(ReproConfig, values, "", problems)
    raise_if(problems)
    return typed


def _named(cls: type, entries: Mapping[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    """``{name: cls(...)}``; a class with a ``name`` field gets the key as its name."""
    has_name = "name" in {f.name for f in dataclasses.fields(cls)}
    out = {}
    for name, entry in entries.items():
        if not isinstance(entry, Mapping):
            problems.append(f"{where}.{name}: {entry!r} is not a mapping")
            continue
        entry = dict(entry)
        if has_name:
            if "name" in entry:
                problems.append(f"{where}.{name}.name: unknown key (the name is the key, {name})")
                continue
            entry["name"] = name
        typed = build(cls, entry, f"{where}.{name}", problems)
        if typed is not None:
            out[name] = typed
    return out
