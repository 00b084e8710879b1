"""The power rule for the sized seed sets: the pilot's paired sds, the seeds they ask for, the
allotment under the study's run budget, and the config's checks on pilots."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import repro.__main__  # noqa: F401  (registers the study's typed defaults)
import stages.train_student  # noqa: F401  (registers the stage-2 defaults the repro composes)
from pipeline.runtime.config import ConfigError
from repro.config import study_config
from repro.power import allot_seeds, paired_sd, pilot_record
from repro.report import detectable_difference, power_markdown, seeds_needed, sizing, summarize

ROOT = Path(__file__).resolve().parents[2]


def _study(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return study_config(compose("repro", overrides=list(overrides)))


def test_allotment_gives_every_need_when_it_fits_and_one_common_cap_when_not():
    assert allot_seeds({"a": 17, "b": 5}, {"a": 6, "b": 2}, budget=200) == ({"a": 17, "b": 5}, None)
    # 6 * 17 + 2 * 5 = 112 > 76: the cap c is the largest with 6 * min(17, c) + 2 * min(5, c) <= 76
    got, cap = allot_seeds({"a": 17, "b": 5}, {"a": 6, "b": 2}, budget=76)
    assert (got, cap) == ({"a": 11, "b": 5}, 11)
    assert 6 * 11 + 2 * 5 <= 76 < 6 * 12 + 2 * 5
    got, cap = allot_seeds({"a": 17, "b": 17}, {"a": 6, "b": 2}, budget=76)
    assert (got, cap) == ({"a": 9, "b": 9}, 9)  # 8 * 9 = 72 <= 76 < 80
    assert allot_seeds({"a": 17}, {"a": 6}, budget=3)[0] == {"a": 2}  # never below two seeds (no interval with one)


def test_paired_sd_by_hand():
    rows = [{"arm": a, "seed": s, "bits_per_byte": v} for a, s, v in
            [("g", 0, 1.0), ("g", 1, 1.1), ("g", 2, 1.3), ("c", 0, 1.1), ("c", 1, 1.1), ("c", 2, 1.2), ("c", 9, 5.0)]]
    p = paired_sd(rows, "g", "c")
    assert p["seeds"] == [0, 1, 2] and p["diffs"] == pytest.approx([-0.1, 0.0, 0.1])
    assert p["mean"] == pytest.approx(0.0, abs=1e-12) and p["sd"] == pytest.approx(0.1)
    assert paired_sd(rows[:1] + rows[3:4], "g", "c") is None  # one shared seed: no sd


def _study_before_the_pilot():
    """The study as it stood before its pilot ran: the ablation and byte-level sets' sds unknown (null)."""
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        values = OmegaConf.to_container(compose("repro"), resolve=True)
    for name in ("ablation", "bbpe"):
        sized = values["power"]["sized"][name]
        sized["pilot_sd"] = dict.fromkeys(sized["pilot_sd"])
        sized.pop("fits", None)
    return study_config(values)


def test_pilot_record_sizes_the_pending_sets_from_the_pilot_sds():
    study = _study_before_the_pilot()
    j = {0: 0.0, 1: 0.01, 2: -0.005}
    rows = []
    for seed, jitter in j.items():  # guided - X: sd 0.01 * |pattern|; bbpe: sd 0.004
        for arm, shift, spread in [("guided", 0.0, 0.0), ("cpt", 0.01, 1.0), ("guided_weak_teacher", 0.05, 1.0),
                                   ("chunk_32", 0.02, 0.5), ("chunk_4", 0.03, 1.5), ("unmapped_exclude", 0.0, 0.1),
                                   ("aggregate_mean", 0.01, 1.0), ("aggregate_min", 0.02, 1.0),
                                   ("bbpe_guided", 0.0, 0.0), ("bbpe_cpt", 0.01, 0.4)]:
            rows.append({"arm": arm, "seed": seed, "bits_per_byte": 1.5 + shift + spread * jitter,
                         "steps": 1, "tokens_trained": 1})
    record = pilot_record(rows, study, {"main": 2, "ablation": 6, "bbpe": 2}, other_runs=94,
                          limits={"ablation": 17, "bbpe": 17})
    sets = record["sets"]
    assert sets["main"]["sized_before"] and "seeds_allotted" not in sets["main"]  # claim 1's seeds stay as fixed
    sd = sets["ablation"]["comparisons"]["guided - chunk_4"]["sd"]
    assert sd == pytest.approx(1.5 * 0.0076376, rel=1e-4)  # sd of (0, 0.01, -0.005) times 1.5
    assert sets["ablation"]["comparisons"]["guided - chunk_4"]["seeds_needed"] == seeds_needed(round(sd, 4), 0.01)
    assert sets["ablation"]["seeds_needed"] == max(c["seeds_needed"] for c in sets["ablation"]["comparisons"].values())
    need_a, need_b = sets["ablation"]["seeds_needed"], sets["bbpe"]["seeds_needed"]
    expected, _ = allot_seeds({"ablation": min(need_a, 17), "bbpe": min(need_b, 17)}, {"ablation": 6, "bbpe": 2},
                              study.power.max_runs - 94)
    assert {k: sets[k]["seeds_allotted"] for k in expected} == expected


