"""make repro: its evaluation measures, claim verdicts, report, and one small end-to-end run.

The measures are checked against exact values: a Llama whose weights are all zero gives the same
logit to every token, so its loss is ln(V) on every predicted token (bits per byte then follows
from the token and byte counts alone).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from repro.diagnose import select_top, summarize_selection, token_losses
from repro.evaluate import Completion, answer_scores, bits_per_byte, completion_items, continuation_losses
from repro.report import (
    check_claims,
    compare,
    compare_gains,
    noise_points,
    summarize,
    summary_markdown,
    sweep_points,
    write_report,
)

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# Evaluation measures


def test_completion_items_are_well_formed_and_correct():
    items = completion_items(30, seed=5)
    assert [i.kind for i in items].count("arithmetic") == 30
    assert [i.kind for i in items].count("restate") == 30
    for item in items:
        m = re.search(r"Solution: (\d+) ([×*+-]) (\d+) =", item.prompt)
        assert m, item.prompt
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert int(item.answer) == {"×": a * b, "*": a * b, "+": a + b, "-": a - b}[op]
        assert set(item.distractors) == {str(a), str(b)} - {item.answer} and item.answer not in item.distractors
        if item.kind == "arithmetic":
            assert item.prompt.endswith(" =") and item.suffix == "."
        else:  # the answer is on the line above, right after "= "; the continuation ends the sentence
            assert f"= {item.answer}. " in item.prompt and not item.prompt.endswith(item.answer)
            assert item.suffix.startswith(" ") and item.suffix.endswith(".") and not re.search(r"\d", item.suffix)
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


def test_continuation_losses_of_a_uniform_model_count_tokens(digit_first_model):
    model, tokenizer = digit_first_model  # every predicted token costs ln(V)
    # the last pair reads "the answer is 12 .": "12" is one token (<unk>) that starts in the prompt
    # and ends in the continuation, so it is the continuation's (it is predicted after the prompt)
    pairs = [("the answer is", " 3 ."), ("1 + 2 =", " 1 2 3 ."), ("Solution:", " 7"), ("the answer is 1", "2 .")]
    got = continuation_losses(model, tokenizer, pairs, batch_size=2)
    v = math.log(len(tokenizer))
    assert got == pytest.approx([2 * v, 4 * v, v, 2 * v], rel=1e-5)


def test_continuation_losses_match_the_models_own_loss(digit_first_model):
    """Random weights: the HF loss with the prompt's labels masked, times the scored tokens."""
    import torch
    from transformers import LlamaForCausalLM

    _, tokenizer = digit_first_model
    torch.manual_seed(1)
    model = LlamaForCausalLM(digit_first_model[0].config)
    prompt, cont = "the answer is 1 + 2 =", " 3 . the answer"
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = [tokenizer.bos_token_id, *tokenizer(prompt + cont, add_special_tokens=False)["input_ids"]]
    labels = [-100] * (1 + len(p_ids)) + ids[1 + len(p_ids):]
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
    expected = loss * (len(ids) - 1 - len(p_ids))
    got = continuation_losses(model, tokenizer, [(prompt, cont), ("7", " 7 7")], batch_size=4)[0]  # padded batch
    assert got == pytest.approx(expected, rel=1e-5)


def test_answer_scores_by_hand(digit_first_model):
    model, tokenizer = digit_first_model
    v = math.log(len(tokenizer))
    items = [Completion("arithmetic", "1 + 2 =", "3", " .", ("1 2",)),  # 2 tokens vs 3: the answer wins
             Completion("arithmetic", "2 + 1 =", "3", " .", ("2",)),  # a tie is not a win
             Completion("restate", "the answer is", "3", "", ()),  # no distractor: not in the choice
             Completion("restate", "the answer is", "1 2", "", ("3",))]  # the distractor is shorter: loses
    got = answer_scores(model, tokenizer, items)
    # " 3 ." twice: 4 tokens, 8 bytes; " 3" and " 1 2": 3 tokens, 6 bytes
    assert got["arithmetic"] == {"n": 2, "bits_per_byte": pytest.approx(4 * v / math.log(2) / 8), "n_choice": 2,
                                 "choice_accuracy": 0.5}
    assert got["restate"] == {"n": 2, "bits_per_byte": pytest.approx(3 * v / math.log(2) / 6), "n_choice": 1,
                              "choice_accuracy": 0.0}


