"""make repro: its evaluation measures, claim verdicts, report, and one small end-to-end run.

The measures are checked against exact values: a Llama whose weights are all zero gives the same
logit to every token, so its loss is ln(V) on every predicted token (bits per byte then follows
from the token and byte counts alone) and greedy decoding always emits token id 0.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.lab.repro.evaluate import Completion, bits_per_byte, completion_items, exact_match, extract_number
from pipeline.lab.repro.report import (
    README_END,
    README_START,
    at_least_as_good,
    beats,
    check_claims,
    paired,
    summarize,
    update_readme,
    write_report,
)

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# Evaluation measures


@pytest.mark.parametrize("text, expected", [
    (" 1440. Tomás", "1440"), ("969", "969"), ("  -12 apples", "-12"), ("\n42", "42"),
    (" apples", None), ("", None), ("x 12", None), (" 1,440", "1"),
])
def test_extract_number_reads_the_leading_integer(text, expected):
    assert extract_number(text) == expected


def test_completion_items_are_well_formed_and_correct():
    items = completion_items(30, seed=5)
    assert [i.kind for i in items].count("arithmetic") == 30
    assert [i.kind for i in items].count("restate") == 30
    for item in items:
        if item.kind == "arithmetic":
            m = re.search(r"Solution: (\d+) ([×*+-]) (\d+) =$", item.prompt)
            assert m, item.prompt
            a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
            assert int(item.answer) == {"×": a * b, "*": a * b, "+": a + b, "-": a - b}[op]
        else:  # the answer is on the line above, right after "= "
            assert f"= {item.answer}. " in item.prompt
            assert not item.prompt.endswith(item.answer)
    assert completion_items(30, seed=5) == items  # deterministic
    assert completion_items(30, seed=6) != items


@pytest.fixture(scope="module")
def digit_first_model(tmp_path_factory):
    """A word-level tokenizer whose id 0 is "7", and a Llama with every weight zero."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["7", "<s>", "</s>", "<unk>", "the", "answer", "is", "=", "+", "1", "2", "3", ".", "Solution:"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()  # "7" "7" -> "77"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model, tokenizer


def test_bits_per_byte_of_a_uniform_model_is_exact(digit_first_model):
    model, tokenizer = digit_first_model
    texts = ["the answer is 1 + 2 = 3 .", "Solution: 1 + 1 = 2 . " * 9, "7"]
    n_tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    n_bytes = sum(len(t.encode()) for t in texts)
    expected = n_tokens * math.log2(len(tokenizer)) / n_bytes
    for window in (4, 7, 64):  # blocks: every token is predicted exactly once, whatever the window
        got = bits_per_byte(model, tokenizer, texts, window=window, batch_size=3)
        assert got["n_tokens"] == n_tokens and got["n_bytes"] == n_bytes
        assert got["bits_per_byte"] == pytest.approx(expected, rel=1e-5)
        assert got["nats_per_token"] == pytest.approx(math.log(len(tokenizer)), rel=1e-5)


def test_bits_per_byte_matches_the_models_own_loss(digit_first_model):
    """With random weights and a window covering the text: the HF loss of <s> + text, times the
    predicted tokens, in bits, over the bytes."""
    import torch
    from transformers import LlamaForCausalLM

    _, tokenizer = digit_first_model
    torch.manual_seed(0)
    model = LlamaForCausalLM(digit_first_model[0].config)
    text = "the answer is 1 + 2 = 3 . Solution: 2 + 1 = 3 ."
    ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        x = torch.tensor([ids])
        loss = model(input_ids=x, labels=x).loss.item()
    expected = loss * (len(ids) - 1) / math.log(2) / len(text.encode())
    assert bits_per_byte(model, tokenizer, [text], window=64)["bits_per_byte"] == pytest.approx(expected, rel=1e-5)


def test_exact_match_scores_greedy_continuations(digit_first_model):
    model, tokenizer = digit_first_model  # greedy always emits id 0, "7": 4 new tokens -> "7777"
    items = [Completion("arithmetic", "1 + 2 =", "7777"), Completion("arithmetic", "the answer is", "3"),
             Completion("restate", "Solution: 3 =", "7777"), Completion("restate", "the", "777")]
    got = exact_match(model, tokenizer, items, max_new_tokens=4, batch_size=3)
    assert [r["extracted"] for r in got["records"]] == ["7777"] * 4
    assert [r["correct"] for r in got["records"]] == [True, False, True, False]
    assert got["by_kind"] == {"arithmetic": {"n": 2, "correct": 1, "accuracy": 0.5},
                              "restate": {"n": 2, "correct": 1, "accuracy": 0.5}}


