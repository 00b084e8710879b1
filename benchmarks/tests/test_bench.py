"""The bench runs at tiny sizes and reports in the right shape. No timing is asserted: these tests
check that every case measures something and says so, never how fast anything is."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import CASES

REPO = Path(__file__).resolve().parents[2]


def _check_figures(result: dict, keys: set[str]) -> None:
    figures = {f["key"]: f for f in result["figures"]}
    assert keys <= set(figures)
    for key in keys:
        f = figures[key]
        assert f["status"] in ("pass", "miss", "info"), f
        assert isinstance(f["value"], float) and math.isfinite(f["value"]) and f["value"] > 0, f
        assert f["note"]


def test_figure_status_and_miss_factor():
    from benchmarks.results import figure

    assert figure("a", "a", 0.04, 0.05, "<=")["status"] == "pass"
    missed = figure("a", "a", 0.10, 0.05, "<=")
    assert missed["status"] == "miss" and missed["miss_factor"] == pytest.approx(2.0)
    assert figure("b", "b", 50.0, 100.0, ">=")["miss_factor"] == pytest.approx(2.0)
    assert figure("c", "c", 1.0)["status"] == "info"
    assert figure("d", "d", None, 1.0, "<=")["status"] == "error"


def test_interleaved_alternates_and_ratio_pairs_repetitions():
    from benchmarks.measure import interleaved, ratio

    order = []
    samples = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3, warmup=1)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert all(len(s.wall) == len(s.cpu) == 3 for s in samples.values())
    r = ratio([2.0, 4.0, 6.0], [1.0, 1.0, 2.0])
    assert r["median"] == 3.0 and r["min"] == 2.0 and r["max"] == 4.0 and r["of_minima"] == 2.0


def test_dtw_pairs_identical_sequences_one_to_one():
    from benchmarks.dtw import dtw_cells, dtw_path, levenshtein

    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3
    assert dtw_path(["a", "b", "c"], ["a", "b", "c"]) == [[0], [1], [2]]
    assert dtw_path(["ab", "c"], ["a", "b", "c"])[1] == [2]
    assert dtw_cells([10, 4000], [8, 3000], chunk=2048) == 80 + 2 * 2000 * 1500


def test_alignment_case_quick(real_tokenizer):
    from benchmarks.alignment import AlignmentBenchConfig, run

    cfg = AlignmentBenchConfig(min_bytes=20_000, repeats=1, warmup=0, dtw_docs=1, dtw_budget_s=1.0, profile=False)
    result = run(cfg, real_tokenizer("llama-spm"), real_tokenizer("qwen2"))
    _check_figures(result, {"alignment_cost", "alignment_vs_dtw"})
    assert result["texts"]["bytes"] >= 20_000
    assert result["align_documents_exact"]  # the batched path gives align_document's answer


def test_storage_and_student_data_cases_quick(micro_scored, real_tokenizer, tmp_path):
    from benchmarks.storage import StorageBenchConfig
    from benchmarks.storage import run as run_storage
    from benchmarks.student_data import StudentDataBenchConfig
    from benchmarks.student_data import run as run_student

    storage = run_storage(StorageBenchConfig(max_shards=2, levels=[3], object_store_repeats=1), tmp_path, micro_scored)
    _check_figures(storage, {"storage_default", "storage_compact", "object_store_write", "object_store_read"})
    assert storage["object_store"]["rows"] == storage["documents"]  # both sides read back every row
    assert {s["kind"] for s in storage["settings"]} == {"current", "schema change"}
    compact = next(s for s in storage["settings"] if s["name"] == "compact")
    assert set(compact["columns_bytes_per_token"]) >= {"doc_id", "text", "token_ids", "starts", "ends", "losses"}

    cfg = StudentDataBenchConfig(max_shards=2, repeats=1, warmup=0, seq_len=64)
    student = run_student(cfg, tmp_path, real_tokenizer("llama-spm"), micro_scored)
    _check_figures(student, {"student_data"})
    assert student["delivered_tokens"]["pipeline"] > 0


def test_guided_loss_case_quick():
    from benchmarks.guided_loss import GuidedLossBenchConfig, run
    from benchmarks.inputs import RandomModelShape

    cfg = GuidedLossBenchConfig(model=RandomModelShape(hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2),
                                vocab_size=256, batch_size=2, seq_len=16, repeats=2, loss_repeats=2, warmup=0)
    _check_figures(run(cfg), {"guided_loss_overhead"})


def test_held_out_eval_case_quick(tiny_student, micro_scored, tmp_path):
    """Both parts on the micro student and data: the speed sides see the same tokens, and the cost
    part reads the recipe's evaluation steps from a real run's metrics."""
    from benchmarks.held_out_eval import HeldOutEvalBenchConfig, embedded_recipe, held_out_documents
    from benchmarks.held_out_eval import measure_cost, measure_speed

    cfg = HeldOutEvalBenchConfig(repeats=1, warmup=0, train_steps=4, eval_every=2)
    texts = held_out_documents(micro_scored, 4)
    speed = measure_speed(cfg, tiny_student, texts, batch_size=2)
    _check_figures({"figures": [speed["figure"]]}, {"held_out_eval_speed"})
    assert speed["tokens"] > 0 and speed["window"] == 63  # the micro student's context minus one
    recipe = embedded_recipe()
    assert recipe["train"]["eval_every"] and recipe["train"]["lr_scheduler"] == "wsd"
    recipe["student"]["seq_len"] = 32  # the micro student's context is 64
    cost = measure_cost(cfg, recipe, tiny_student, texts, micro_scored, tmp_path)
    _check_figures({"figures": [cost["figure"]]}, {"held_out_eval_cost"})
    assert len(cost["eval_seconds"]) == 2 and cost["recipe_evaluations"] == 4  # steps 2 and 4; 50..200


def test_threads_case_quick():
    from benchmarks.threads import ThreadsBenchConfig, run

    result = run(ThreadsBenchConfig(threads=2, batch_size=2, block=16, repeats=2, warmup=0))
    _check_figures(result, {"threads_as_is", "threads_busy"})
    assert result["threads"] == 2 and set(result["load_average"]) == {"as_is", "busy"}


def test_report_files_have_the_table(tmp_path):
    from benchmarks.measure import machine_info
    from benchmarks.results import figure, write_report

    report = {"mode": "quick", "machine": machine_info(), "seconds": 1.0, "cases": {},
              "figures": [figure("x", "a measure", 0.5, 1.0, "<=", note="n|ote"), figure("y", "other", float("nan"))]}
    json_path, md_path = write_report(report, tmp_path)
    loaded = json.loads(json_path.read_text())
    assert loaded["figures"][0]["status"] == "pass" and loaded["figures"][1]["value"] is None
    md = md_path.read_text()
    assert "| a measure | 0.500 | <= 1.000 | pass | n\\|ote |" in md


def _compose_bench(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    import benchmarks.__main__  # noqa: F401  (registers bench_defaults)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="bench", overrides=overrides)


def test_bench_config_composes_and_quick_sizes_apply():
    from benchmarks.config import QUICK_SIZES, BenchConfig, bench_config

    full, quick = bench_config(_compose_bench([])), bench_config(_compose_bench(["quick=true"]))
    assert full == BenchConfig()  # the YAML sets no setting: the typed defaults are the full run's
    assert full.alignment.min_bytes >= 2**20
    assert quick.alignment.min_bytes == QUICK_SIZES["alignment"]["min_bytes"] < full.alignment.min_bytes
    assert quick.stage1.model.hidden_size < full.stage1.model.hidden_size
    assert quick.stage1.model.context == full.stage1.model.context  # merged key by key
    assert full.storage.levels == [3, 19] and quick.storage.levels == [3]
    assert full.teachers.repeats == full.student_data.repeats  # the teachers case extends student_data's


def test_bench_config_reports_every_problem_at_once():
    from benchmarks.config import bench_config
    from pipeline.runtime.config import ConfigError

    cfg = _compose_bench(["cases=[alignment,storag]", "alignment.repeats=0", "memory.workloads=[stage1,train2]",
                          "stage1.model.num_heads=5", "teachers.combine=median"])
    with pytest.raises(ConfigError) as caught:
        bench_config(cfg)
    assert sorted(p.split(":")[0] for p in caught.value.problems) == [
        "alignment.repeats", "cases", "memory.workloads", "stage1.model.num_heads", "teachers.combine"]


def test_bench_command_line_with_an_unknown_key_exits_2(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks", "alignment.repeat=3", "storage.levels=[0]",
                          f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "alignment.repeat: unknown key; did you mean alignment.repeats?" in run.stderr
    assert "storage.levels: 0 is not a zstd level" in run.stderr


@pytest.mark.slow
def test_make_bench_quick_writes_json_and_markdown(tmp_path):
    """The whole quick bench, as ``make bench ARGS="quick=true"`` runs it (Ray, subprocesses)."""
    cmd = [sys.executable, "-m", "benchmarks", "quick=true", f"out_dir={tmp_path}", f"work_dir={tmp_path / 'work'}",
           "scored_docs=20"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True, timeout=1800)
    report = json.loads((tmp_path / "latest.json").read_text())
    assert set(report["cases"]) == set(CASES)
    for f in report["figures"]:
        assert f["status"] in ("pass", "miss", "info"), f
        if f["note"].startswith("skipped"):  # vllm_backend without .venv-vllm
            continue
        assert f["value"] is not None and f["value"] > 0
    assert "| measure | value | target | status |" in (tmp_path / "latest.md").read_text()


def test_vllm_backend_case_is_skipped_with_a_note_without_its_environment(tmp_path):
    from benchmarks.vllm_backend import VLLMBackendBenchConfig, breakeven, run

    result = run(VLLMBackendBenchConfig(python=str(tmp_path / "no-venv" / "python")), tmp_path, "teacher", [])
    assert result["skipped"].startswith("skipped:") and "make setup-vllm" in result["skipped"]
    assert [f["status"] for f in result["figures"]] == ["info"] * 3 and all(f["value"] is None for f in result["figures"])
    # both take as long at N tokens: 40 s + N / 25,000 = 0 s + N / 5,000 -> N = 250,000
    assert breakeven({"start_s": 0.0, "steady_tokens_per_s": 5000.0}, {"start_s": 40.0, "steady_tokens_per_s": 25000.0}) \
        == pytest.approx(250_000)


def test_export_data_case_quick(micro_scored, tiny_student, tmp_path):
    from benchmarks.export_data import ExportDataBenchConfig, run
    from pipeline.method.tokenization import load_tokenizer

    cfg = ExportDataBenchConfig(max_shards=2, seq_len=32, rows_per_shard=32, repeats=1, warmup=0)
    result = run(cfg, tmp_path, tiny_student, load_tokenizer(str(tiny_student)), micro_scored)
    _check_figures(result, {"export_data_speedup", "export_data_first_run"})
    assert result["identical_batches"] and result["samples_per_pass"] > 32


def test_the_cases_read_scored_data_the_bench_made_with_float32_losses(micro_teacher, ray_local, monkeypatch, tmp_path):
    """The storage, student-data, teachers and export cases measure a scored dataset each bench run
    makes in its work folder, with the teacher's float32 losses, never a folder found on disk (a
    default stage-1 run's bfloat16 losses would make "plain float32" storage look 40% smaller).
    The embedded tiny teacher is replaced by the micro one, a smaller real model built in seconds."""
    import benchmarks.__main__ as bench
    import pipeline.embedded

    from benchmarks.config import BenchConfig
    from storage_schemas import read_manifest

    monkeypatch.setattr(pipeline.embedded, "ensure_tiny_teacher", lambda artifacts: micro_teacher)
    cfg = BenchConfig(work_dir=str(tmp_path / "work"), scored_docs=30, scored_rows_per_shard=10, scored_stride=32)
    folder = bench.Inputs(cfg).scored_dataset()
    manifest = read_manifest(folder)
    assert folder.is_relative_to(tmp_path / "work") and manifest["complete"]
    assert manifest["identity"]["loss_precision"] == "float32" and len(manifest["shards"]) == 3
    assert manifest["totals"]["documents"] >= 25  # 30 sample rows, a few of them null texts