# --------------------------------------------------------------------------------------------
# Claims and report


def _results(values: dict[str, list[float]], folder="/x/scored/strong/v1", seeds=None) -> list[dict]:
    out = []
    for arm, bpbs in values.items():
        mode = "cpt" if arm.startswith("cpt") or arm == "bbpe_cpt" else "random" if arm.startswith("random") else "guided"
        m = re.search(r"_r(\d+)$", arm)
        ratio = 1.0 if mode == "cpt" else int(m.group(1)) / 100 if m else 0.4
        m = re.search(r"_noise(\d+)$", arm)
        noise = int(m.group(1)) / 100 if m else 0.5
        for seed, bpb in zip(seeds or range(len(bpbs)), bpbs):
            out.append({"arm": arm, "seed": seed, "teacher": "strong", "student": "bbpe" if arm.startswith("bbpe") else "spm",
                        "mode": mode, "ratio": ratio, "noise_share": noise, "corpus": "main",
                        "scored_folder": folder, "bits_per_byte": bpb, "tokens_trained": 100,
                        "answers": {"restate": {"bits_per_byte": 2 * bpb, "choice_accuracy": 0.5},
                                    "arithmetic": {"bits_per_byte": 3 * bpb, "choice_accuracy": 0.25}},
                        "last_log": {"kept_fraction": 1.0 if mode == "cpt" else ratio}})
    return out


def test_compare_pairs_seeds_and_tests_the_differences():
    arms = summarize(_results({"a": [1.0, 1.0, 1.0], "b": [1.1, 1.2, 1.05]})
                     + _results({"c": [0.5, 0.6]}, seeds=[2, 7]))
    p = compare(arms, "a", "b")
    assert p["diffs"] == pytest.approx([-0.1, -0.2, -0.05]) and p["seeds"] == [0, 1, 2]
    assert p["ci"] == pytest.approx([-0.306400, 0.073066], abs=1e-5)  # hand-worked: mean -0.116667 ± 4.3027 * 0.044096
    assert compare(arms, "a", "c")["seeds"] == [2] and compare(arms, "a", "c")["ci"] is None  # only seed 2 is shared
    assert compare(arms, "a", "missing") is None
    assert compare(arms, "a", "b", "restate_bpb")["mean"] == pytest.approx(2 * -0.116667, abs=1e-6)
    gains = compare_gains(summarize(_results({"g1": [1.0, 1.0, 1.0], "c1": [1.1, 1.1, 1.2],
                                              "g0": [1.0, 1.0, 1.0], "c0": [1.0, 1.01, 1.0]})), "g1", "c1", "g0", "c0")
    assert gains["diffs"] == pytest.approx([-0.1, -0.09, -0.2])


def _all_arms(shift: float = 0.0) -> dict[str, list[float]]:
    """Four seeds of every arm; hand-made so that each verdict below is known in advance."""
    j = [0.0, 0.002, -0.002, 0.001]  # the same jitter on every arm: paired differences have sd 0
    arm = lambda x: [x + d for d in j]  # noqa: E731
    return {"guided": arm(1.00), "cpt": arm(1.05), "random": arm(1.10),
            "guided_weak_teacher": [0.9, 1.2, 0.95, 1.3],  # mixed: inconclusive
            "chunk_32": arm(1.02), "chunk_4": arm(1.04), "unmapped_exclude": arm(1.00 - 0.01),  # exclude wins
            "aggregate_mean": arm(1.01), "aggregate_min": arm(1.02),
            "bbpe_guided": arm(2.0 + shift), "bbpe_cpt": arm(2.0),
            "guided_r20": arm(1.03), "random_r20": arm(1.2), "guided_r80": arm(1.04), "random_r80": arm(1.06),
            "guided_noise0": arm(0.9), "cpt_noise0": arm(0.91)}


