"""The embedded default is built deterministically and its teacher learns the clean text."""

import json

from conftest import build_micro_teacher
from storage_schemas import file_sha256


def test_tiny_teacher_build_is_deterministic_and_cached(micro_corpus, micro_teacher, tmp_path, caplog, capfd):
    with caplog.at_level("INFO", logger="pipeline.embedded.tiny_teacher"):
        again = build_micro_teacher(micro_corpus, tmp_path / "again")
    said = caplog.text
    assert "building the tiny teacher (once: later runs reuse it)" in said and "about a minute" in said
    assert "tiny teacher: step 30 of 30, training loss" in said, "progress in words"
    assert "{'loss'" not in capfd.readouterr().out, "no Trainer dicts scroll by"
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


def test_student_tokenizer_is_the_same_on_every_training_run_of_a_small_corpus():
    """On 60 pages many characters tie at the alphabet's cut; the trainer's own cut depends on a
    hash map's order, so left to it, runs differed (2130 vs 2131 pieces). Several runs in one
    process see different hash seeds too; the vocabularies and merges must be equal."""
    from pipeline.embedded.sample_corpus import generate_documents
    from pipeline.embedded.tiny_student import train_student_tokenizer

    texts = [d["text"] for d in generate_documents(60, seed=11, noise_share=0.0) if (d["text"] or "").strip()]
    runs = {train_student_tokenizer(texts, 3000).backend_tokenizer.to_str() for _ in range(4)}
    assert len(runs) == 1


def test_student_alphabet_is_the_most_frequent_characters_by_hand():
    from tokenizers import pre_tokenizers

    from pipeline.embedded.tiny_student import alphabet

    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    # counts in words "▁bb", "▁ab", "▁ca", "▁c": ▁ 4, b 3, a 2, c 2 (a before c: code point)
    assert alphabet(["bb ab ca c"], pre, 3) == ["▁", "b", "a"]
    assert alphabet(["bb ab ca c"], pre, 10) == ["▁", "b", "a", "c"]
