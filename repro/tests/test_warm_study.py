"""``make repro-real`` (the warm study, repro/warm.py) end to end at the smallest size: the split into
warm-up, tuning, training and held-out text, the teacher's scoring of the training and held-out text
(the micro teacher here), the warm-up through stage 2 on a rehearsal-scored folder, the sweep, the
seeds from the pilot, the comparison, the endpoints and the report; then what a rerun, a plan and a
report of fewer runs do."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from repro.realtext import RealCorpusConfig

SHARED_MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "models"


@pytest.fixture(scope="module")
def texts_dir(micro_corpus, tmp_path_factory):
    """Two sources in the real collection's columns: forum posts (two answers share each question's
    url) and word problems in GSM8K's layout (question, blank line, answer; train and test ids)."""
    from pipeline.embedded.sample_corpus import clean_texts

    folder = tmp_path_factory.mktemp("realtext")
    texts = clean_texts(micro_corpus)
    forum = [{"id": f"forum-{i}", "text": t, "source": "repo@c:forum", "license": "CC", "url": f"q/{i // 2}"}
             for i, t in enumerate(texts[0::2])]
    gsm = [{"id": f"gsm8k-{'test' if i % 3 == 0 else 'train'}-{i}",
            "text": t[:120].replace("\n", " ") + "?\n\n" + t[120:400], "source": "repo@c:gsm8k", "license": "MIT",
            "url": None} for i, t in enumerate(texts[1::2])]
    pq.write_table(pa.Table.from_pylist(forum), folder / "forum.parquet")
    pq.write_table(pa.Table.from_pylist(gsm), folder / "gsm8k.parquet")
    return folder


def small_study(texts_dir, micro_teacher, tmp_path):
    from repro.warm import WarmStudent, WarmStudyConfig, WarmUpSpec

    return WarmStudyConfig(
        realtext_dir=str(texts_dir), work_dir=str(tmp_path / "work"), report_dir=str(tmp_path / "report"),
        artifacts_dir=str(tmp_path / "artifacts"), parallel=2, install_teacher=False,
        corpus=RealCorpusConfig(files=["forum.parquet", "gsm8k.parquet"], group_by="url",
                                held_out_evaluation_only=["gsm8k"], train_chars={"forum": 30_000, "gsm8k": 10_000},
                                held_out_chars=5_000, held_out_share=0.15, tune_share=0.1, tune_chars=3_000,
                                warmup_chars={"forum": 20_000, "gsm8k": 8_000}),
        teacher=[f"teacher.model={micro_teacher}", "teacher.name=micro", "teacher.embedded=false", "teacher.window=64",
                 "ray.num_cpus=1", "pool.num_actors=1"],
        warmup_teacher=["teacher=rehearsal-qwen2.5", f"teacher.model={micro_teacher}", "teacher.window=64",
                        "ray.num_cpus=1", "pool.num_actors=1"],
        students={"stories": WarmStudent(model=str(SHARED_MODELS / "stories260K"), seq_len=128, micro_batch_size=4,
                                         warmup=WarmUpSpec(steps=5, learning_rate=1e-3, min_learning_rate=1e-4,
                                                           eval_every=2))},
        branch_overrides=["train.lr_scheduler=cosine", "train.warmup_steps=1", "train.logging_steps=1",
                          "train.cpu_threads=1", "data.num_workers=0", "train.eval_every=null", "train.max_steps=3",
                          "data.token_ratio_bound=4.0"],
        arms={"cpt": ["loss.mode=cpt"], "guided": ["loss.mode=guided"],
              "no_bytes": ["loss.mode=guided", "loss.byte_fallback=exclude"]},
        learning_rates=[1e-4, 3e-3], rates_below=[3e-5], sweep_seeds=[100, 101],
        endpoints={e: e for e in ("overall", "teacher_easy", "teacher_hard", "gsm8k_answers")},
        comparisons=[["guided", "cpt", -1], ["no_bytes", "guided", -1]],
        sizing={"delta": 0.5, "power": 0.8, "min_seeds": 2, "max_seeds": 2})


