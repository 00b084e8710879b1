"""Stage-2 data on real components: the tiny student's tokenizer, the micro scored dataset, packing,
alignment in data-loader workers, order, caching and bad shards."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.embedded.tiny_student import TinyStudentSpec, build_tiny_student
from storage_schemas.reader import BadShardError, open_scored_dataset
from pipeline.student_data.build import build_student_data
from pipeline.student_data.dataset import collate_packed
from pipeline.student_data.packing import document_order
from pipeline.student_data.settings import AlignmentConfig, PackingConfig
from pipeline.method.tokenization import TokenizerError, bos_token_id, encode, fingerprint, load_tokenizer

SEQ = 64
SMALL_STUDENT = TinyStudentSpec(vocab_size=700, limit_alphabet=100, hidden_size=32, intermediate_size=64,
                                num_layers=2, num_heads=2, num_kv_heads=1, context=128)


@pytest.fixture(scope="module")
def student_dir(micro_corpus, tmp_path_factory) -> Path:
    from pipeline.embedded.sample_corpus import clean_texts

    return build_tiny_student(clean_texts(micro_corpus), tmp_path_factory.mktemp("student") / "tiny", SMALL_STUDENT)


@pytest.fixture(scope="module")
def student(student_dir):
    return load_tokenizer(str(student_dir))


@pytest.fixture(scope="module")
def scored(micro_scored):
    return open_scored_dataset([micro_scored])


def data_for(scored, tokenizer, tmp_path=None, **packing):
    alignment = packing.pop("alignment", AlignmentConfig())
    on_bad_shard = packing.pop("on_bad_shard", "error")
    return build_student_data(scored, tokenizer, PackingConfig(seq_len=SEQ, **packing), alignment,
                              cache_dir=tmp_path, on_bad_shard=on_bad_shard)


# --------------------------------------------------------------------------------------------
# The tiny student's tokenizer


def test_tiny_student_tokenizer_is_sentencepiece_style_with_byte_fallback(student, micro_teacher):
    from transformers import AutoTokenizer

    assert student.is_fast and type(AutoTokenizer.from_pretrained(student.name_or_path)).__name__ != "PreTrainedTokenizer"
    text = "Let 🙂 x = 12"
    enc = encode(student, text)
    pieces = student.convert_ids_to_tokens(enc.ids.tolist())
    # The first word's virtual space has no source character: "▁L..." covers (0, len - 1).
    assert pieces[0].startswith("▁L") and (enc.starts[0], enc.ends[0]) == (0, len(pieces[0]) - 1)
    emoji = [i for i, p in enumerate(pieces) if p.startswith("<0x")]
    assert [pieces[i] for i in emoji] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert {(enc.starts[i], enc.ends[i]) for i in emoji} == {(4, 5)}  # all carry the emoji's span
    assert bos_token_id(student) == student.convert_tokens_to_ids("<s>") == 1
    assert student.decode(student(text)["input_ids"], skip_special_tokens=True) == text
    assert student.eos_token_id not in encode(student, "quoted </s> and <s> stay text").ids
    teacher = load_tokenizer(str(micro_teacher))
    assert fingerprint(teacher) != fingerprint(student)
    shared = set(teacher.get_vocab()) & set(student.get_vocab())
    assert len(shared) < 0.5 * len(student)  # really another vocabulary


def test_tiny_student_build_is_cached(micro_corpus, student_dir):
    from pipeline.embedded.sample_corpus import clean_texts

    stamp = (student_dir / "_BUILD.json").stat().st_mtime_ns
    assert build_tiny_student(clean_texts(micro_corpus), student_dir, SMALL_STUDENT) == student_dir
    assert (student_dir / "_BUILD.json").stat().st_mtime_ns == stamp


# --------------------------------------------------------------------------------------------
# Packing and alignment


def brute_force_teacher_loss(student_enc, row: dict) -> np.ndarray:
    """max over overlapping teacher tokens of their finite losses, NaN if none (METHOD 2.1)."""
    out = np.full(len(student_enc), np.nan, np.float32)
    for i, (c, d) in enumerate(zip(student_enc.starts, student_enc.ends)):
        values = [l for a, b, l in zip(row["starts"], row["ends"], row["losses"])
                  if d > c and b > a and a < d and b > c and not math.isnan(l)]
        if values:
            out[i] = max(values)
    return out


def expected_stream(data, tokenizer, n_docs: int):
    """ids, L_t and mapped of the first ``n_docs`` documents of the plan, rebuilt independently."""
    tables = {i: pq.read_table(s.path).to_pylist() for i, s in enumerate(data.scored.shards)}
    ids, losses = [], []
    for shard, row in zip(data.plan.doc_shard[:n_docs], data.plan.doc_row[:n_docs]):
        record = tables[int(shard)][int(row)]
        enc = encode(tokenizer, record["text"])
        ids += [tokenizer.bos_token_id, *enc.ids.tolist(), tokenizer.eos_token_id]
        losses += [np.nan, *brute_force_teacher_loss(enc, record).tolist(), np.nan]
    losses = np.asarray(losses, np.float32)
    return np.asarray(ids), losses, ~np.isnan(losses)


def test_samples_are_the_packed_aligned_stream(scored, student):
    data = data_for(scored, student)
    ds = data.dataset
    n = 12
    ids, losses, mapped = expected_stream(data, student, n_docs=n)
    covered = int(data.plan.doc_end[n - 1]) // SEQ - 1  # samples entirely inside the first n documents
    assert covered > 3
    samples = [ds[k] for k in range(covered)]
    got_ids = np.concatenate([s["input_ids"].numpy() for s in samples] + [samples[-1]["labels"][-1:].numpy()])
    np.testing.assert_array_equal(got_ids, ids[: covered * SEQ + 1])
    for k, s in enumerate(samples):  # targets and their teacher losses are the next position's
        window = slice(k * SEQ + 1, (k + 1) * SEQ + 1)
        np.testing.assert_array_equal(s["labels"].numpy(), ids[window])
        np.testing.assert_array_equal(s["teacher_loss"].numpy(), losses[window])
        np.testing.assert_array_equal(s["mapped"].numpy(), mapped[window])
        assert int(s["sample_index"]) == k and s["input_ids"].dtype == torch.int64
    eos = student.eos_token_id
    assert (got_ids == eos).sum() >= n - 1 and not np.any(mapped[ids == eos])
    assert len(ds) == data.plan.n_samples == (data.plan.n_tokens - 1) // SEQ


def test_empty_documents_are_left_out_and_teacherless_ones_are_unmapped(scored, student):
    data = data_for(scored, student, shuffle=False)
    texts = [t for s in data.scored.shards for t in pq.read_table(s.path, columns=["text"]).column("text").to_pylist()]
    n_empty = sum(1 for t in texts if len(encode(student, t)) == 0)
    assert n_empty >= 1 and data.plan.n_empty == n_empty
    assert data.plan.doc_row.size == len(texts) - n_empty
    whitespace = [i for i, t in enumerate(texts) if t and not t.strip()]
    assert whitespace, "the micro corpus has whitespace-only documents"
    d = whitespace[0] - sum(1 for t in texts[: whitespace[0]] if len(encode(student, t)) == 0)
    doc = data.dataset.document(d)
    assert doc.ids.size > 2 and not doc.mapped.any() and np.isnan(doc.teacher_loss).all()


def test_alignment_variants(scored, student, micro_teacher):
    token_max = data_for(scored, student).dataset
    token_min = data_for(scored, student, alignment=AlignmentConfig(aggregate="min")).dataset
    for k in range(3):
        hi, lo = token_max[k]["teacher_loss"].numpy(), token_min[k]["teacher_loss"].numpy()
        assert np.array_equal(np.isnan(hi), np.isnan(lo)) and np.all(lo[~np.isnan(lo)] <= hi[~np.isnan(hi)])
    chunked = data_for(scored, student, alignment=AlignmentConfig(method="chunk", n_chunks=2)).dataset
    doc = chunked.document(0)
    assert len(set(doc.teacher_loss[doc.mapped].tolist())) <= 2  # one mean per chunk
    # The teacher's own tokenizer as the student: one-to-one, the stored losses exactly.
    teacher_tok = load_tokenizer(str(micro_teacher))
    same = data_for(scored, teacher_tok)
    assert same.alignment.method == "one_to_one" and not same.plan.add_bos
    row = pq.read_table(same.scored.shards[int(same.plan.doc_shard[0])].path).to_pylist()[int(same.plan.doc_row[0])]
    first = same.dataset[0]
    n = min(SEQ, len(row["token_ids"]) - 1)
    np.testing.assert_array_equal(first["labels"][:n].numpy(), row["token_ids"][1 : n + 1])
    np.testing.assert_array_equal(first["teacher_loss"][:n].numpy(), np.asarray(row["losses"][1 : n + 1], np.float32))


def test_order_is_a_function_of_seed_and_epoch():
    rows = [5, 3, 4]
    a = document_order(rows, seed=1, epoch=0, shuffle=True)
    assert all(np.array_equal(x, y) for x, y in zip(a, document_order(rows, 1, 0, True)))
    assert not np.array_equal(a[1], document_order(rows, 2, 0, True)[1])
    assert not np.array_equal(a[1], document_order(rows, 1, 1, True)[1])
    pairs = sorted(zip(a[0].tolist(), a[1].tolist()))
    assert pairs == [(s, r) for s, n in enumerate(rows) for r in range(n)]  # every document once
    shard, row = document_order(rows, 1, 0, shuffle=False)
    assert shard.tolist() == [0] * 5 + [1] * 3 + [2] * 4 and row.tolist() == [*range(5), *range(3), *range(4)]


def test_order_follows_the_documented_generators():
    """The order is a stored run's contract (a resumed run must see the same samples): shards
    permuted by ``default_rng([seed, epoch])``, rows by ``default_rng([seed, epoch, shard])``."""
    rows, seed = [4, 6, 5], 11
    for epoch in (0, 1):
        shard_order = np.random.default_rng([seed, epoch]).permutation(3)
        want_shard = np.concatenate([np.full(rows[s], s) for s in shard_order])
        want_row = np.concatenate([np.random.default_rng([seed, epoch, int(s)]).permutation(rows[s]) for s in shard_order])
        shard, row = document_order(rows, seed, epoch, shuffle=True)
        assert shard.tolist() == want_shard.tolist() and row.tolist() == want_row.tolist()


def test_packing_plan_hand_worked():
    """Documents of 3, 0, 2 and 5 student tokens in file order, BOS and EOS: stream lengths 5, -, 4,
    7 (the empty one left out), 16 tokens; with seq_len 5 a sample needs 6 tokens, so samples start
    at 0, 5, 10 and the third needs tokens 10..15: 3 samples. 15 tokens would give only 2."""
    from pipeline.student_data.packing import build_plan

    lengths = [np.array([3, 0], np.int32), np.array([2, 5], np.int32)]
    plan = build_plan(lengths, PackingConfig(seq_len=5, shuffle=False), add_bos=True)
    assert plan.doc_shard.tolist() == [0, 1, 1] and plan.doc_row.tolist() == [0, 0, 1]
    assert plan.doc_end.tolist() == [5, 9, 16] and plan.n_empty == 1 and plan.n_tokens == 16
    assert plan.n_samples == 3
    assert plan.documents_of(0) == [(0, 0, 5), (1, 0, 1)]  # 6 tokens: document 0 whole, BOS of document 1
    assert plan.documents_of(1) == [(1, 0, 4), (2, 0, 2)]  # the overlap token is the last input of sample 0
    assert plan.documents_of(2) == [(2, 1, 7)]
    with pytest.raises(IndexError):
        plan.documents_of(3)
    assert list(plan.document_span(1, 2)) == [1, 2]
    # Without BOS: 4 + 3 + 6 = 13 tokens; seq_len 4 -> samples at 0, 4, 8 (tokens 8..12): 3 samples.
    no_bos = build_plan(lengths, PackingConfig(seq_len=4, shuffle=False), add_bos=False)
    assert no_bos.doc_end.tolist() == [4, 7, 13] and no_bos.n_samples == 3
    assert no_bos.documents_of(2) == [(2, 1, 6)]
    # A stream of exactly 2 * seq_len tokens holds one sample, not two: the second lacks its last target.
    exact = build_plan([np.array([6, 6], np.int32)], PackingConfig(seq_len=8, shuffle=False), add_bos=False)
    assert exact.n_tokens == 14 and exact.n_samples == 1
    exact = build_plan([np.array([7, 7], np.int32)], PackingConfig(seq_len=8, shuffle=False), add_bos=False)
    assert exact.n_tokens == 16 and exact.n_samples == 1


def test_epochs_are_concatenated(scored, student):
    one, two = data_for(scored, student), data_for(scored, student, epochs=2)
    assert two.plan.doc_row.size == 2 * one.plan.doc_row.size
    assert two.plan.n_tokens == 2 * one.plan.n_tokens
    np.testing.assert_array_equal(two.plan.doc_row[: one.plan.doc_row.size], one.plan.doc_row)


def test_alignment_in_workers_gives_the_same_batches(scored, student):
    ds = data_for(scored, student).dataset

    def batches(workers: int) -> list[dict]:
        loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=collate_packed)
        return [b for _, b in zip(range(5), loader)]

    for inline, parallel in zip(batches(0), batches(2)):
        for key in inline:
            torch.testing.assert_close(inline[key], parallel[key], equal_nan=True, rtol=0, atol=0)


def assert_same_samples(got: list[dict], want: list[dict]) -> None:
    """Equal bit for bit (NaN losses included)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for key in w:
            assert g[key].dtype == w[key].dtype
            assert np.array_equal(g[key].numpy().reshape(-1).view(np.uint8), w[key].numpy().reshape(-1).view(np.uint8)), key


