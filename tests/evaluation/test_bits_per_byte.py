"""Held-out bits per byte (``pipeline/method/bits_per_byte.py``, ``pipeline/evaluation/held_out.py``): against a
token-by-token hand computation on tiny real models, across two tokenizers, its statistics, the
text files it reads, and ``make eval-student``/``make compare`` with it through the real CLI."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline.method.bits_per_byte import TextLoss, summarize, text_losses
from pipeline.evaluation.held_out import HeldOutText, HeldOutTextError, read_documents, text_digest

REPO = Path(__file__).resolve().parents[2]
WORDS = ["<s>", "</s>", "<unk>", "the", "answer", "is", "=", "+", "1", "2", "3", ".", "x", "Solution:", "é"]
TEXTS = ["the answer is 1 + 2 = 3 .", "Solution: x + 1 = 2 . " * 4, "é", "x"]


def word_tokenizer(bos: bool) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer; without ``bos`` it has only an EOS."""
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = {"bos_token": "<s>"} if bos else {}
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>", **specials)


def random_llama(vocab: int, seed: int, context: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=context,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def by_hand(model, tokenizer, text: str, window: int) -> TextLoss:
    """One forward pass per token, no batch and no padding: the token at position ``p`` of
    ``[first, *ids]`` is read from the block that predicts it, which starts at ``((p-1)//window)*window``."""
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    seq = [first, *ids]
    nats = 0.0
    with torch.no_grad():
        for p in range(1, len(seq)):
            start = ((p - 1) // window) * window
            logits = model(input_ids=torch.tensor([seq[start:p]])).logits[0, -1].float()
            nats -= torch.log_softmax(logits, dim=-1)[seq[p]].item()
    return TextLoss(nats=nats, n_bytes=len(text.encode("utf-8")), n_tokens=len(ids))


@pytest.mark.parametrize("bos", [True, False], ids=["bos", "eos-only"])
def test_each_texts_loss_equals_a_token_by_token_hand_computation(bos):
    tokenizer = word_tokenizer(bos)
    model = random_llama(len(WORDS), seed=0)
    for window in (3, 63):  # several blocks per text, and the whole text in one block
        got = text_losses(model, tokenizer, TEXTS, window=window, batch_size=3)
        for text, g in zip(TEXTS, got):
            want = by_hand(model, tokenizer, text, window)
            assert (g.n_bytes, g.n_tokens) == (want.n_bytes, want.n_tokens)
            assert g.nats == pytest.approx(want.nats, rel=1e-5), (window, text)
    assert [x.n_bytes for x in got] == [25, 88, 2, 1]  # "é" is two UTF-8 bytes, one token


def test_batching_and_padding_change_nothing():
    tokenizer, model = word_tokenizer(True), random_llama(len(WORDS), seed=1)
    one = text_losses(model, tokenizer, TEXTS, window=5, batch_size=1)
    many = text_losses(model, tokenizer, TEXTS, window=5, batch_size=16)
    assert [x.nats for x in one] == pytest.approx([x.nats for x in many], rel=1e-6)


def test_summary_statistics_by_hand():
    losses = [TextLoss(10.0, 8, 4), TextLoss(3.0, 2, 1), TextLoss(0.0, 0, 0), TextLoss(7.0, 10, 5)]
    s = summarize(losses)
    per_doc = [10 / math.log(2) / 8, 3 / math.log(2) / 2, 7 / math.log(2) / 10]  # the empty text has no per-document value
    assert s["bits_per_byte"] == pytest.approx(20 / math.log(2) / 20)  # total bits / total bytes, not a mean of ratios
    assert s["nats_per_token"] == pytest.approx(20 / 10)
    assert (s["documents"], s["bytes"], s["tokens"]) == (4, 20, 10)
    assert s["document_mean"] == pytest.approx(sum(per_doc) / 3)
    half = 4.302652729911275 * statistics.stdev(per_doc) / math.sqrt(3)  # t(0.975, df=2) from tables
    assert s["document_ci"] == pytest.approx([s["document_mean"] - half, s["document_mean"] + half])
    assert summarize([TextLoss(1.0, 1, 1)])["document_ci"] is None


def test_the_interval_over_documents_takes_the_t_tables_quantile_as_the_study_does():
    from repro.stats import t_quantile

    for df, table in ((1, 12.7062047), (2, 4.3026527), (5, 2.5705818), (7, 2.3646243), (10, 2.2281389), (30, 2.0422725)):
        losses = [TextLoss(nats=(1.0 + 0.01 * (i % 3) + 0.001 * i) * math.log(2) * 100, n_bytes=100, n_tokens=10)
                  for i in range(df + 1)]
        per_doc = [x.nats / math.log(2) / x.n_bytes for x in losses]
        low, high = summarize(losses)["document_ci"]
        t = (high - low) / 2 / (statistics.stdev(per_doc) / math.sqrt(df + 1))
        assert t == pytest.approx(table, rel=1e-7)
        assert t == pytest.approx(t_quantile(0.95, df), rel=1e-12)


def test_comparable_across_tokenizers(tiny_student, real_tokenizer):
    """One text, two real tokenizers of different vocabularies: the same bytes, other token counts,
    and bits per byte is each model's total bits over those bytes."""
    from pipeline.method.tokenization import load_tokenizer

    text = ["Let x = 12. Then 3x + 4 = 40, so the answer is 40 🙂.", "Solve for y: 2y = 14, hence y = 7."]
    results = {}
    for name, tokenizer in (("tiny-sp", load_tokenizer(str(tiny_student))), ("mistral", real_tokenizer("mistral"))):
        model = random_llama(len(tokenizer), seed=2)
        losses = text_losses(model, tokenizer, text, window=16, batch_size=4)
        for t, got in zip(text, losses):
            assert got.nats == pytest.approx(by_hand(model, tokenizer, t, 16).nats, rel=1e-5)
        results[name] = summarize(losses)
    a, b = results["tiny-sp"], results["mistral"]
    assert a["bytes"] == b["bytes"] == sum(len(t.encode("utf-8")) for t in text)
    assert a["tokens"] != b["tokens"]
    for s in (a, b):
        assert s["bits_per_byte"] == pytest.approx(s["nats"] / math.log(2) / s["bytes"])
        assert s["nats_per_token"] == pytest.approx(s["nats"] / s["tokens"])


def test_text_files_one_document_per_txt_file_and_per_jsonl_line(tmp_path):
    (tmp_path / "a.txt").write_text("First document.\nIts second line.\n", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "Second."}\n\n{"text": ""}\n{"text": "Third 🙂."}\n', encoding="utf-8")
    held = HeldOutText(text_files=(str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")))
    texts, sources = read_documents(held)
    assert texts == ["First document.\nIts second line.\n", "Second.", "Third 🙂."]  # the empty text is left out
    assert [s["documents"] for s in sources] == [1, 2]
    cut, _ = read_documents(HeldOutText(text_files=held.text_files, max_documents=2))
    assert cut == texts[:2] and text_digest(cut) != text_digest(texts)
    assert text_digest(["ab", "c"]) != text_digest(["a", "bc"])  # documents, not just their concatenation
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n', encoding="utf-8")
    with pytest.raises(HeldOutTextError, match=r"bad.jsonl:2: expected an object with a \"text\" string"):
        read_documents(HeldOutText(text_files=(str(tmp_path / "bad.jsonl"),)))


# ---- through the real CLI ----------------------------------------------------------------------


def eval_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.eval_student", *args, f"hydra.run.dir={tmp_path / 'logs'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_eval_student_measures_held_out_text_alone_and_compare_shows_it(tiny_student, tmp_path):
    """The CLI with tasks=[] and a JSONL file, against the hand computation; the same text at another
    window (through the library) side by side with it in make compare's table."""
    from transformers import AutoModelForCausalLM

    from pipeline.evaluation.compare import compare, load_result, markdown_table
    from pipeline.evaluation.generation import GenerationConfig
    from pipeline.evaluation.run import EvalJobConfig, run_evaluation
    from pipeline.method.tokenization import load_tokenizer

    texts = ["The sum of 3 and 4 is 7.", "Let x = 5. Then 2x = 10.", "A prime has two divisors."]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    done = eval_cli(tmp_path, f"checkpoint={tiny_student}", "tasks=[]", f"bits_per_byte.texts=[{held}]",
                    "bits_per_byte.window=8", "generation.cpu_threads=1", "label=a", f"out_dir={tmp_path / 'a'}")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert "bits/byte" in done.stdout and "per-document mean" in (tmp_path / "a" / "eval.md").read_text()
    b = record["bits_per_byte"]
    model = AutoModelForCausalLM.from_pretrained(tiny_student).eval()
    hand = [by_hand(model, load_tokenizer(str(tiny_student)), t, 8) for t in texts]
    assert b["bits_per_byte"] == pytest.approx(sum(h.nats for h in hand) / math.log(2) / sum(h.n_bytes for h in hand), rel=1e-5)
    assert (b["documents"], b["bytes"], b["tokens"]) == (3, sum(h.n_bytes for h in hand), sum(h.n_tokens for h in hand))
    assert b["comparable"] == {"text_sha256": text_digest(texts), "documents": 3, "bytes": b["bytes"]}
    assert record["tasks"] == {} and b["window"] == 8 and len(b["document_ci"]) == 2
    assert b["sources"] == [{"kind": "text_file", "path": str(held), "documents": 3}]

    run_evaluation(EvalJobConfig(generation=GenerationConfig(model=str(tiny_student), cpu_threads=1), tasks=[],
                                 output_dir=str(tmp_path / "b"), label="b", progress=False,
                                 bits_per_byte=HeldOutText(text_files=(str(held),))))  # window: the context - 1
    c = compare([load_result(tmp_path / "a"), load_result(tmp_path / "b")], ["a", "b"], ["ra", "rb"])
    table = markdown_table(c)
    assert "| held out | a | b |" in table and f"| bits/byte | {b['bits_per_byte']:.4f} |" in table
    assert "window (tokens of context) differs: a 8, b 63" in table


def test_compare_refuses_results_on_different_held_out_text(tmp_path):
    from pipeline.evaluation.compare import compare

    def result(digest: str) -> dict:
        held = {"bits_per_byte": 1.0, "document_mean": 1.0, "document_ci": None, "level": 0.95, "nats_per_token": 2.0,
                "documents": 1, "bytes": 5, "tokens": 3, "window": 8,
                "comparable": {"text_sha256": digest, "documents": 1, "bytes": 5}}
        return {"tasks": {}, "settings": {}, "bits_per_byte": held}

    with pytest.raises(ValueError, match="bits_per_byte: b vs a: text_sha256: 'y' != 'x'"):
        compare([result("x"), result("y")], ["a", "b"], ["ra", "rb"])
    flagged = compare([result("x"), result("y")], ["a", "b"], ["ra", "rb"], allow_mismatch=True)
    assert set(flagged.mismatches) == {"bits_per_byte"}


def test_wrong_held_out_inputs_end_with_every_problem_and_exit_2(tiny_student, tmp_path):
    not_a_dataset = tmp_path / "not-scored"
    not_a_dataset.mkdir()
    missing = tmp_path / "missing.txt"
    bad = eval_cli(tmp_path, f"checkpoint={tiny_student}", "tasks=[]", f"bits_per_byte.texts=[{missing}]",
                   f"bits_per_byte.scored={not_a_dataset}", f"out_dir={tmp_path / 'out'}")
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.startswith("error: invalid configuration (2 problems):")
    assert f"bits_per_byte.texts: text file not found: {missing}" in bad.stderr
    assert f"bits_per_byte.scored: {not_a_dataset} is not a scored dataset" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "out").exists()

    alone = eval_cli(tmp_path, f"checkpoint={tiny_student}", "tasks=[]", f"bits_per_byte.texts=[{missing}]")
    assert alone.returncode == 2 and alone.stderr == f"error: bits_per_byte.texts: text file not found: {missing}\n"


def test_tasks_may_be_empty_only_with_held_out_text(tiny_student, tmp_path):
    from hydra import compose, initialize_config_dir

    from stages.common import ConfigError
    from stages.eval_student import job_config

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="eval_student", overrides=[f"checkpoint={tiny_student}", "tasks=[]",
                                                             "bits_per_byte.window=0", "bits_per_byte.shards=[x]"])
    with pytest.raises(ConfigError) as err:
        job_config(cfg)
    for problem in ("tasks: give at least one task, or held-out text", "bits_per_byte.window: 0 must be >= 1",
                    "bits_per_byte.shards: name the scored folder they belong to"):
        assert problem in str(err.value)