def test_claims_follow_the_rule():
    results = _all_arms(shift=-0.05)
    rows = _results(results)
    claims = {c["claim"]: c["verdict"] for c in check_claims(summarize(rows), rows)}
    assert claims == {1: "holds", 2: "holds", 3: "inconclusive", 4: "holds", 5: "does not hold", 6: "holds",
                      7: "holds", 8: "holds"}  # 8: gain 0.05 at 50% noise vs 0.01 at 0%
    split = [r | {"scored_folder": "/y/v1"} if r["arm"] == "bbpe_guided" else r for r in rows]
    assert check_claims(summarize(split), split)[5]["verdict"] == "does not hold"  # two folders: one part fails
    worse = _results(_all_arms(shift=+0.05))
    sixth = check_claims(summarize(worse), worse)[5]
    assert sixth["verdict"] == "does not hold" and [e["verdict"] for e in sixth["evidence"]] == ["does not hold", "holds"]
    few = _results({"guided": [1.0], "cpt": [1.1]})
    first = check_claims(summarize(few), few)[0]
    assert first["verdict"] == "inconclusive" and "one seed" in first["evidence"][0]["text"]
    assert check_claims(summarize(few), few)[2]["verdict"] == "not run"


def test_sweep_and_noise_points():
    arms = summarize(_results(_all_arms()))
    assert sweep_points(arms) == {"guided": [(20, "guided_r20"), (40, "guided"), (80, "guided_r80"), (100, "cpt")],
                                  "random": [(20, "random_r20"), (40, "random"), (80, "random_r80"), (100, "cpt")]}
    assert noise_points(arms) == [(0, "guided_noise0", "cpt_noise0"), (50, "guided", "cpt")]


def test_write_report_files_and_summary(tmp_path):
    setup = {"finished": "2026-11-21T12:00:00+00:00", "seconds": 60.0, "machine": "test", "seed_sets": {"main": [0, 1, 2, 3]},
             "n_runs": 68, "runs_planned": 70, "train_tokens_per_run": 100,
             "power": {"power": 0.8, "max_runs": 100, "settings_note": "Settings committed first.",
                       "sized": {"main": {"claims": [1], "delta": 0.01, "pilot_sd": {"guided - cpt": 0.0134},
                                          "pilot_seeds": [90, 91, 92], "pilot_note": "test", "fits": None}}}}
    results = _results(_all_arms())
    order = list(_all_arms())
    record = write_report(results, order, setup, tmp_path / "out", diagnosis={})
    for png in ("report.png", "sweep.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert written["arms"]["guided"]["bpb"]["mean"] == pytest.approx(1.00025)
    assert {r["scored_folder"] for r in written["runs"]} == {"scored/strong/v1"}  # no machine paths
    body = (tmp_path / "out" / "report.md").read_text()
    assert "interval lies wholly on the claimed side of zero" in body and "Partial report: 68 of the 70" in body
    assert "The rule asks for 17 seeds; the set has 4 seeds (fewer than the rule asks" in body  # sd 0.0134, delta 0.01, 80%
    assert "Settings committed first." in body
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "(2026-11-21)" in summary and "partial: 68 of 70 planned runs" in summary
    assert summary_markdown(record["claims"]) in summary
    assert record["claims"][0]["verdict"] == "holds"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.json", "report.md", "report.png",
                                                                     "summary.md", "sweep.png"]


def test_summary_has_one_row_per_claim_with_interval_p_and_seeds():
    claims = check_claims(summarize(_results(_all_arms())), _results(_all_arms()))
    rows = summary_markdown(claims).splitlines()
    assert rows[0] == "| # | the paper's finding | our verdict | A - B in bits/byte: mean [95% CI] | p | seeds |"
    assert len(rows) == 2 + len(claims)
    first = claims[0]["evidence"][0]["test"]
    cells = [c.strip() for c in rows[2].split("|")[1:-1]]
    assert cells[:3] == ["1", claims[0]["text"], f"**{claims[0]['verdict']}**"]
    assert cells[3] == f"{first['mean']:+.4f} [{first['ci'][0]:+.4f}, {first['ci'][1]:+.4f}]" and cells[5] == str(first["n"])
    assert cells[4] == f"{first['p']:.2g}"
    several = next(r for r, c in zip(rows[2:], claims) if len(c["evidence"]) > 1)
    assert several.count("<br>") >= 3  # a claim of several comparisons: each one's interval, p and seeds


