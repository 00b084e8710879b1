"""``make gpu-bench`` in its smoke mode on CPU (the real run needs a GPU): it runs where only torch,
transformers, accelerate, pyarrow, Hydra, OmegaConf and gguf (and what they require) exist, every
part in a child process of its own, writes the JSON and Markdown, and its FLOP and MFU arithmetic
equals a count worked out by hand; its trained-teacher part stores what an independent forward of
the same weights gives."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What a bare GPU machine has (with Hydra's wheels carried there: make gpu-bench-wheels). The smoke
# run sees these distributions and what they require, nothing else: links to them in one folder,
# Python started with -S (no site-packages), the repository on PYTHONPATH.
PRESENT = ("torch", "transformers", "accelerate", "pyarrow", "numpy", "hydra-core", "omegaconf", "gguf")
NOT_NEEDED = ("ray", "polars", "datasets", "pandas")


def _name(distribution: str) -> str:
    return distribution.lower().replace("_", "-").replace(".", "-")


def requirement_closure(names) -> dict:
    """The installed distributions ``names`` and everything they require (extras left out), by name."""
    from importlib import metadata

    from packaging.requirements import Requirement

    found, todo = {}, [_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name not in found:
            found[name] = metadata.distribution(name)
            for line in found[name].requires or []:
                req = Requirement(line)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    todo.append(_name(req.name))
    return found


def bare_site_packages(folder: Path) -> Path:
    """A folder of links to the files of :data:`PRESENT`'s requirement closure, and nothing else."""
    folder.mkdir(parents=True)
    for dist in requirement_closure(PRESENT).values():
        root = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or [] if Path(f).parts[0] != ".."}:
            if not (folder / top).exists() and (root / top).exists():
                (folder / top).symlink_to(root / top)
    return folder


PEAK_TFLOPS = 2.0

# Hand-worked PaLM counts for the smoke shapes (hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128):
# per layer q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12,288 and MLP 3*64*128 = 24,576: 36,864; two layers 73,728.
# teacher: head 64*512 = 32,768 -> 106,496 linear weights; forward at T=64: 2*106,496 + 4*2*64*64 = 245,760
# student: head 64*384 = 24,576 -> 98,304; forward 2*98,304 + 32,768 = 229,376; training step 3x = 688,128
TEACHER_FORWARD, STUDENT_STEP = 245_760, 688_128


