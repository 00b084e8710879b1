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

from pipeline.runtime.config import build, check_at_least, check_choice, raise_if
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
    """What the guided selection keeps, per base student, over the corpus; and per arm of the
    selection-ratio sweep on the batches stage 2 forms (claim 7). Report sections."""

    teacher: str
    ratio: float
    batches: int = 16  # claim 7: micro-batches per sweep seed on which each arm's selection is diagnosed

    def problems(self) -> list[str]:
        problems = [] if 0.0 < self.ratio <= 1.0 else [f"ratio: {self.ratio} is not in (0, 1]"]
        check_at_least(problems, "batches", self.batches, 1)
        return problems


@dataclass(frozen=True)
class SizedSet:
    """A seed set sized by the power rule (repro/report.py ``seeds_needed``): the claims it decides,
    the effect each of their comparisons should detect (stated before its pilot ran), and the
    pilot's sd of each comparison's seed-paired differences (null until the pilot has run)."""

    claims: list[int]
    delta: float  # bits/byte every comparison of these claims should detect with the stated power
    pilot_sd: dict[str, float | None]  # "A - B" (arm names) -> sd of the pilot's paired differences
    pilot_seeds: list[int]  # the seeds the pilot ran (never a seed of any seed set)
    pilot_note: str = ""  # what the pilot was, in words
    fits: int | None = None  # seeds the study's time allows for this set (null: no cap); the report says when the rule asked more

    def comparisons(self) -> list[tuple[str, str]]:
        return [tuple(key.split(" - ", 1)) for key in self.pilot_sd]  # type: ignore[misc]

    def problems(self) -> list[str]:
        problems = [] if self.delta > 0 else [f"delta: {self.delta} must be > 0"]
        problems += [f"pilot_sd.{key}: not of the form 'A - B' (two arm names)" for key in self.pilot_sd
                     if len(key.split(" - ")) != 2]
        problems += [f"pilot_sd.{key}: {sd} must be > 0 (or null before the pilot)" for key, sd in self.pilot_sd.items()
                     if sd is not None and not (isinstance(sd, (int, float)) and sd > 0)]
        if self.fits is not None:
            check_at_least(problems, "fits", self.fits, 2)
        return problems


@dataclass(frozen=True)
class PowerConfig:
    """How the seed sets were sized (the pilots, the effect sizes, the power) and what the report
    says about when the settings were fixed."""

    power: float  # the probability of a "holds" the sizing aims at when the true difference is delta
    sized: dict[str, SizedSet]  # seed set name -> its sizing
    max_runs: int | None = None  # student runs the default study's time allows (the pilot's allotment, repro/power.py)
    settings_note: str | None = None  # when the settings were fixed (None: the report says nothing)

    def problems(self) -> list[str]:
        problems = [] if 0.0 < self.power < 1.0 else [f"power: {self.power} is not in (0, 1)"]
        if self.max_runs is not None:
            check_at_least(problems, "max_runs", self.max_runs, 1)
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
    parts: dict[str, dict[str, list[int]]]  # named parts a user can run alone: the seed sets each keeps
    artifacts_dir: str = "artifacts/repro"  # corpora, teachers, students (cached builds)
    work_dir: str = "outputs/repro"  # scored datasets and student runs (cached by recipe)
    report_dir: str = "repro-results"  # report.md, report.json, summary.md, the plots (committed)
    parallel: int = 2  # student runs at once (one CPU thread each)
    report_only: bool = False  # train nothing, report the runs already finished (marked partial)
    pilot: bool = False  # run the sized seed sets' arms on their pilot seeds only and write pilot.json (repro/power.py)
    part: str | None = None  # run one of ``parts`` alone; its report goes to <work_dir>/parts/<part>, not report_dir

    def corpora(self) -> list[str]:
        return [MAIN_CORPUS, *self.student_corpora]

    def noise_share(self, corpus: str) -> float:
        return float(self.corpus.noise_share if corpus == MAIN_CORPUS else self.student_corpora[corpus])

    def arms_to_run(self) -> dict[str, ArmConfig]:
        """The arms whose seed set is not empty."""
        return {name: arm for name, arm in self.arms.items() if self.seed_sets.get(arm.seeds)}

    def as_pilot(self) -> "ReproConfig":
        """The pilot: every sized seed set replaced by its pilot seeds, every other set emptied."""
        sets = {name: list(self.power.sized[name].pilot_seeds) if name in self.power.sized else []
                for name in self.seed_sets}
        return dataclasses.replace(self, seed_sets=sets)

    def as_part(self) -> "ReproConfig":
        """One named part: its seed sets as the part gives them, every other set emptied; its report
        in ``<work_dir>/parts/<part>`` so that the committed report (``report_dir``) stays the whole
        study's. Its runs are cached like the whole study's, so a later ``make repro`` reuses them."""
        keep = self.parts[self.part]
        sets = {name: list(keep[name]) if name in keep else [] for name in self.seed_sets}
        return dataclasses.replace(self, seed_sets=sets, report_dir=f"{self.work_dir}/parts/{self.part}")

    def _part_problems(self) -> list[str]:
        problems: list[str] = []
        for name, keep in self.parts.items():
            if not isinstance(keep, Mapping):
                problems.append(f"parts.{name}: {keep!r} is not a mapping of seed set -> seeds")
                continue
            problems += [f"parts.{name}.{k}: not a seed set (one of {', '.join(self.seed_sets)})"
                         for k in keep if k not in self.seed_sets]
            problems += [f"parts.{name}.{k}: {v!r} is not a list of integers" for k, v in keep.items()
                         if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                        for x in v)]
        if self.part is not None:
            check_choice(problems, "part", self.part, sorted(self.parts))
            if self.pilot:
                problems.append("part: a part is a piece of the study, the pilot is not; set one of part, pilot")
        return problems

    def _power_problems(self) -> list[str]:
        problems: list[str] = []
        used = {s for seeds in self.seed_sets.values() if isinstance(seeds, (list, tuple)) for s in seeds}
        for name, sized in self.power.sized.items():
            where = f"power.sized.{name}"
            if name not in self.seed_sets:
                problems.append(f"{where}: not a seed set (one of {', '.join(self.seed_sets)})")
            for a, b in sized.comparisons() if self.pilot else ():  # a quick look may drop arms; a pilot needs them
                problems += [f"{where}.pilot_sd.{a} - {b}: {x!r} is not an arm" for x in (a, b) if x not in self.arms]
            if set(sized.pilot_seeds) & used:
                problems.append(f"{where}.pilot_seeds: {sorted(set(sized.pilot_seeds) & used)} also in a seed set; "
                                "a pilot's seeds are never the study's")
        return problems

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
        problems += self._power_problems() + self._part_problems()
        check_choice(problems, "diagnose.teacher", self.diagnose.teacher, self.teachers)
        check_at_least(problems, "train_steps", self.train_steps, 1)
        check_at_least(problems, "parallel", self.parallel, 1)
        return problems


# Fields holding a mapping of name -> typed entry, built entry by entry (the name is the key).
NAMED = {"teachers": TeacherSpec, "students": StudentSpec, "arms": ArmConfig}
NAMED_IN = {("power", "sized"): SizedSet}  # the same, one level down


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
    for (outer, key), cls in NAMED_IN.items():
        if isinstance(values.get(outer), Mapping) and isinstance(values[outer].get(key), Mapping):
            values[outer] = {**values[outer], key: _named(cls, values[outer][key], f"{outer}.{key}", problems)}
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