def test_token_losses_match_the_models_own_loss(digit_first_model):
    """Batched, padded windows give each document's per-token losses: with a window covering the
    document they sum to the HF loss of <s> + document; with short windows every token is still
    predicted once."""
    import torch
    from transformers import LlamaForCausalLM

    _, tokenizer = digit_first_model
    torch.manual_seed(2)
    model = LlamaForCausalLM(digit_first_model[0].config)
    docs = [np.array(tokenizer(t, add_special_tokens=False)["input_ids"])
            for t in ("the answer is 1 + 2 = 3 .", "7 7", "Solution: 2 + 1 = 3 . the answer is 3 .")]
    got = token_losses(model, tokenizer.bos_token_id, docs, block=64, batch_size=2)
    for ids, losses in zip(docs, got):
        x = torch.tensor([[tokenizer.bos_token_id, *ids.tolist()]])
        with torch.no_grad():
            expected = model(input_ids=x, labels=x).loss.item() * len(ids)
        assert losses.shape == (len(ids),) and losses.sum() == pytest.approx(expected, rel=1e-5)
    short = token_losses(model, tokenizer.bos_token_id, docs, block=4, batch_size=3)
    assert [len(x) for x in short] == [len(d) for d in docs]
    assert short[1] == pytest.approx(got[1], rel=1e-5)  # fits in one window either way


def test_selection_diagnosis_by_hand():
    excess = np.array([5.0, 1.0, 3.0, 0.0, 2.0])
    mapped = np.array([True, True, True, False, True])
    assert select_top(excess, mapped, 0.5).tolist() == [True, False, True, False, False]  # ceil(0.5 * 4) = 2
    kind = np.array(["noise", "clean", "clean", "noise", "clean"], dtype=object)
    l_t = np.array([1.0, 1.0, 1.0, np.nan, 1.0])
    out = summarize_selection(kind, excess + l_t, l_t, mapped, np.ones(5), 0.5)
    assert out["kept_share"] == pytest.approx(3 / 5)  # two selected plus the unmapped one
    noise, clean = out["by_kind"]["noise"], out["by_kind"]["clean"]
    assert noise["kept_share_of_all_kept"] == pytest.approx(2 / 3) and clean["kept_share_of_all_kept"] == pytest.approx(1 / 3)
    assert noise["kept_rate"] == 1.0 and clean["kept_rate"] == pytest.approx(1 / 3)
    assert clean["excess_mean"] == pytest.approx(2.0) and noise["excess_mean"] == pytest.approx(5.0)
    assert noise["mapped_rate"] == 0.5


# --------------------------------------------------------------------------------------------
# End to end: the real stage, tiny settings


KEEP = ("guided", "cpt", "random_r20", "guided_noise0", "cpt_noise0", "bbpe_guided", "guided_r10_seq")


def _small_args(tmp_path: Path) -> list[str]:
    """The full pipeline at tiny settings: seven arms (the main pair, one sweep arm, the noise-free
    corpus's pair, the second student, a per-sequence arm), two seeds for main arms and one for the rest."""
    drop = [f"~arms.{a}" for a in _conf_arms() if a not in KEEP] + ["~student_corpora.noise25"]
    return [
        sys.executable, "-m", "repro", *drop,
        f"artifacts_dir={tmp_path / 'artifacts'}", f"work_dir={tmp_path / 'work'}", f"report_dir={tmp_path / 'report'}",
        "corpus.student_docs=36", "corpus.teacher_docs=60", "corpus.held_out_docs=4",
        "teachers.strong.steps=3", "students.spm.vocab_size=600", "students.bbpe.vocab_size=300",
        "corpus.pretrain_docs=30", "pretrain.steps=3", "pretrain.block=64", "pretrain.batch_size=2",
        "seed_sets.main=[100,101]", "seed_sets.sweep=[100]", "seed_sets.bbpe=[100]", "train_steps=2", "eval.completions=4", "eval.window=64",
        "train_overrides=[" + ",".join(f"'{o}'" for o in (
            "student.seq_len=64", "train.micro_batch_size=2", "train.warmup_steps=1", "train.logging_steps=1",
            "train.cpu_threads=1", "data.num_workers=0")) + "]",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]