def trained_stand_in(folder: Path) -> Path:
    """A tiny Llama and a byte-level BPE tokenizer saved as a model folder, for the trained-teacher
    part (the real run gives a real one: SmolLM2-135M's GGUF file)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.inputs import math_texts
    from pipeline.embedded.tiny_teacher import train_tokenizer

    tokenizer = train_tokenizer(math_texts(40_000), 400)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.3)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def real_inputs(tmp_path_factory) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    work = tmp_path_factory.mktemp("real")
    texts = ["Let $x^2 = 4$; then x = 2 or x = -2. " * 9, "A group G is abelian when ab = ba.", "∑ 1/n² = π²/6"]
    pq.write_table(pa.table({"text": texts}), work / "pages.parquet")
    return trained_stand_in(work / "teacher"), work / "pages.parquet"


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory, real_inputs) -> dict:
    work = tmp_path_factory.mktemp("gpu-bench")
    out = work / "gpu-smoke"
    teacher, text = real_inputs
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{bare_site_packages(work / 'site-packages')}"}
    run = subprocess.run([sys.executable, "-S", "-m", "benchmarks.gpu", "smoke=true", f"peak_tflops={PEAK_TFLOPS}",
                          f"out={out}", f"hydra.run.dir={work / 'logs'}", f"real_teacher={teacher}",
                          f"real_text=[{text}]"],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(out.with_suffix(".json").read_text())
    report["_markdown"] = out.with_suffix(".md").read_text()
    report["_losses"] = out.parent / f"{out.name}-real-losses.parquet"
    return report


def test_the_bare_machine_has_no_ray_polars_datasets_pandas():
    assert not set(requirement_closure(PRESENT)) & set(NOT_NEEDED)


@pytest.mark.long
def test_smoke_runs_on_the_bare_machine(smoke_report):
    assert smoke_report["mode"] == "smoke" and smoke_report["machine"]["device_type"] == "cpu"
    assert {"scoring", "real_shape", "precision", "real_teacher", "training", "data", "vllm", "figures"} <= set(smoke_report)
    assert "| measure | value | target | status |" in smoke_report["_markdown"]
    keys = {f["key"] for f in smoke_report["figures"]}
    assert {"scorer_over_bare_teacher_w32", "scorer_over_bare_teacher_w64", "scorer_mfu_teacher_w64",
            "bare_forward_mfu_teacher_w64", "scorer_over_bare_real_shape_w64", "precision_flip_share",
            "real_teacher_flip_share", "real_teacher_p99_abs", "guided_over_cpt", "cpt_mfu", "guided_mfu",
            "data_tokens_per_core", "cores_per_gpu"} <= keys
    assert not [f for f in smoke_report["figures"] if f["status"] == "error"]
    assert "skipped" in smoke_report["vllm"] or "tokens_per_s" in smoke_report["vllm"]


@pytest.mark.long
def test_flop_counts_equal_the_hand_worked_ones(smoke_report):
    assert smoke_report["scoring"]["by_window"]["64"]["flops_per_token"]["forward"] == TEACHER_FORWARD
    # at T=32 only the attention term changes: 4 * 2 layers * 64 wide * 32 less
    assert smoke_report["scoring"]["by_window"]["32"]["flops_per_token"]["forward"] == TEACHER_FORWARD - 16_384
    assert smoke_report["training"]["flops_per_token"]["train_step"] == STUDENT_STEP


@pytest.mark.parametrize("part,key,flops", [("scoring", "scorer", TEACHER_FORWARD),
                                            ("scoring", "bare_forward", TEACHER_FORWARD),
                                            ("training", "guided", STUDENT_STEP), ("training", "cpt", STUDENT_STEP)])
@pytest.mark.long
def test_mfu_is_tokens_per_second_times_flops_over_the_peak(smoke_report, part, key, flops):
    sc = smoke_report["scoring"]["by_window"]["64"]
    side = sc[key] if part == "scoring" else smoke_report[part][key]
    tokens = (sc["tokens_per_repeat"] if part == "scoring"
              else smoke_report["training"]["micro_batch"][0] * smoke_report["training"]["micro_batch"][1])
    tokens_per_s = tokens / statistics.median(side["seconds"])
    assert side["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-12)
    assert side["mfu"] == pytest.approx(tokens_per_s * flops / (PEAK_TFLOPS * 1e12), rel=1e-12)
    by_key = {f["key"]: f["value"] for f in smoke_report["figures"]}
    assert by_key[f"{key}_mfu" + ("_teacher_w64" if part == "scoring" else "")] == side["mfu"]


@pytest.mark.long
def test_ratios_and_cores_follow_from_the_raw_timings(smoke_report):
    sc, tr, da = smoke_report["scoring"]["by_window"]["64"], smoke_report["training"], smoke_report["data"]
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


@pytest.mark.long
def test_config_count_equals_the_model_count(smoke_report):
    from benchmarks.gpu import SHAPES, _linear_parameters

    assert (_linear_parameters(SHAPES["smoke-teacher"])
            == smoke_report["scoring"]["by_window"]["64"]["flops_per_token"]["linear_parameters"])
    assert _linear_parameters(SHAPES["smoke-student"]) == smoke_report["training"]["flops_per_token"]["linear_parameters"]


def test_settings_are_checked_all_at_once(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "smoke=true", "skip=[vllm,trainng]", "dtype=bf16",
                          "repeats=0", "peak_tflop=1", f"hydra.run.dir={tmp_path}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    for line in ("skip: 'trainng' is not one of", "dtype: 'bf16' is not one of", "repeats: 0 must be >= 1",
                 "peak_tflop: unknown key; did you mean peak_tflops?"):
        assert line in run.stderr, (line, run.stderr)
    assert not list(tmp_path.glob("*.json"))


def test_a_part_child_is_started_with_its_task_as_a_setting(tmp_path):
    """Each part runs in a child process (``part_child=<task file>``); its command line is one the
    entry point accepts."""
    from hydra import compose, initialize_config_dir

    import benchmarks.gpu as gpu
    from stages.common import CONF_DIR, check_command_line

    cmd = gpu.part_command(tmp_path / "scoring-task.json", tmp_path, "scoring")
    assert cmd[0] == sys.executable and cmd[-5:-3] == ["-m", "benchmarks.gpu"]
    args = check_command_line(CONF_DIR, "gpu_bench", cmd[-3:], gpu.gpu_bench_config)  # raises on any problem
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("gpu_bench", overrides=[a for a in args if not a.startswith("hydra.")])
    assert gpu.gpu_bench_config(cfg).part_child == str(tmp_path / "scoring-task.json")


def test_a_part_that_hangs_is_stopped_and_the_next_still_runs(tmp_path, monkeypatch):
    """A part past its time limit is killed with its children and recorded; the run goes on."""
    import benchmarks.gpu as gpu

    hang = [sys.executable, "-c", "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"]
    monkeypatch.setattr(gpu, "part_command", lambda task, work, name: hang)
    t0 = __import__("time").perf_counter()
    result = gpu.run_part("scoring", {}, tmp_path, limit_s=2, smoke=False)
    assert __import__("time").perf_counter() - t0 < 20
    assert result["error"] == "scoring: stopped at its time limit of 2 s"


@pytest.mark.long
def test_the_trained_teacher_losses_equal_an_independent_forward(smoke_report, real_inputs):
    """The part's stored float32 losses (stage 1's path) against a float64 forward of the same
    weights over each document's own window plan worked out here (window 64, stride 32)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    teacher, text = real_inputs
    model = LlamaForCausalLM.from_pretrained(teacher, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    stored = pq.read_table(smoke_report["_losses"]).to_pylist()
    texts = pq.read_table(text)["text"].to_pylist()
    assert [r["doc_id"] for r in stored] == [f"pages.parquet:{i}" for i in range(len(texts))]
    window, stride = 64, 32
    for row, doc in zip(stored, texts):
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        assert row["ids"] == ids
        want = np.full(len(ids), np.nan)
        for p in range(1, len(ids)):  # the first window reaching p starts at k * stride
            start = 0 if p < window else ((p - window) // stride + 1) * stride
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids[start:p]])).logits[0, -1]
            want[p] = -torch.log_softmax(logits, -1)[ids[p]].item()
        got = np.asarray(row["loss_float32"], dtype=np.float64)
        assert np.isnan(got[0]) and np.abs(got[1:] - want[1:]).max() < 1e-4
        assert np.abs(np.asarray(row["loss_bfloat16"][1:]) - want[1:]).max() < 1.0
    rt = smoke_report["real_teacher"]
    assert rt["differences"]["tokens"] == sum(len(r["ids"]) for r in stored)
    assert rt["files"]["pages.parquet"]["documents"] == len(texts)


