"""Teacher pre-flight (fetchable? safetensors?) and the .bin ways out, on tiny real checkpoints.

No network here: the Hub is either switched off (HF_HUB_OFFLINE=1), or pointed at a closed local
port, which fails the way an unreachable Hub does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.hf import TransformersScorer, load_causal_lm
from pipeline.folders.model_source import TeacherSourceError, check_teacher_source

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def teacher(model, name="t", **kw):
    return SimpleNamespace(name=name, model=str(model), revision=kw.get("revision"), tokenizer=kw.get("tokenizer"),
                           allow_bin=kw.get("allow_bin", False))


@pytest.fixture(scope="module")
def bin_teacher(micro_teacher, tmp_path_factory) -> Path:
    """The micro teacher re-saved with pickle weights only (pytorch_model.bin), as old hub repos ship."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("bin") / "micro-bin"
    out.mkdir()
    model = AutoModelForCausalLM.from_pretrained(micro_teacher)
    model.config.save_pretrained(out)
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(micro_teacher) / name, out / name)
    assert not list(out.glob("*.safetensors"))
    return out


def _losses(model_dir: Path, allow_bin: bool = False) -> np.ndarray:
    cfg = ScorerConfig(model=str(model_dir), allow_bin=allow_bin)
    ids = np.random.default_rng(0).integers(0, 300, size=50).astype(np.int32)
    return TransformersScorer(cfg, model=load_causal_lm(cfg, torch.device("cpu"))).score([ids])[0]


def test_pickle_only_teacher_is_refused_with_the_ways_out(bin_teacher):
    with pytest.raises(TeacherSourceError) as err:
        check_teacher_source(teacher(bin_teacher, name="llemma-7b"))
    message = str(err.value)
    assert "'llemma-7b'" in message and "only pickle (.bin)" in message and "\n" not in message
    assert 'make convert-teacher ARGS="teacher=llemma-7b"' in message and "teacher.allow_bin=true" in message
    with pytest.raises(OSError, match="safetensors|model.safetensors"):
        load_causal_lm(ScorerConfig(model=str(bin_teacher)), torch.device("cpu"))


def test_allow_bin_loads_the_same_weights(bin_teacher, micro_teacher):
    check_teacher_source(teacher(bin_teacher, allow_bin=True))
    np.testing.assert_array_equal(_losses(bin_teacher, allow_bin=True), _losses(micro_teacher))


def test_convert_teacher_writes_a_safetensors_copy(bin_teacher, micro_teacher, tmp_path):
    out = tmp_path / "converted"
    result = subprocess.run(
        [sys.executable, "-m", "stages.convert_teacher", "teacher=tiny", f"teacher.model={bin_teacher}",
         f"out_dir={out}", f"hydra.run.dir={tmp_path}/logs"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"teacher.model={out}" in result.stdout
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    for name in TOKENIZER_FILES:  # byte for byte: a re-saved tokenizer can differ
        assert (out / name).read_bytes() == (bin_teacher / name).read_bytes()
    check_teacher_source(teacher(out))  # safetensors: no flag needed
    np.testing.assert_array_equal(_losses(out), _losses(micro_teacher))


def test_missing_local_folder_and_invalid_ids_are_one_line_errors(micro_teacher, tmp_path):
    with pytest.raises(TeacherSourceError, match=r"^teacher.model: no such local file or folder: .*nope$"):
        check_teacher_source(teacher(tmp_path / "nope"))
    with pytest.raises(TeacherSourceError, match=r"^teacher.tokenizer: no such local file or folder: \./nope$"):
        check_teacher_source(teacher(micro_teacher, tokenizer="./nope"))
    with pytest.raises(TeacherSourceError, match="neither a local folder nor a valid hub id"):
        check_teacher_source(teacher("not a/valid id"))  # one slash: read as a hub id (two would be a path)


def test_a_cached_hub_teacher_passes_offline(micro_teacher, tmp_path, monkeypatch):
    """A Hugging Face cache laid out by hand (refs/main -> snapshots/<commit>/...) is found without
    network."""
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--org--micro" / "snapshots" / ("a" * 40)
    shutil.copytree(micro_teacher, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    check_teacher_source(teacher("org/micro", revision="main"))
    with pytest.raises(TeacherSourceError, match=r"org/micr0 is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        check_teacher_source(teacher("org/micr0", revision="main"))


def test_an_unreachable_hub_is_one_request_and_one_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(TeacherSourceError) as err:
        check_teacher_source(teacher("Qwen/Qwen2.5-Math-7B-Instruct", name="qwen2.5-math-7b-instruct", revision="main"))
    message = str(err.value)
    assert message.startswith("teacher 'qwen2.5-math-7b-instruct' (Qwen/Qwen2.5-Math-7B-Instruct): the Hugging Face Hub "
                              "could not be reached")
    assert "teacher.model=" in message and "HF_HUB_OFFLINE=1" in message and "\n" not in message


def test_score_teacher_with_a_typo_hub_id_offline_exits_2_with_one_line(micro_corpus, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "VOCAGNO_TRACEBACK": ""}
    result = subprocess.run(
        [sys.executable, "-m", "stages.score_teacher", "teacher=qwen2.5-math-7b-instruct",
         "teacher.model=Qwen/Qwen2.5-Math-7B-Instrukt", "data=open-web-math", "data.source=files",
         f"data.files=[{micro_corpus[0]}]", f"output_root={tmp_path}/out", f"hydra.run.dir={tmp_path}/logs"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: teacher 'qwen2.5-math-7b-instruct' (Qwen/Qwen2.5-Math-7B-Instrukt): ")
    assert "not in the Hugging Face cache" in lines[0] and "teacher.model=" in lines[0]
    assert not (tmp_path / "out").exists(), "nothing is written before the teacher is found"