def _conf_arms() -> list[str]:
    from omegaconf import OmegaConf

    return list(OmegaConf.load(ROOT / "conf" / "repro.yaml").arms)


@pytest.mark.slow
def test_make_repro_end_to_end_small(tmp_path):
    args = _small_args(tmp_path)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    runs = report["runs"]
    assert sorted((r["arm"], r["seed"]) for r in runs) == sorted(
        [("guided", 100), ("guided", 101), ("cpt", 100), ("cpt", 101)] + [(a, 100) for a in KEEP[2:]])
    assert all(r["steps"] == 2 and r["tokens_trained"] == 2 * 2 * 64 for r in runs)
    assert all(0 < r["bits_per_byte"] < 20 for r in runs)
    for r in runs:  # the answer measures: both kinds, a choice between three candidates
        assert {k: v["n"] for k, v in r["answers"].items()} == {"arithmetic": 4, "restate": 4}
        assert all(0 <= v["choice_accuracy"] <= 1 and v["bits_per_byte"] > 0 for v in r["answers"].values())
    by_arm = {r["arm"]: r for r in runs}
    assert (by_arm["random_r20"]["mode"], by_arm["random_r20"]["ratio"]) == ("random", 0.2)
    assert by_arm["cpt"]["ratio"] == 1.0 and by_arm["guided_noise0"]["noise_share"] == 0.0
    # one scored folder (the strong teacher's) serves both students; the noise-free corpus has its own
    assert {r["scored_folder"] for r in runs} == {"repro-student/strong/v1", "repro-student-noise0/strong/v1"}
    assert by_arm["bbpe_guided"]["scored_folder"] == by_arm["guided"]["scored_folder"]
    assert not (tmp_path / "artifacts" / "teacher-weak").exists()  # the unused weak teacher is never built
    corpora = report["setup"]["student_corpora"]
    assert corpora["noise0"]["docs_by_kind"].get("noise", 0) == 0 and corpora["main"]["docs_by_kind"]["noise"] > 0
    assert set(report["diagnosis"]) == {"spm", "bbpe"}
    sweep = report["sweep_diagnosis"]  # claim 7: the runs that differ from guided only in their selection, seed 100
    assert sweep["seeds"] == [100] and set(sweep["learned"]) == {"base", "guided", "cpt", "random_r20", "guided_r10_seq"}
    rows = {(r["arm"], r["when"]): r["stats"] for r in sweep["selection"]}
    assert set(rows) == {("all mapped tokens", "start"), ("guided", "start"), ("guided", "end"),
                         ("guided_r10_seq", "start"), ("guided_r10_seq", "end")}
    assert rows["all mapped tokens", "start"]["selected_rate"]["clean"] == 1.0
    assert rows["guided_r10_seq", "start"]["top_sequence_share"] == pytest.approx(0.5, abs=0.05)  # k per sequence, 2 of them
    for d in report["diagnosis"].values():  # kept shares by page kind add up to one
        assert sum(k["kept_share_of_all_kept"] for k in d["by_kind"].values()) == pytest.approx(1.0)
    assert "**" in (tmp_path / "report" / "summary.md").read_text() and (tmp_path / "report" / "sweep.png").is_file()
    bases = report["setup"]["base_students"]  # both base students evaluated before continual pretraining
    assert set(bases) == {"spm", "bbpe"} and all(0 < b["bits_per_byte"] < 20 for b in bases.values())

    # a rerun trains nothing: every run is read back from its result file, and the report is the same
    first = (tmp_path / "report" / "report.json").read_text()
    proc2 = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert proc2.stderr.count("(cached)") + proc2.stdout.count("(cached)") == len(runs)
    again = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [r["bits_per_byte"] for r in again["runs"]] == [r["bits_per_byte"] for r in runs]
    assert again["claims"] == json.loads(first)["claims"]

    # report_only after losing one run: reported as partial, nothing trained
    (tmp_path / "work" / "students" / "cpt" / "seed101" / "repro_result.json").unlink()
    proc3 = subprocess.run(args + ["report_only=true"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc3.returncode == 0, proc3.stderr[-3000:]
    partial = json.loads((tmp_path / "report" / "report.json").read_text())
    assert len(partial["runs"]) == len(runs) - 1 and partial["setup"]["runs_planned"] == len(runs)
    assert f"Partial report: {len(runs) - 1} of the {len(runs)} planned runs" in (tmp_path / "report" / "report.md").read_text()


TIMINGS = ("tokens_per_s",)  # the only measured times in a run's last log


def _figures(report: dict) -> dict:
    """Every number of a report that a rerun must reproduce (paths and timings left out)."""
    runs = {(r["arm"], r["seed"]): (r["bits_per_byte"], r["answers"], r["tokens_trained"],
                                    {k: v for k, v in r["last_log"].items() if k not in TIMINGS})
            for r in report["runs"]}
    bases = {s: (b["bits_per_byte"], b.get("answers")) for s, b in report["setup"]["base_students"].items()}
    return {"runs": runs, "bases": bases, "claims": report["claims"], "diagnosis": report["diagnosis"],
            "sweep_diagnosis": report["sweep_diagnosis"]}


@pytest.mark.slow
def test_make_repro_from_nothing_twice_gives_identical_figures(tmp_path):
    """Two runs of the small repro, each from nothing in its own folders and process (so every
    tokenizer, teacher, base student, scored dataset and student is built again): every figure of
    the report equal. Guards what the cache cannot: a build that differs from one run to the next."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    reports = []
    for name in ("first", "second"):
        root = tmp_path / name
        root.mkdir()
        proc = subprocess.run(_small_args(root), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        reports.append(json.loads((root / "report" / "report.json").read_text()))
    first, second = (_figures(r) for r in reports)
    assert len(first["runs"]) == 9
    assert {k: v for k, v in first["runs"].items() if second["runs"].get(k) != v} == {}
    assert first == second


def test_bad_settings_end_with_one_line_each_and_exit_2(tmp_path):
    args = [sys.executable, "-m", "repro", "arms.guided.teacher=nobody", "seed_sets.main=[]",
            "seed_sets.sweep=[]", "seed_sets.ablation=[]", "seed_sets.bbpe=[]",
            "arms.cpt.seeds=other", "arms.guided_noise0.corpus=dirty", "student_corpora.noise25=1.5",
            f"artifacts_dir={tmp_path / 'a'}", f"work_dir={tmp_path / 'w'}", f"hydra.run.dir={tmp_path / 'h'}"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    for line in ("seed_sets: no arm has a seed to run",
                 "arms.guided.teacher: 'nobody' is not one of strong, weak",
                 "arms.cpt.seeds: 'other' is not one of main, sweep, ablation, bbpe",
                 "arms.guided_noise0.corpus: 'dirty' is not one of main, noise0, noise25",
                 "student_corpora.noise25: noise share 1.5 is not in [0, 1]"):
        assert line in proc.stderr, (line, proc.stderr[-2000:])
    assert not (tmp_path / "a").exists() and not (tmp_path / "w").exists()  # refused before building anything


def test_a_student_vocabulary_too_small_is_refused():
    from repro.build import StudentSpec, _student_tokenizer

    with pytest.raises(ValueError, match="vocab_size 300 leaves no room"):
        _student_tokenizer(StudentSpec("x", "sentencepiece_bpe", 300), ["some text"] * 10)
    with pytest.raises(ValueError, match="student tokenizer 'wordpiece' is not one of"):
        _student_tokenizer(StudentSpec("x", "wordpiece", 3000), ["some text"])


# --------------------------------------------------------------------------------------------
# Claim 7's diagnosis: what the selection takes, on a hand-made batch against a brute-force count


def _hand_batches() -> list[dict[str, np.ndarray]]:
    """Two micro-batches of 2 sequences x 5 targets: page kinds, documents, token ids, losses."""
    nan = np.nan
    b1 = {"l_s": np.array([[5.0, 1.0, 4.0, 2.0, 3.0], [0.5, 6.0, 1.0, 2.5, 7.0]]),
          "l_t": np.array([[1.0, 1.0, nan, 1.5, 0.5], [1.0, 0.5, 2.0, nan, 9.0]]),
          "kind": np.array([["clean"] * 3 + ["noise"] * 2, ["noise"] + ["clean"] * 4], dtype=object),
          "doc": np.array([[0, 0, 0, 1, 1], [1, 2, 2, 2, 2]]),
          "ids": np.array([[7, 8, 7, 9, 7], [3, 7, 4, 5, 6]])}
    b2 = {"l_s": np.array([[2.0, 2.0, 9.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0, 0.0]]),
          "l_t": np.array([[0.0, 1.0, 1.0, 1.0, 1.0], [2.0, nan, 0.0, 1.0, 1.0]]),
          "kind": np.array([["clean"] * 5, ["noise"] * 2 + ["clean"] * 3], dtype=object),
          "doc": np.array([[5, 5, 5, 5, 5], [6, 6, 7, 7, 7]]),
          "ids": np.array([[1, 1, 1, 2, 3], [4, 4, 7, 7, 7]])}
    for b in (b1, b2):
        b["mapped"] = ~np.isnan(b["l_t"])
        b["valid"] = np.ones(b["l_s"].shape, bool)
    return [b1, b2]


@pytest.mark.parametrize("ratio,rank_over", [(0.2, "batch"), (0.4, "batch"), (0.4, "sequence"), (1.0, "batch")])
def test_selection_diagnosis_against_brute_force(ratio, rank_over):
    from pipeline.method.guided_loss import SelectionConfig
    from repro.diagnose import TOP_IDS, select, selection_stats

    batches = _hand_batches()
    chosen = select(batches, [b["l_s"] for b in batches], SelectionConfig(ratio=ratio, rank_over=rank_over))
    # the selection itself, by hand: per micro-batch (or sequence), the ceil(ratio * mapped) largest l_s - l_t
    sel_tokens, trained_tokens = [], []  # (batch, row, col)
    for i, b in enumerate(batches):
        pools = [[(r, c) for r in range(2) for c in range(5)]] if rank_over == "batch" else \
            [[(r, c) for c in range(5)] for r in range(2)]
        for pool in pools:
            cand = [(r, c) for r, c in pool if b["mapped"][r, c]]
            k = math.ceil(ratio * len(cand) - 1e-6)
            ranked = sorted(cand, key=lambda rc: (-(b["l_s"][rc] - b["l_t"][rc]), rc[0] * 5 + rc[1]))
            sel_tokens += [(i, r, c) for r, c in ranked[:k]]
        trained_tokens += [(i, r, c) for r in range(2) for c in range(5) if not b["mapped"][r, c]]
    trained_tokens += sel_tokens
    got = {(i, r, c) for i, b in enumerate(chosen) for r, c in zip(*np.nonzero(b["selected"]))}
    assert got == set(sel_tokens)
    st = selection_stats(chosen)
    at = lambda key, t: batches[t[0]][key][t[1], t[2]]  # noqa: E731
    assert st["selected"] == len(sel_tokens) and st["trained"] == len(trained_tokens) and st["tokens"] == 20
    for kind in ("clean", "noise"):
        mine = [t for t in sel_tokens if at("kind", t) == kind]
        cand = [(i, r, c) for i, b in enumerate(batches) for r in range(2) for c in range(5)
                if b["mapped"][r, c] and b["kind"][r, c] == kind]
        assert st["selected_share"][kind] == pytest.approx(len(mine) / len(sel_tokens))
        assert st["selected_rate"][kind] == pytest.approx(len(mine) / len(cand))
        if mine:
            assert st["excess_by_kind"][kind] == pytest.approx(np.mean([at("l_s", t) - at("l_t", t) for t in mine]))
    assert st["teacher_loss"] == pytest.approx(np.mean([at("l_t", t) for t in sel_tokens]))
    assert st["excess"] == pytest.approx(np.mean([at("l_s", t) - at("l_t", t) for t in sel_tokens]))
    assert st["student_loss"] == pytest.approx(np.mean([at("l_s", t) for t in sel_tokens]))
    unmapped = [t for t in trained_tokens if not at("mapped", t)]
    assert len(unmapped) == 3 and st["unmapped_share_of_trained"] == pytest.approx(3 / len(trained_tokens))  # all trained
    docs_eff, top_seq = [], []
    for i in range(2):
        mine = [t for t in sel_tokens if t[0] == i]
        counts = np.array([sum(1 for t in mine if at("doc", t) == d) for d in sorted({at("doc", t) for t in mine})])
        p = counts / counts.sum()
        docs_eff.append(math.exp(-sum(x * math.log(x) for x in p)))
        top_seq.append(max(sum(1 for t in mine if t[1] == r) for r in range(2)) / len(mine))
    assert st["docs_effective"] == pytest.approx(np.mean(docs_eff))
    assert st["top_sequence_share"] == pytest.approx(np.mean(top_seq))
    ids = sorted((sum(1 for t in sel_tokens if at("ids", t) == v) for v in {at("ids", t) for t in sel_tokens}), reverse=True)
    assert st["top_ids_share"] == pytest.approx(sum(ids[:TOP_IDS]) / len(sel_tokens))


def test_selection_diagnosis_worked_values():
    """The micro-batch top 20% of the hand batches, by hand: batch 1 has 8 mapped targets (k = 2):
    excess 5.5 (row 1, col 1) and 4.0 (row 0, col 0); batch 2 has 9 (k = 2): 8.0 (row 0, col 2) and
    3.0 (row 1, col 2)."""
    from pipeline.method.guided_loss import SelectionConfig
    from repro.diagnose import select, selection_stats

    batches = _hand_batches()
    st = selection_stats(select(batches, [b["l_s"] for b in batches], SelectionConfig(ratio=0.2)))
    assert st["selected"] == 4 and st["selected_share"]["clean"] == 1.0 and st["selected_rate"]["clean"] == pytest.approx(4 / 13)
    assert st["teacher_loss"] == pytest.approx((0.5 + 1.0 + 1.0 + 0.0) / 4)
    assert st["excess"] == pytest.approx((5.5 + 4.0 + 8.0 + 3.0) / 4)
    assert st["unmapped_share_of_trained"] == pytest.approx(3 / 7)  # 3 unmapped targets, trained with the 4
    assert st["top_sequence_share"] == pytest.approx(0.5)  # one token per sequence in both batches
    assert st["docs_effective"] == pytest.approx(2.0)  # two documents, one token each, in both batches
    every = selection_stats(select(batches, [b["l_s"] for b in batches], SelectionConfig(mode="cpt")))
    assert every["selected"] == 17 and every["unmapped_share_of_trained"] == pytest.approx(3 / 20)


def test_loss_groups_and_their_means():
    from repro.diagnose import loss_groups, mean_by_group

    batches = _hand_batches()
    groups = loss_groups(batches, [b["l_s"] for b in batches], ratios=(0.2, 0.5))
    top = groups[0]["math, top 20%"]
    assert top.sum() == 2 and top[1, 1] and top[0, 0]  # batch 1's top 20%, both on math pages
    for g in groups:  # disjoint, and every math-page or noise-page target is in one group
        total = sum(m.astype(int) for m in g.values())
        assert total.max() == 1
    means = mean_by_group([b["l_s"] for b in batches], groups)
    noise = [b["l_s"][r, c] for b in batches for r in range(2) for c in range(5) if b["kind"][r, c] == "noise"]
    assert means["noise"] == pytest.approx(np.mean(noise))
    assert means["math, top 20%"] == pytest.approx(np.mean([5.0, 6.0, 9.0, 3.0]))