# --------------------------------------------------------------------------------------------
# Claims and report


def _results(values: dict[str, list[float]], folder="/x/scored/strong/v1") -> list[dict]:
    out = []
    for arm, bpbs in values.items():
        for seed, bpb in enumerate(bpbs):
            out.append({"arm": arm, "seed": seed, "teacher": "strong", "student": "bbpe" if arm.startswith("bbpe") else "spm",
                        "scored_folder": folder, "bits_per_byte": bpb, "tokens_trained": 100,
                        "exact_match": {"restate": {"accuracy": 0.5}, "arithmetic": {"accuracy": 0.0}},
                        "last_log": {"kept_fraction": 0.4}})
    return out


def test_verdicts_follow_the_seed_paired_rule():
    arms = summarize(_results({"a": [1.0, 1.0, 1.0], "b": [1.1, 1.2, 1.05], "c": [0.9, 1.1, 1.05],
                               "d": [1.01, 0.99, 1.0], "e": [0.5, 0.5, 0.5]}))
    assert beats(paired(arms, "a", "b")) == "holds"
    assert paired(arms, "a", "b")["diffs"] == pytest.approx([-0.1, -0.2, -0.05])
    assert beats(paired(arms, "a", "c")) == "holds on average (2/3 seeds)"
    assert beats(paired(arms, "a", "e")) == "does not hold"
    assert at_least_as_good(paired(arms, "a", "d")) == "holds within noise"  # +0.0 ± noise
    assert at_least_as_good(paired(arms, "a", "e")) == "does not hold"
    assert beats(paired(arms, "a", "missing")) == "not run"


def test_claims_report_what_the_numbers_say():
    values = {"guided": [1.0, 1.0, 1.0], "cpt": [1.1, 1.1, 1.1], "random": [1.2, 1.2, 1.2],
              "guided_weak_teacher": [0.9, 0.95, 0.9],  # the weak teacher wins here: claim 2 fails
              "chunk_32": [1.02, 1.03, 1.02], "chunk_4": [1.05, 1.06, 1.05], "unmapped_exclude": [1.0, 1.01, 1.0],
              "aggregate_mean": [1.01, 1.0, 1.02], "aggregate_min": [1.05, 1.05, 1.06],
              "bbpe_guided": [2.0, 2.0, 2.0], "bbpe_cpt": [2.1, 2.1, 2.2]}
    results = _results(values)
    claims = {c["claim"]: c["verdict"] for c in check_claims(summarize(results), results)}
    assert claims == {1: "holds", 2: "does not hold", 3: "holds", 4: "holds on average", 5: "holds"}
    split = [r | {"scored_folder": "/y/v1"} if r["arm"] == "bbpe_guided" else r for r in results]
    assert check_claims(summarize(split), split)[4]["verdict"] == "partly holds"
    no_gain = [r | {"bits_per_byte": 3.0} if r["arm"] == "bbpe_guided" else r for r in results]
    fifth = check_claims(summarize(no_gain), no_gain)[4]  # served from one folder, but no gain over cpt
    assert fifth["verdict"] == "partly holds" and [e["verdict"] for e in fifth["evidence"]] == ["does not hold", "holds"]