def test_the_report_states_what_the_rule_asked_and_what_ran():
    setup = {"seed_sets": {"ablation": [100, 101, 102]}, "power": {"power": 0.8, "sized": {"ablation": {
        "claims": [3], "delta": 0.01, "pilot_sd": {"guided - weak": 0.0134, "guided - other": None},
        "pilot_seeds": [0, 1, 2], "pilot_note": "p"}}}}
    rows = [{"arm": a, "seed": s, "teacher": "t", "student": "s", "bits_per_byte": 1.0 + d + 0.001 * s}
            for s in (100, 101, 102) for a, d in (("guided", 0.0), ("weak", 0.02))]
    [s] = sizing(setup, summarize(rows))
    assert s["seeds_needed"] == 17 and s["seeds"] == 3 and s["fits"] is None
    assert s["rows"][0]["achieved_n"] == 3 and s["rows"][1]["seeds_needed"] is None
    assert s["detectable_at_worst_sd"] == pytest.approx(detectable_difference(0.0134, 3))
    setup["power"]["sized"]["ablation"]["fits"] = 3
    text = power_markdown(setup, summarize(rows))
    assert "The rule asks for 17 seeds; **only 3 fit in the study's time (power.max_runs) and ran**" in text
    assert "| guided - weak | 0.0134 | 17 | 0.0000 (3) | 0.0000 |" in text and "| guided - other | not run | - | - (0) | - |" in text


def test_pilot_seeds_must_be_no_seed_of_the_study():
    with pytest.raises(ConfigError) as err:
        _study("seed_sets.sweep=[2,100]")
    assert any("power.sized.ablation.pilot_seeds: [2] also in a seed set" in p for p in err.value.problems)
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        values = OmegaConf.to_container(compose("repro"), resolve=True)
    values["power"]["sized"]["bbpe"]["pilot_sd"] = {"bbpe_guided - nobody": 0.01}
    study_config(values)  # a quick look may drop arms: a comparison's arm is checked for the pilot only
    values["pilot"] = True
    values["power"]["sized"]["nothing"] = {"claims": [9], "delta": 0.01, "pilot_sd": {}, "pilot_seeds": [0]}
    with pytest.raises(ConfigError) as err:
        study_config(values)
    assert "power.sized.bbpe.pilot_sd.bbpe_guided - nobody: 'nobody' is not an arm" in err.value.problems
    assert any(p.startswith("power.sized.nothing: not a seed set") for p in err.value.problems)


def test_the_pilot_runs_the_sized_sets_on_their_pilot_seeds_only():
    pilot = _study().as_pilot()
    assert pilot.seed_sets == {"main": [0, 1, 2], "sweep": [], "ablation": [0, 1, 2], "bbpe": [0, 1, 2]}
    arms = set(pilot.arms_to_run())
    assert arms == {"guided", "cpt", "guided_weak_teacher", "chunk_32", "chunk_4", "unmapped_exclude",
                    "aggregate_mean", "aggregate_min", "bbpe_guided", "bbpe_cpt"}


def test_a_part_keeps_its_seed_sets_and_reports_outside_the_committed_report():
    study = _study("part=ablations", "work_dir=/w")
    part = study.as_part()
    ablation = [100, 101, 102, 103, 104, 105, 106, 107, 108]  # conf/repro.yaml's ablation set
    assert part.seed_sets == {"main": ablation, "sweep": [], "ablation": ablation, "bbpe": []}
    assert part.report_dir == "/w/parts/ablations" and study.report_dir == "repro-results"
    # guided and cpt on the 9 ablation seeds (18 runs) and the 6 ablation arms (54): claims 3-5 pair with guided
    assert sum(len(part.seed_sets[a.seeds]) for a in part.arms_to_run().values()) == 72
    assert set(_study("part=byte_level").as_part().arms_to_run()) == {"bbpe_guided", "bbpe_cpt"}
    with pytest.raises(ConfigError) as err:
        _study("part=claim9", "pilot=true", "+parts.claim1.nobody=[1]")
    assert "part: 'claim9' is not one of ablations, byte_level, claim1, sweep; did you mean claim1?" in err.value.problems
    assert any(p.startswith("part: a part is a piece of the study, the pilot is not") for p in err.value.problems)
    assert any(p.startswith("parts.claim1.nobody: not a seed set") for p in err.value.problems)

