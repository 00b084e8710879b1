"""The embedded default is built deterministically and its teacher learns the clean text."""

import json
import logging
from types import SimpleNamespace

import torch

from pipeline.runtime.cpu_threads import torch_threads
from pipeline.embedded.tiny_teacher import ProgressLog
from storage_schemas import file_sha256


def test_tiny_teacher_build_is_deterministic_and_cached(micro_corpus, micro_teacher, micro_teacher_builder, tmp_path,
                                                       caplog, capfd):
    """Built again with another thread count set by the caller (the machine's cores, torch's default
    for the first build): the same files, as the build trains in one thread whatever the caller set."""
    other = 1 if torch.get_num_threads() > 1 else 2
    with caplog.at_level("INFO", logger="pipeline.embedded.tiny_teacher"), torch_threads(other):
        again = micro_teacher_builder(micro_corpus, tmp_path / "again")
    said = caplog.text
    assert "building the tiny teacher (once: later runs reuse it)" in said
    assert "in one torch thread (load average" in said
    assert "tiny teacher: step 30 of 30, training loss" in said and "left at this pace" in said, "progress in words"
    assert "{'loss'" not in capfd.readouterr().out, "no Trainer dicts scroll by"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert file_sha256(again / name) == file_sha256(micro_teacher / name), f"{name} differs between builds"
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert micro_teacher_builder(micro_corpus, again) == again
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


def test_the_time_left_is_the_pace_so_far_times_the_steps_left(caplog):
    """Hand-worked: 25 of 250 steps in 30 s is 1.2 s a step, so 225 steps are 270 s (4.5 min) left."""
    clock = iter([100.0, 100.0, 130.0, 400.0])
    progress = ProgressLog("tiny teacher", clock=lambda: next(clock))
    progress.on_train_begin(None, None, None)
    with caplog.at_level(logging.INFO, logger="pipeline.embedded.tiny_teacher"):
        progress.on_log(None, SimpleNamespace(global_step=25, max_steps=250), None, logs={"loss": 5.0})
        progress.on_log(None, SimpleNamespace(global_step=250, max_steps=250), None, logs={"loss": 1.5})
    assert [r.getMessage() for r in caplog.records] == [
        "tiny teacher: step 25 of 250, training loss 5.000 (30 s so far, about 4.5 min left at this pace)",
        "tiny teacher: step 250 of 250, training loss 1.500 (5.0 min so far, about 0 s left at this pace)",
    ]


def test_the_tiny_teachers_weights_do_not_depend_on_the_callers_threads(micro_corpus, tmp_path):
    """The tiny teacher's own shape (a few steps on 40 pages), built under 1 and 2 threads set by
    the caller: the same weights (trained in 2 threads they differ in their last bits)."""
    from pipeline.embedded.sample_corpus import clean_texts
    from pipeline.embedded.tiny_teacher import TinyTeacherSpec, build_tiny_teacher

    texts = clean_texts(micro_corpus)[:40]
    digests = set()
    for threads in (1, 2):
        with torch_threads(threads):
            out = build_tiny_teacher(texts, tmp_path / f"threads-{threads}", TinyTeacherSpec(vocab_size=600, steps=3,
                                                                                            batch_size=4))
        digests.add(file_sha256(out / "model.safetensors"))
    assert len(digests) == 1