def test_write_report_files_and_readme_section(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{README_START}\nold table\n{README_END}\nafter\n")
    values = {"guided": [1.0, 1.1], "cpt": [1.2, 1.15]}
    setup = {"finished": "2026-11-21T12:00:00+00:00", "seconds": 60.0, "machine": "test", "seeds": [0, 1],
             "n_runs": 4, "train_tokens_per_run": 100}
    record = write_report(_results(values), ["guided", "cpt"], setup, tmp_path / "out", readme)
    assert (tmp_path / "out" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert written["arms"]["guided"]["bpb"]["mean"] == pytest.approx(1.05)
    assert {r["scored_folder"] for r in written["runs"]} == {"scored/strong/v1"}  # no machine paths
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("after\n")
    assert "| guided |" in text and "1.0500 ± 0.0707" in text and "Latest run: 2026-11-21" in text
    assert [c["verdict"] for c in record["claims"]][0] == "partly holds"  # beats cpt (2/2); random not run
    assert update_readme(tmp_path / "out" / "report.md", "x") is False  # no markers: untouched


# --------------------------------------------------------------------------------------------
# End to end: the real stage, tiny settings


def test_make_repro_end_to_end_small(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"{README_START}\n{README_END}\n")
    keep = {"guided", "cpt", "bbpe_guided"}
    drop = [f"~arms.{a}" for a in ("random", "guided_weak_teacher", "chunk_32", "chunk_4", "unmapped_exclude",
                                    "aggregate_mean", "aggregate_min", "bbpe_cpt")]
    args = [
        sys.executable, "-m", "stages.repro", *drop,
        f"artifacts_dir={tmp_path / 'artifacts'}", f"work_dir={tmp_path / 'work'}", f"report_dir={tmp_path / 'report'}",
        f"readme={readme}", "corpus.student_docs=36", "corpus.teacher_docs=60", "corpus.held_out_docs=4",
        "teachers.strong.steps=3", "students.spm.vocab_size=600", "students.bbpe.vocab_size=300",
        "corpus.pretrain_docs=30", "pretrain.steps=3", "pretrain.block=64", "pretrain.batch_size=2",
        "seeds=[0,1]", "train_steps=2", "eval.completions=4", "eval.window=64",
        "train_overrides=[" + ",".join(f"'{o}'" for o in (
            "student.seq_len=64", "train.micro_batch_size=2", "train.warmup_steps=1", "train.logging_steps=1",
            "train.cpu_threads=1", "data.num_workers=0")) + "]",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert {r["arm"] for r in report["runs"]} == keep and len(report["runs"]) == 6
    assert all(r["steps"] == 2 and r["tokens_trained"] == 2 * 2 * 64 for r in report["runs"])
    assert all(0 < r["bits_per_byte"] < 20 for r in report["runs"])
    # one scored folder (the strong teacher's) serves both students; the unused weak teacher is never built
    assert {r["scored_folder"] for r in report["runs"]} == {"repro-student/strong/v1"}  # <corpus>/<teacher>/v<schema>, no machine paths
    assert (tmp_path / "work" / "scored" / "repro-student" / "strong" / "v1" / "manifest.json").is_file()
    assert not (tmp_path / "artifacts" / "teacher-weak").exists()
    assert "| guided |" in readme.read_text()
    bases = report["setup"]["base_students"]  # both base students evaluated before continual pretraining
    assert set(bases) == {"spm", "bbpe"} and all(0 < b["bits_per_byte"] < 20 for b in bases.values())
    assert (tmp_path / "artifacts" / "student-spm-base" / "pretraining.json").is_file()
    assert (tmp_path / "report" / "report.png").is_file()

    # a rerun trains nothing: every run is read back from its result file
    proc2 = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert proc2.stderr.count("(cached)") + proc2.stdout.count("(cached)") == 6
    again = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [r["bits_per_byte"] for r in again["runs"]] == [r["bits_per_byte"] for r in report["runs"]]


def test_bad_settings_end_with_one_line_and_exit_2(tmp_path):
    args = [sys.executable, "-m", "stages.repro", "arms.guided.teacher=nobody", "seeds=[]",
            f"artifacts_dir={tmp_path / 'a'}", f"work_dir={tmp_path / 'w'}", f"hydra.run.dir={tmp_path / 'h'}"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "seeds: at least one seed is needed" in proc.stderr
    assert "arms.guided.teacher: 'nobody' is not one of strong, weak" in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "w").exists()  # refused before building anything


def test_a_student_vocabulary_too_small_is_refused():
    from pipeline.lab.repro.build import StudentSpec, _student_tokenizer

    with pytest.raises(ValueError, match="vocab_size 300 leaves no room"):
        _student_tokenizer(StudentSpec("x", "sentencepiece_bpe", 300), ["some text"] * 10)
    with pytest.raises(ValueError, match="student tokenizer 'wordpiece' is not one of"):
        _student_tokenizer(StudentSpec("x", "wordpiece", 3000), ["some text"])
