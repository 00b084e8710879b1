"""``make gpu-bench`` in its smoke mode on CPU (the real run needs a GPU): it runs where only torch,
transformers, accelerate and pyarrow exist, writes the JSON and Markdown, and its FLOP and MFU
arithmetic equals a count worked out by hand."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ABSENT = ("ray", "polars", "hydra", "datasets", "omegaconf")

# A module set to None in sys.modules is absent for Python: importing it raises
# ModuleNotFoundError and importlib.util.find_spec() returns None, as on a machine without it.
RUN_WITHOUT = f"""
import runpy, sys
for name in {ABSENT!r}:
    sys.modules[name] = None
sys.argv = ["benchmarks.gpu", *sys.argv[1:]]
runpy.run_module("benchmarks.gpu", run_name="__main__")
loaded = sorted(n for n in sys.modules if n.split(".")[0] in {ABSENT!r} and sys.modules[n] is not None)
assert not loaded, loaded
"""

PEAK_TFLOPS = 2.0

# Hand-worked PaLM counts for the smoke shapes (hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128):
# per layer q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12,288 and MLP 3*64*128 = 24,576: 36,864; two layers 73,728.
# teacher: head 64*512 = 32,768 -> 106,496 linear weights; forward at T=64: 2*106,496 + 4*2*64*64 = 245,760
# student: head 64*384 = 24,576 -> 98,304; forward 2*98,304 + 32,768 = 229,376; training step 3x = 688,128
TEACHER_FORWARD, STUDENT_STEP = 245_760, 688_128


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-bench") / "gpu-smoke"
    run = subprocess.run([sys.executable, "-c", RUN_WITHOUT, "--smoke", "--peak-tflops", str(PEAK_TFLOPS),
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(out.with_suffix(".json").read_text())
    report["_markdown"] = out.with_suffix(".md").read_text()
    return report


def test_smoke_runs_without_ray_polars_hydra_datasets_omegaconf(smoke_report):
    assert smoke_report["mode"] == "smoke" and smoke_report["machine"]["device_type"] == "cpu"
    assert {"scoring", "training", "data", "vllm", "figures"} <= set(smoke_report)
    assert "| measure | value | target | status |" in smoke_report["_markdown"]
    keys = {f["key"] for f in smoke_report["figures"]}
    assert {"scorer_over_bare", "scorer_mfu", "bare_forward_mfu", "guided_over_cpt", "cpt_mfu", "guided_mfu",
            "data_tokens_per_core", "cores_per_gpu"} <= keys
    assert "skipped" in smoke_report["vllm"] or "tokens_per_s" in smoke_report["vllm"]


def test_flop_counts_equal_the_hand_worked_ones(smoke_report):
    assert smoke_report["scoring"]["flops_per_token"]["forward"] == TEACHER_FORWARD
    assert smoke_report["training"]["flops_per_token"]["train_step"] == STUDENT_STEP


@pytest.mark.parametrize("part,key,flops", [("scoring", "scorer", TEACHER_FORWARD),
                                            ("scoring", "bare_forward", TEACHER_FORWARD),
                                            ("training", "guided", STUDENT_STEP), ("training", "cpt", STUDENT_STEP)])
def test_mfu_is_tokens_per_second_times_flops_over_the_peak(smoke_report, part, key, flops):
    side = smoke_report[part][key]
    tokens = (smoke_report[part]["tokens_per_repeat"] if part == "scoring"
              else smoke_report["training"]["micro_batch"][0] * smoke_report["training"]["micro_batch"][1])
    tokens_per_s = tokens / statistics.median(side["seconds"])
    assert side["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-12)
    assert side["mfu"] == pytest.approx(tokens_per_s * flops / (PEAK_TFLOPS * 1e12), rel=1e-12)
    by_key = {f["key"]: f["value"] for f in smoke_report["figures"]}
    assert by_key[f"{key}_mfu"] == side["mfu"]


def test_ratios_and_cores_follow_from_the_raw_timings(smoke_report):
    sc, tr, da = smoke_report["scoring"], smoke_report["training"], smoke_report["data"]
    paired = [b / s for b, s in zip(sc["bare_forward"]["seconds"], sc["scorer"]["seconds"])]
    assert sc["scorer_over_bare"]["median"] == pytest.approx(statistics.median(paired))
    paired = [g / c for g, c in zip(tr["guided"]["seconds"], tr["cpt"]["seconds"])]
    assert tr["guided_over_cpt"]["median"] == pytest.approx(statistics.median(paired))
    assert da["tokens_per_cpu_second"] == pytest.approx(da["packed_tokens"] / statistics.median(da["cpu_seconds"]))
    by_key = {f["key"]: f["value"] for f in smoke_report["figures"]}
    assert by_key["cores_per_gpu"] == pytest.approx(tr["guided"]["tokens_per_s"] / da["tokens_per_cpu_second"])
    assert da["packed_tokens"] > 0 and da["packed_tokens"] % da["seq_len"] == 0


def test_full_shapes_match_the_published_parameter_counts():
    """The vLLM child counts FLOPs from the config alone; at the real shapes that count must give the
    published sizes: Qwen2.5-7B 6.53B non-embedding parameters (its model card; the output head is
    not tied there, so it is not counted either), TinyLlama 1.1B in all."""
    from benchmarks.gpu import SHAPES, _linear_parameters

    qwen = SHAPES["qwen2.5-7b"]
    non_embedding = _linear_parameters(qwen) - qwen["hidden_size"] * qwen["vocab_size"]
    assert non_embedding == pytest.approx(6.53e9, rel=0.005)
    tiny = SHAPES["tinyllama-1.1b"]
    total = _linear_parameters(tiny) + tiny["hidden_size"] * tiny["vocab_size"]  # + the input embedding
    assert total == pytest.approx(1.1e9, rel=0.01)


def test_config_count_equals_the_model_count(smoke_report):
    from benchmarks.gpu import SHAPES, _linear_parameters

    assert _linear_parameters(SHAPES["smoke-teacher"]) == smoke_report["scoring"]["flops_per_token"]["linear_parameters"]
    assert _linear_parameters(SHAPES["smoke-student"]) == smoke_report["training"]["flops_per_token"]["linear_parameters"]
