"""Stored losses token by token: the stage-1 job (real Ray, real Parquet) against an independent
log-softmax gather in plain torch, for a teacher whose tokenizer adds a BOS (Llama-2's) and one
whose tokenizer does not (Qwen2's), on documents that need many windows.

The reference does not use the scorer, the window planner or the stitching: for each stored token
it finds the window that scores it in closed form (METHOD 1.3: windows start at multiples of the
stride; a token is scored by the first window that reaches it), runs the model's full forward on
that window and takes ``-log_softmax(logits)[target]``."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.job import run_score_job
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.writer import StorageConfig
from storage_schemas import complete_shard_files, read_manifest

WINDOW, STRIDE = 24, 7  # a stride other than window // 2, so that a wrong stride shows


def build_random_teacher(tokenizer, folder, seed: int = 0):
    """A tiny random Llama over ``tokenizer``'s vocabulary, saved with it as a teacher folder.
    Weights are large enough that a token's loss depends clearly on its left context."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def reference_losses(model, token_ids: list[int], bos_id: int | None) -> np.ndarray:
    """-log p(token | its window's left context) per stored token; NaN where nothing predicts it."""
    z = ([bos_id] if bos_id is not None else []) + list(token_ids)
    n, shift = len(z), int(bos_id is not None)
    out = np.full(len(token_ids), np.nan)
    by_window: dict[int, list[int]] = {}
    for p in range(1, n):  # z position p; window k starts at k * STRIDE and is the first to reach p
        k = 0 if p < WINDOW else (p - WINDOW) // STRIDE + 1
        by_window.setdefault(k, []).append(p)
    for k, positions in by_window.items():
        start = k * STRIDE
        x = torch.tensor(z[start : min(start + WINDOW, n)], dtype=torch.long)[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=x).logits[0].double(), dim=-1)  # (T, V)
        for p in positions:
            assert p - start >= min(p, WINDOW - STRIDE), "every scored token keeps its left context"
            out[p - shift] = -logp[p - start - 1, z[p]].item()
    return out


def whole_document_losses(model, token_ids: list[int], bos_id: int | None) -> np.ndarray:
    z = ([bos_id] if bos_id is not None else []) + list(token_ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor(z)[None]).logits[0].double(), dim=-1)
    losses = np.r_[np.nan, -logp[torch.arange(len(z) - 1), torch.tensor(z[1:])].numpy()]
    return losses[len(z) - len(token_ids):]


@pytest.fixture(scope="module")
def corpus(micro_corpus, tmp_path_factory):
    """A long page (many windows), short ones (one window, one token) and hostile text."""
    from pipeline.embedded.sample_corpus import clean_texts

    texts = clean_texts(micro_corpus)
    long_page = max(texts[:40], key=len)[:1500]
    rows = [long_page, "x", "Let 🙂 f(x) = x² + 1 ∈ ℝ; 中文 also.\n\n  Done.", texts[3][:300]]
    path = tmp_path_factory.mktemp("corpus") / "pages.parquet"
    pq.write_table(pa.table({"text": rows}), path)
    return path, rows


@pytest.mark.parametrize("teacher_tokenizer,has_bos,precision",
                         [("llama-spm", True, "float32"), ("qwen2", False, "float32"), ("qwen2", False, "bfloat16")])
def test_stored_losses_equal_an_independent_log_softmax_gather(real_tokenizer, corpus, ray_local, tmp_path,
                                                              teacher_tokenizer, has_bos, precision):
    """float32 storage keeps the computed loss (1e-4); bfloat16, the default, keeps it to half a
    bfloat16 step (8 significant bits: at most 2**-8 of the value) and stores only bfloat16 values."""
    tokenizer = real_tokenizer(teacher_tokenizer)
    model = build_random_teacher(tokenizer, tmp_path / "teacher")
    corpus_file, texts = corpus
    out = tmp_path / "scored"
    summary = run_score_job(ScoreJobConfig(
        teacher=TeacherConfig(name="random", model=str(tmp_path / "teacher"), window=WINDOW, stride=STRIDE),
        corpus=CorpusConfig(name="pages", files=[str(corpus_file)], rows_per_shard=2),
        scorer=ScorerConfig(max_batch_tokens=256),
        output_dir=str(out), pool=PoolConfig(num_actors=1, num_cpus=1), progress=False,
        storage=StorageConfig(loss_precision=precision),
    ))
    assert summary.complete and summary.documents == len(texts)
    bos_id = read_manifest(out)["identity"]["teacher"]["bos_id"]
    assert (bos_id is not None) == has_bos and (not has_bos or bos_id == tokenizer.bos_token_id)
    rows = [r for path in complete_shard_files(out) for r in pq.read_table(path).to_pylist()]
    assert [r["text"] for r in rows] == texts

    for row in rows:
        plain = tokenizer(row["text"], add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
        assert row["token_ids"] == plain["input_ids"]  # no BOS stored: only the text's tokens
        assert list(zip(row["starts"], row["ends"])) == [tuple(o) for o in plain["offset_mapping"]]
        stored = np.asarray(row["losses"], np.float64)
        want = reference_losses(model, row["token_ids"], bos_id)
        if has_bos:  # BOS is context only: it gives the first token a real loss
            assert math.isfinite(stored[0])
        else:
            assert math.isnan(stored[0]), "no BOS: nothing predicts the first token"
        if precision == "float32":
            np.testing.assert_allclose(stored, want, rtol=1e-4, atol=1e-4, equal_nan=True, err_msg=row["text"][:40])
        else:
            np.testing.assert_allclose(stored, want, rtol=2.0**-8 + 1e-4, atol=1e-4, equal_nan=True)
            as_bf16 = torch.tensor(stored, dtype=torch.float32).to(torch.bfloat16).to(torch.float64).numpy()
            np.testing.assert_array_equal(stored, as_bf16)  # nothing beyond bfloat16's 8 bits was kept

    long_ids = rows[0]["token_ids"]
    assert len(long_ids) + has_bos > 6 * WINDOW, "the long page needs many windows"
    stored = np.asarray(rows[0]["losses"], np.float64)
    # The check can fail: the model's losses depend on the context a window leaves, and they vary
    # from token to token, so reversed, shifted or differently windowed losses would not match.
    assert np.nanmax(np.abs(whole_document_losses(model, long_ids, bos_id) - stored)) > 0.05
    assert np.nanstd(stored) > 0.1
    assert len(rows[1]["token_ids"]) == 1 and math.isnan(rows[1]["losses"][0]) != has_bos
