"""The embedded default is built deterministically and its teacher learns the clean text."""

import json

from conftest import build_micro_teacher
from storage_schemas import file_sha256


def test_tiny_teacher_build_is_deterministic_and_cached(micro_corpus, micro_teacher, tmp_path):
    again = build_micro_teacher(micro_corpus, tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert file_sha256(again / name) == file_sha256(micro_teacher / name), f"{name} differs between builds"
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert build_micro_teacher(micro_corpus, again) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime, "a cached build is not retrained"


def test_tiny_teacher_loss_means_something(micro_teacher):
    """Trained only on clean text: held-out clean text scores far better than before training."""
    stamp = json.loads((micro_teacher / "_BUILD.json").read_text())
    assert stamp["final_train_loss"] < stamp["uniform_loss"]
    before, after = stamp["eval_loss_before"]["clean_held_out"], stamp["eval_loss_after"]["clean_held_out"]
    assert after < before - 0.5, (before, after)