@pytest.mark.long
def test_merging_two_runs_keeps_each_part_and_refuses_two_devices(smoke_report, tmp_path):
    import benchmarks.gpu as gpu

    first = {k: v for k, v in smoke_report.items() if not k.startswith("_") and k not in ("training", "data")}
    second = {k: v for k, v in smoke_report.items() if not k.startswith("_") and k not in ("scoring",)}
    second["real_teacher"] = {"error": "real_teacher: stopped at its time limit of 1 s"}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, report in zip(paths, (first, second)):
        path.write_text(json.dumps(report))
    merged = gpu.merge_reports([str(p) for p in paths])
    assert merged["scoring"] == smoke_report["scoring"] and merged["training"] == smoke_report["training"]
    assert merged["real_teacher"] == smoke_report["real_teacher"]  # a later failure does not replace a result
    assert merged["seconds"] == pytest.approx(first["seconds"] + second["seconds"])
    other = {**second, "machine": {**second["machine"], "device": "NVIDIA H200"}}
    paths[1].write_text(json.dumps(other))
    with pytest.raises(gpu.ConfigError, match="different devices"):
        gpu.merge_reports([str(p) for p in paths])


@pytest.mark.long
def test_the_cross_check_finds_a_planted_difference_and_refuses_other_text(smoke_report, real_inputs, tmp_path):
    """The losses file scored again here: a loss moved by 0.25 nats in the stored file is found as
    such (the rest agree: the same machine and path), and a changed document is refused by name."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import benchmarks.gpu as gpu

    teacher, text = real_inputs
    rows = pq.read_table(smoke_report["_losses"]).to_pylist()
    rows[1]["loss_float32"][3] += 0.25
    planted = tmp_path / "planted-real-losses.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(smoke_report["_losses"])), planted)
    cfg = gpu.GpuBenchConfig(cross_check=str(planted), real_teacher=str(teacher), real_text=[str(text)],
                             cross_check_docs=5, cross_check_max_tokens=10_000)
    assert cfg.problems() == []
    result = gpu.cross_check(cfg)
    tokens = sum(len(r["ids"]) for r in rows)
    assert result["tokens"] == tokens and result["documents"] == {"pages.parquet": [r["doc_id"] for r in rows]}
    assert result["vs_float32"]["max_abs"] == pytest.approx(0.25, abs=1e-5)
    assert result["vs_float32"]["p99_abs"] < 1e-5 or tokens < 100
    other = tmp_path / "pages.parquet"
    texts = pq.read_table(text)["text"].to_pylist()
    pq.write_table(pa.table({"text": [texts[0], texts[1] + " changed", texts[2]]}), other)
    with pytest.raises(gpu.ConfigError, match=r"pages\.parquet:1"):
        gpu.cross_check(gpu.GpuBenchConfig(cross_check=str(planted), real_teacher=str(teacher),
                                           real_text=[str(other)]))
    assert "cross_check" in " ".join(gpu.GpuBenchConfig(cross_check=str(tmp_path / "none.parquet")).problems())
    assert np.isfinite(result["vs_bfloat16"]["mean_abs"])