@pytest.mark.long
def test_the_warm_study_runs_end_to_end_resumes_and_never_loses_a_report(texts_dir, micro_teacher, tmp_path, capsys):
    from hydra import initialize_config_dir

    from repro.warm import run_study
    from stages.common import CONF_DIR

    if not (SHARED_MODELS / "stories260K" / "config.json").is_file():
        pytest.skip("stories260K is not in the shared folder")
    study = small_study(texts_dir, micro_teacher, tmp_path)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        record = run_study(study)
        results = record["results"]
        extra = sum(1 for r in results if r["learning_rate"] == 3e-5)  # an arm whose best was 1e-4 tried 3e-5
        assert len(results) == 3 * 2 * 2 + extra + 3 * 2 and extra % 2 == 0  # the sweep, then 3 arms x 2 seeds
        # a rerun trains nothing: every run is found by its recipe
        again = run_study(study)
        assert [r["seconds"] for r in again["results"]] == [r["seconds"] for r in results]
        # a report of the finished runs reads the grids as they grew (the rates below included)
        only = run_study(dataclasses.replace(study, report_only=True))
        assert [r["key"] for r in only["results"]] == [r["key"] for r in results]

        stories = record["students"]["stories"]
        # the warm-up: 5 steps of cpt, tuning bits per byte at steps 2 and 4 (and the end), every branch from it
        assert [c["step"] for c in stories["warmup"]["curve"]][:2] == [2, 4]
        warm = Path(study.work_dir) / "warmup" / "stories" / "final"
        assert warm.is_dir()
        # each arm's rate is the lowest mean tuning bits per byte over the sweep seeds, recomputed here
        for arm, chosen in stories["rates"].items():
            tried = {r["learning_rate"] for r in results if r["phase"] == "sweep" and r["arm"] == arm}
            means = {lr: statistics.fmean(r["tune_bits_per_byte"] for r in results if r["phase"] == "sweep"
                                          and r["arm"] == arm and r["learning_rate"] == lr) for lr in tried}
            assert chosen["learning_rate"] == min(means, key=means.get)
            assert all(r["learning_rate"] == chosen["learning_rate"] for r in results
                       if r["phase"] == "compare" and r["arm"] == arm)
        assert stories["pilot"]["seeds"] == [0, 1]

        for r in results:
            # the endpoints partition the held-out text's tokens: easy + hard + unmapped = all of them
            parts = [r[p] for p in ("teacher_easy", "teacher_hard", "unmapped")]
            assert math.isclose(sum(p["nats"] for p in parts), r["nats"], rel_tol=1e-9)
            assert sum(p["bytes"] for p in parts) <= r["bytes"] + 1e-6
            assert r["teacher_easy"]["tokens"] > 0 and r["teacher_hard"]["tokens"] > 0
            assert 0 < r["gsm8k_answers"]["bytes"] < r["per_source"]["gsm8k"]["bytes"]
            assert math.isclose(r["bits_per_byte"], sum(s["nats"] for s in r["per_source"].values()) / math.log(2)
                                / sum(s["bytes"] for s in r["per_source"].values()))
            sel = r["selection"]
            if r["arm"] == "no_bytes":  # byte pieces are kept out of the ranking, hence all trained (unmapped=include)
                assert sel["byte_share_left"]["mean"] == 0
            if r["arm"] == "cpt":
                assert sel["kept_fraction"]["mean"] == 1 and "student_loss_left" not in sel

        claim = record["analysis"]["stories"]["claims"][0]
        by = {(r["arm"], r["seed"]): r for r in results if r["phase"] == "compare"}
        for endpoint in study.endpoints:
            key = (lambda r: r["bits_per_byte"]) if endpoint == "overall" else (lambda r, e=endpoint: r[e]["bits_per_byte"])
            diffs = [key(by["guided", s]) - key(by["cpt", s]) for s in (0, 1)]
            assert claim["endpoints"][endpoint]["diffs"] == pytest.approx(diffs)
        report = (Path(study.report_dir) / "report.md").read_text()
        assert "Reproduce: `make repro-real`" in report and "| guided | cpt |" in report and "### Warm-up" in report

        # a plan lists every run, trains nothing and writes nothing
        before = sorted(p for p in Path(study.work_dir).rglob("*") if p.is_file())
        capsys.readouterr()
        run_study(dataclasses.replace(study, plan=True))
        plan = capsys.readouterr().out
        assert plan.count("done  sweep") == 12 + extra and plan.count("done  compare") == 6 and "0 runs to do" in plan
        assert sorted(p for p in Path(study.work_dir).rglob("*") if p.is_file()) == before

        # a report of fewer runs (one seed of the sweep) never replaces the one that holds more
        saved = (Path(study.report_dir) / "report.json").read_text()
        fewer = dataclasses.replace(study, report_only=True, sweep_seeds=[100, 102])
        run_study(fewer)
        assert (Path(study.report_dir) / "report.json").read_text() == saved
        partial = json.loads((Path(study.report_dir) / "partial" / "report.json").read_text())
        # seed 102 never ran, so no rate's sweep is finished and no grid grows: the design's 2 rates x 3 arms
        assert len(partial["results"]) == 6 < len(json.loads(saved)["results"])


def test_a_pretrained_student_is_recorded_with_its_own_shape():
    """stories260K is dim 64, 5 layers, 8 heads, 4 KV heads (llama2.c's model card); a report records
    that, never the new-model fields' defaults (4 layers, 4 heads)."""
    from repro.real import StudentSpec
    from repro.warm_report import recorded_student

    if not (SHARED_MODELS / "stories260K" / "config.json").is_file():
        pytest.skip("stories260K is not in the shared folder")
    spec = dataclasses.asdict(StudentSpec(model=str(SHARED_MODELS / "stories260K"), seq_len=512))
    shape = recorded_student(spec)
    assert (shape["hidden_size"], shape["layers"], shape["heads"], shape["kv_heads"]) == (64, 5, 8, 4)
    new = dataclasses.asdict(StudentSpec(tokenizer="t", hidden_size=128, layers=4, heads=4))
    assert recorded_student(new) == new  # a new model's shape is its spec