def test_samples_do_not_depend_on_batching_read_ahead_or_order(scored, student, monkeypatch):
    """A sample is the same read alone in reverse order (no read-ahead), in sequential data-loader
    batches (read-ahead, documents tokenized many per call), in random batches, and with a budget
    so small that the cache keeps evicting; the cache stays within its bound."""
    from pipeline.student_data import dataset as student_data
    from pipeline.student_data.dataset import PackedDataset

    data = data_for(scored, student)
    n = len(data.dataset)

    def fresh(**kwargs):
        return PackedDataset(data.scored.shards, data.plan, student, data.alignment, **kwargs)

    alone = fresh()
    reference = [alone[k] for k in reversed(range(n))][::-1]
    assert alone._stride is not None and alone._stride < 0

    calls, real_encode_batch = [], student_data.encode_batch

    def counted(tokenizer, texts):
        calls.append(len(texts))
        return real_encode_batch(tokenizer, texts)

    monkeypatch.setattr(student_data, "encode_batch", counted)
    loader = torch.utils.data.DataLoader(fresh(), batch_size=4, collate_fn=lambda batch: batch)
    assert_same_samples([s for batch in loader for s in batch], reference)
    assert sum(calls) == data.plan.doc_row.size and len(calls) <= 3  # every document once, in big batches

    order = np.random.default_rng(0).permutation(n).tolist()
    shuffled = fresh()
    got = {k: s for i in range(0, n, 5) for k, s in zip(order[i : i + 5], shuffled.__getitems__(order[i : i + 5]))}
    assert_same_samples([got[k] for k in range(n)], reference)

    small = fresh(readahead_tokens=SEQ)
    assert_same_samples([s for i in range(0, n, 3) for s in small.__getitems__(list(range(i, min(i + 3, n))))],
                        reference)
    assert small._cached_tokens == sum(d.ids.size for d in small._docs.values())
    last = {d for k in range(3 * ((n - 1) // 3), n) for d, _, _ in data.plan.documents_of(k)}
    assert small._cached_tokens <= small.cache_tokens + sum(data.plan.document_length(d) for d in last)


def test_token_counts_are_cached(scored, student, tmp_path, monkeypatch):
    first = data_for(scored, student, tmp_path)
    assert len(list(tmp_path.rglob("*.npy"))) == len(scored.shards)

    def no_tokenization(job):
        raise AssertionError("counts should come from the cache")

    monkeypatch.setattr("pipeline.student_data.lengths._count_shard", no_tokenization)
    second = data_for(scored, student, tmp_path)
    np.testing.assert_array_equal(first.plan.doc_end, second.plan.doc_end)


def test_corrupt_shard_is_an_error_naming_the_file_or_skipped(micro_scored, student, tmp_path):
    folder = tmp_path / "ds"
    shutil.copytree(micro_scored, folder)
    victim = folder / "shard-000002.parquet"
    data = bytearray(victim.read_bytes())
    data[100 : len(data) // 2] = bytes(len(data) // 2 - 100)  # same size, footer intact: passes the open
    victim.write_bytes(bytes(data))
    scored = open_scored_dataset([folder])
    with pytest.raises(BadShardError, match="shard-000002.parquet"):
        data_for(scored, student)
    kept = data_for(scored, student, on_bad_shard="skip")
    assert [Path(b["file"]).name for b in kept.scored.skipped] == ["shard-000002.parquet"]
    assert victim not in [s.path for s in kept.scored.shards]
    assert kept.identity("x", PackingConfig(seq_len=SEQ))["shards_skipped"] == kept.scored.skipped


def test_slow_tokenizer_is_refused(scored, shared_tokenizers, tmp_path):
    from transformers import BertGenerationTokenizer

    shutil.copy(shared_tokenizers / "mistral-v1.tokenizer.model", tmp_path / "tokenizer.model")
    slow = BertGenerationTokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(TokenizerError, match="slow"):
        data_for(scored, slow)
