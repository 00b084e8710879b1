"""make repro's several-teacher arms: the plumbing from an arm to the stage-2 job, and the report's
comparisons and default-picking rule on hand-made results (values worked out by hand below)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import stages.train_student  # noqa: F401  (registers the stage-2 defaults the repro composes)
from repro.__main__ import tasks
from repro.config import study_config
from repro.report import summarize
from repro.teachers_report import choose_default, detectable_difference, teacher_arms, write_teachers_report
from stages.common import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SCORED = {("strong", "main"): "/data/scored/strong/v1", ("weak", "main"): "/data/scored/weak/v1",
          ("strong", "noise0"): "/data/scored/strong0/v1", ("strong", "noise25"): "/data/scored/strong25/v1"}


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("repro", overrides=["seed_sets.main=[]", "seed_sets.sweep=[7]", "seed_sets.bbpe=[7]",
                                           f"work_dir={tmp_path}", *overrides])


def test_an_arm_of_two_teachers_trains_on_both_folders_in_order(tmp_path):
    cfg = _cfg(tmp_path, "+arms.weak_first={teacher: [weak, strong], student: spm, seeds: sweep, "
                         "overrides: ['loss.combine=max']}")
    study = study_config(cfg)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        by_arm = {t.arm: t for t in tasks(study, SCORED, {"spm": "/m/spm", "bbpe": "/m/bbpe"}, ["held out"])}
    strong, weak = SCORED["strong", "main"], SCORED["weak", "main"]
    expected = {"teachers_min": ("min", None), "teachers_mean": ("mean", None), "teachers_max": ("max", None),
                "teachers_weighted": ("weighted", [0.75, 0.25])}
    for arm, (combine, weights) in expected.items():
        job = by_arm[arm].job
        assert job.data.folders == [strong, weak], arm
        assert (job.alignment.combine, job.alignment.teacher_weights) == (combine, weights), arm
        assert by_arm[arm].teacher == "strong+weak" and job.data.seed == 7 and job.train.seed == 7
    assert by_arm["weak_first"].job.data.folders == [weak, strong]  # the listed order, not a sorted one
    assert by_arm["weak_first"].job.alignment.combine == "max"
    # a one-teacher arm is unchanged: one folder, the default combine (ignored with one teacher)
    assert by_arm["bbpe_guided"].job.data.folders == [strong] and by_arm["bbpe_guided"].teacher == "strong"
    assert by_arm["bbpe_guided"].job.alignment.combine == "min"


def test_a_bad_teacher_list_is_refused_with_the_arm_named(tmp_path):
    cfg = _cfg(tmp_path, "arms.teachers_min.teacher=[strong,nobody]", "arms.teachers_max.teacher=[weak,weak]",
               "arms.teachers_mean.teacher=[]", "arms.teachers_weighted.teacher=null")
    with pytest.raises(ConfigError) as err:
        study_config(cfg)
    text = str(err.value)
    assert "arms.teachers_min.teacher: 'nobody' is not one of strong, weak" in text
    assert "arms.teachers_max.teacher: ['weak', 'weak'] names a teacher twice" in text
    assert "arms.teachers_mean.teacher: give a teacher name or a list of them" in text
    assert "arms.teachers_weighted.teacher: give a teacher name or a list of them" in text


def _results(offsets: dict[str, list[float]]) -> list[dict]:
    """guided at 1.50, 1.40, 1.45 bits/byte on seeds 100-102; every other arm = guided + its offsets."""
    base = [1.50, 1.40, 1.45]
    combine = {"teachers_min": "min", "teachers_mean": "mean", "teachers_max": "max", "teachers_weighted": "weighted"}
    out = [{"arm": "guided", "seed": 100 + i, "teacher": "strong", "student": "spm", "mode": "guided", "ratio": 0.4,
            "noise_share": 0.5, "bits_per_byte": b, "scored_folder": "/s/strong/v1", "last_log": {"kept_fraction": 0.4}}
           for i, b in enumerate(base)]
    for arm, offs in offsets.items():
        for i, (b, o) in enumerate(zip(base, offs)):
            out.append({"arm": arm, "seed": 100 + i, "teacher": "strong+weak", "student": "spm", "mode": "guided",
                        "ratio": 0.4, "noise_share": 0.5, "bits_per_byte": b + o, "scored_folder": "/s/strong/v1",
                        "scored_folders": ["/s/strong/v1", "/s/weak/v1"], "combine": combine[arm],
                        "teacher_weights": [0.75, 0.25] if arm == "teachers_weighted" else None,
                        "last_log": {"kept_fraction": 0.4, "decided_t0": 0.8 + 0.05 * i, "selection_jaccard_t0_t1": 0.5}})
    return out


def test_the_default_moves_only_to_a_mode_that_beats_it(tmp_path):
    # min - guided = +0.010, +0.012, +0.011: worse than the strong teacher alone (CI above zero);
    # mean - min = -0.020, -0.021, -0.019: mean -0.020, sd 0.001, half-width 4.3027 * 0.001 / sqrt(3) = 0.002484;
    # weighted - min = -0.0300, -0.0301, -0.0299: holds with the largest gain, but weighted needs weights, so is
    # never the default; max - min = -0.03, +0.03, 0: inconclusive
    mins = [0.010, 0.012, 0.011]
    offsets = {"teachers_min": mins, "teachers_mean": [m + d for m, d in zip(mins, [-0.020, -0.021, -0.019])],
               "teachers_max": [m + d for m, d in zip(mins, [-0.03, 0.03, 0.0])],
               "teachers_weighted": [m + d for m, d in zip(mins, [-0.0300, -0.0301, -0.0299])]}
    results = _results(offsets)
    assert teacher_arms(results)["teachers_weighted"] == {"combine": "weighted", "teacher_weights": [0.75, 0.25],
                                                          "teacher": "strong+weak"}
    assert "guided" not in teacher_arms(results)
    arms = summarize(results)
    choice = choose_default(arms, {"min": "teachers_min", "mean": "teachers_mean", "max": "teachers_max",
                                   "weighted": "teachers_weighted"})
    assert choice["default"] == "mean" and choice["changed"]
    assert choice["tests"]["weighted"]["ci"][1] < choice["tests"]["mean"]["ci"][0]  # weighted did better, still not picked
    t = choice["tests"]["mean"]
    assert t["mean"] == pytest.approx(-0.020, abs=1e-9) and t["sd"] == pytest.approx(0.001, abs=1e-9)
    assert t["ci"] == pytest.approx([-0.020 - 0.002484, -0.020 + 0.002484], abs=2e-6)
    assert t["seeds"] == [100, 101, 102]

    record = write_teachers_report(results, {"finished": "x", "machine": "m", "power": {"power": 0.8, "sized": {
        "main": {"claims": [1], "delta": 0.01, "pilot_sd": {"guided - cpt": 0.0134}, "pilot_seeds": [0, 1, 2], "pilot_note": "n"}}}},
        tmp_path)
    on_disk = json.loads((tmp_path / "teachers.json").read_text())
    assert on_disk["default_choice"]["default"] == "mean"
    vs = on_disk["vs_strong"]["teachers_min"]
    assert vs["mean"] == pytest.approx(0.011, abs=1e-9) and vs["ci"][0] > 0  # min loses to the strong teacher alone
    md = (tmp_path / "teachers.md").read_text()
    assert "| teachers_min - guided | +0.0110" in md and "**does not hold**" in md
    assert "**Default: `mean`**" in md
    assert on_disk["arms"]["teachers_min"]["per_teacher_last_log"]["decided_t0"] == pytest.approx([0.8, 0.85, 0.9])
    assert record["power"]["detectable"] == pytest.approx(0.0415, abs=2e-4)


def test_the_default_stays_as_a_prior_when_nothing_is_decided(tmp_path):
    # mean - min = -0.03, +0.03, -0.004: a lower mean (-0.0013) but an interval across zero; max - min: mean 0
    results = _results({"teachers_min": [0.0, 0.0, 0.0], "teachers_mean": [-0.03, 0.03, -0.004],
                        "teachers_max": [0.02, -0.02, 0.0]})
    choice = choose_default(summarize(results), {"min": "teachers_min", "mean": "teachers_mean", "max": "teachers_max"})
    assert choice["default"] == "min" and not choice["changed"]
    assert "against `mean`, `max` the comparison is inconclusive" in choice["reason"]
    assert "as a prior, not a result" in choice["reason"] and "a result;" not in choice["reason"]
    assert write_teachers_report([r for r in results if r["arm"] == "guided"], {}, tmp_path) is None
    assert not (tmp_path / "teachers.md").exists()


def test_detectable_difference_by_hand():
    # t(0.975, 2) = 4.3027 and the one-sided 80% quantile t(0.80, 2) = 1.0607 (tables):
    # (4.3027 + 1.0607) * 0.0134 / sqrt(3) = 0.04149
    assert detectable_difference(0.0134, 3, 0.8) == pytest.approx(0.04149, abs=1e-4)
    # 17 seeds: t(0.975, 16) = 2.1199, t(0.80, 16) = 0.8647 -> 2.9846 * 0.0134 / sqrt(17) = 0.00970
    assert detectable_difference(0.0134, 17, 0.8) == pytest.approx(0.00970, abs=1e-4)
    assert math.isinf(detectable_difference(0.0134, 1))