def test_an_arm_whose_best_rate_is_on_an_edge_tries_the_next_rate_out():
    """The grid of one arm as the sweep grows it, worked by hand: the best on the low edge adds the
    first of rates_below, then the next while it stays best; on the high edge rates_above; an inner
    best stops the growth; an unfinished rate stops it too."""
    from repro.warm import WarmStudyConfig, arm_grid, choose_rates

    study = WarmStudyConfig(learning_rates=[3e-4, 1e-3, 3e-3], rates_below=[1e-4, 3e-5], rates_above=[1e-2],
                            sweep_seeds=[0, 1], arms={"a": []})

    def runs(values: dict[float, float], seeds=(0, 1)) -> list[dict]:
        return [{"phase": "sweep", "student": "s", "arm": "a", "learning_rate": lr, "seed": s, "tune_bits_per_byte": v}
                for lr, v in values.items() for s in seeds]

    assert arm_grid(study, "s", "a", []) == [3e-4, 1e-3, 3e-3]
    assert arm_grid(study, "s", "a", runs({3e-4: 1.0, 1e-3: 1.1})) == [3e-4, 1e-3, 3e-3]  # 3e-3 unfinished
    low = {3e-4: 1.0, 1e-3: 1.1, 3e-3: 1.2}
    assert arm_grid(study, "s", "a", runs(low)) == [1e-4, 3e-4, 1e-3, 3e-3]
    assert arm_grid(study, "s", "a", runs({**low, 1e-4: 0.9})) == [3e-5, 1e-4, 3e-4, 1e-3, 3e-3]
    assert arm_grid(study, "s", "a", runs({**low, 1e-4: 1.05})) == [1e-4, 3e-4, 1e-3, 3e-3]  # 3e-4 inner: stop
    everything = runs({**low, 1e-4: 0.9, 3e-5: 0.8})
    assert choose_rates(study, "s", everything)["a"] == {
        "learning_rate": 3e-5, "edge": True,  # the lowest with no rate left below
        "tune_means": {"3e-05": 0.8, "0.0001": 0.9, "0.0003": 1.0, "0.001": 1.1, "0.003": 1.2}}
    assert arm_grid(study, "s", "a", runs({3e-4: 1.2, 1e-3: 1.1, 3e-3: 1.0})) == [3e-4, 1e-3, 3e-3, 1e-2]
    assert "a" not in choose_rates(study, "s", runs(low, seeds=(0,)))  # one seed of two: not finished


def test_a_student_amends_the_design_for_itself_alone():
    """for_student, worked by hand: a student's arms keep only the comparisons among them; its rates,
    edges and seed bounds replace the study's; its branch settings come after the study's; a student
    without amendments runs the study as it is; an arm or sizing key that does not exist is refused."""
    from repro.warm import WarmStudent, WarmStudyConfig, for_student

    arms = {"cpt": ["loss.mode=cpt"], "guided": ["loss.mode=guided"], "per_seq": ["loss.rank_over=sequence"]}
    study = WarmStudyConfig(
        learning_rates=[3e-4, 1e-3], rates_below=[1e-4], rates_above=[1e-2], sweep_seeds=[0, 1], arms=arms,
        comparisons=[["guided", "cpt", -1], ["guided", "per_seq", -1]], branch_overrides=["a=1"],
        sizing={"delta": 0.005, "power": 0.8, "min_seeds": 5, "max_seeds": 10},
        students={"plain": WarmStudent(tokenizer="t"),
                  "amended": WarmStudent(tokenizer="t", arms=["cpt", "guided"], learning_rates=[3e-5],
                                         rates_below=[], branch_overrides=["b=2"], sizing={"max_seeds": 6})})
    plain = for_student(study, "plain")
    assert (plain.arms, plain.comparisons, plain.learning_rates, plain.branch_overrides, plain.sizing) == (
        study.arms, study.comparisons, study.learning_rates, study.branch_overrides, study.sizing)
    amended = for_student(study, "amended")
    assert list(amended.arms) == ["cpt", "guided"]
    assert amended.comparisons == [["guided", "cpt", -1]]
    assert (amended.learning_rates, amended.rates_below, amended.rates_above) == ([3e-5], [], [1e-2])
    assert amended.branch_overrides == ["a=1", "b=2"]
    assert amended.sizing == {"delta": 0.005, "power": 0.8, "min_seeds": 5, "max_seeds": 6}
    wrong = dataclasses.replace(study, students={"x": WarmStudent(tokenizer="t", arms=["nope"], sizing={"seeds": 3})})
    problems = wrong.problems()
    assert any("students.x.arms: nope" in p for p in problems) and any("students.x.sizing: seeds" in p for p in problems)
