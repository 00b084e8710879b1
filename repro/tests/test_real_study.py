"""``make repro-real`` end to end at the smallest size: the real-text split of files in the real
collection's layout, stage 1 with a teacher (the micro teacher here: SmolLM2 takes an hour), a real
pretrained student (stories260K) and a student built from a tokenizer, stage 2 for each arm and
seed, held-out bits per byte per source, the paired tests and the report; a second invocation
trains nothing."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from repro.realtext import RealCorpusConfig

SHARED_MODELS = __import__("pathlib").Path(__file__).resolve().parents[2].parent / "shared" / "models"


@pytest.fixture(scope="module")
def texts_dir(micro_corpus, tmp_path_factory):
    """Two sources in the real collection's columns, from the micro corpus's clean pages."""
    from pipeline.embedded.sample_corpus import clean_texts

    folder = tmp_path_factory.mktemp("realtext")
    texts = clean_texts(micro_corpus)
    for k, name in enumerate(("forum", "book")):
        rows = [{"id": f"{name}-{i}", "text": t, "source": f"repo@c:{name}", "license": f"L{k}", "url": None}
                for i, t in enumerate(texts[k::2])]
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{name}.parquet")
    return folder


@pytest.mark.long
def test_the_study_runs_end_to_end_and_resumes(texts_dir, micro_teacher, tmp_path, capsys):
    from hydra import initialize_config_dir

    from repro.real import ArmSpec, RealStudyConfig, StudentSpec, run_study
    from stages.common import CONF_DIR

    if not (SHARED_MODELS / "stories260K" / "config.json").is_file():
        pytest.skip("stories260K is not in the shared folder")
    study = RealStudyConfig(
        realtext_dir=str(texts_dir), work_dir=str(tmp_path / "work"), report_dir=str(tmp_path / "report"),
        artifacts_dir=str(tmp_path / "artifacts"), parallel=2, install_teacher=False,
        corpus=RealCorpusConfig(files=["forum.parquet", "book.parquet"], train_chars={"forum": 40_000, "book": 40_000},
                                held_out_chars=6_000, held_out_share=0.15),
        teachers={"micro": [f"teacher.model={micro_teacher}", "teacher.name=micro", "teacher.embedded=false",
                            "teacher.window=64", "ray.num_cpus=1", "pool.num_actors=1"]},
        students={"stories": StudentSpec(model=str(SHARED_MODELS / "stories260K"), seq_len=128),
                  "scratch": StudentSpec(tokenizer=str(micro_teacher), seq_len=64, hidden_size=16, layers=1, heads=2)},
        train_overrides=["train.micro_batch_size=4", "train.cpu_threads=1", "data.num_workers=0",
                         "data.held_out_shards=0", "train.eval_every=null", "train.warmup_steps=1"],
        train_steps=3, seeds=[0, 1],
        arms={"cpt": ArmSpec("stories", "micro", ["loss.mode=cpt"]),
              "guided": ArmSpec("stories", "micro", ["loss.mode=guided"]),
              "scratch_guided": ArmSpec("scratch", "micro", ["loss.mode=guided"])},
        comparisons=[["guided", "cpt", -1]])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        record = run_study(study)
        assert record["runs_trained"] == 6 and record["runs_cached"] == 0 and not record["partial"]
        again = run_study(study)
    assert again["runs_trained"] == 0 and again["runs_cached"] == 6

    results = {(r["arm"], r["seed"]): r for r in record["results"]}
    assert {r["mode"] for r in record["results"]} == {"cpt", "guided"} and {r["steps"] for r in results.values()} == {3}
    for r in results.values():  # overall bits per byte is total bits over total bytes of the sources
        per = r["per_source"].values()
        assert math.isclose(r["bits_per_byte"], sum(s["bits_per_byte"] * s["bytes"] for s in per) / sum(s["bytes"] for s in per))
    (claim,) = record["claims"]
    diffs = [results["guided", s]["bits_per_byte"] - results["cpt", s]["bits_per_byte"] for s in (0, 1)]
    assert claim["overall"]["diffs"] == pytest.approx(diffs) and claim["overall"]["n"] == 2
    assert set(claim["per_source"]) == {"forum", "book"}
    assert record["corpus"]["train"]["forum"]["licenses"] == {"L0": record["corpus"]["train"]["forum"]["documents"]}
    assert set(record["base_students"]) == {"stories", "scratch"}
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| guided | cpt | a < b |" in report and "| train | book |" in report
    diagnosis = record["diagnoses"]["guided"]  # the guided arm of the comparison, on its first seed
    assert diagnosis["seed"] == 0 and set(diagnosis["trained"]) == {"base", "guided", "cpt"}
    assert diagnosis["selected"] <= diagnosis["candidates"] and diagnosis["excess"]["selected"] >= diagnosis["excess"]["rest"]
    assert "| guided (0) |" in report
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["claims"][0]["overall"]["verdict"] == claim["overall"]["verdict"]
