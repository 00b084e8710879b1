"""The transformers backend against independent computations, on tiny real models."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from pipeline.score_teacher.corpus import Document
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.hf import TransformersScorer, batches_by_tokens, head_chunk_positions
from pipeline.score_teacher.teacher import WindowSettings, score_documents
from pipeline.method.tokenization import encode, load_tokenizer


@pytest.fixture(scope="module")
def teacher(micro_teacher):
    tok = load_tokenizer(str(micro_teacher))
    scorer = TransformersScorer(ScorerConfig(model=str(micro_teacher), window=64))
    return tok, scorer


def test_stored_losses_equal_the_models_own_cross_entropy(teacher, micro_teacher):
    tok, scorer = teacher
    text = "Solution: 12 + 30 = 42, so the answer is $42$."
    result = score_documents([Document("d:0", text)], tok, scorer, WindowSettings(window=64, stride=32, bos_id=None))
    doc = result.documents[0]
    assert 2 <= len(doc.ids) < 64, "the document must fit one window for this check"
    model = AutoModelForCausalLM.from_pretrained(str(micro_teacher)).eval()
    ids = torch.tensor(doc.ids, dtype=torch.long)[None]
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()  # mean CE over tokens 1..M-1
    assert np.isnan(doc.losses[0]), "no BOS: the first token has no prediction and must be NaN"
    assert abs(np.nanmean(doc.losses) - expected) < 1e-4


def test_chunked_head_equals_full_log_softmax(teacher):
    tok, scorer = teacher
    ids = encode(tok, "Let $f(x) = x^2$. Then f'(x) = 2x for every x ∈ ℝ. 🙂").ids
    x = torch.tensor(ids, dtype=torch.long)[None]
    with torch.no_grad():
        logp = torch.log_softmax(scorer.model(input_ids=x).logits.float(), -1)[0]
    reference = -logp[torch.arange(len(ids) - 1), x[0, 1:]].numpy()
    small = TransformersScorer(ScorerConfig(model="unused", max_logits_bytes=4 * scorer.vocab_size * 3), model=scorer.model)
    assert small.chunk_positions == 3
    got = small.score([ids])[0]
    np.testing.assert_allclose(got[1:], reference, atol=1e-5)


def test_batched_and_padded_equals_one_at_a_time(teacher):
    tok, scorer = teacher
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, scorer.vocab_size, size=n).astype(np.int32) for n in (5, 64, 17, 2, 40)]
    alone = [scorer.score([w])[0] for w in windows]
    together = TransformersScorer(ScorerConfig(model="unused", max_batch_tokens=128), model=scorer.model).score(windows)
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a, b, atol=1e-5, equal_nan=True)


def test_batches_respect_the_token_budget():
    lengths = [5, 64, 17, 2, 40, 64, 3]
    groups = batches_by_tokens(lengths, 128)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 128
    assert head_chunk_positions(151_936, 256 * 2**20) == 441


def test_windows_equal_whole_document_when_context_covers_the_receptive_field():
    """A sliding-window-attention model sees at most layers*(sliding_window-1) tokens back, so
    scoring in windows with at least that much left context must equal scoring the whole
    document; with less context it must differ (the check can fail)."""
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=8)
    scorer = TransformersScorer(ScorerConfig(model="unused"), model=MistralForCausalLM(config).eval())
    ids = np.random.default_rng(0).integers(0, 300, size=300).astype(np.int32)
    docs_scorer = _EncodedScorer(scorer)
    whole = docs_scorer.losses(ids, window=512, stride=256)
    enough = docs_scorer.losses(ids, window=48, stride=24)  # left context 24 >= receptive field 15
    too_little = docs_scorer.losses(ids, window=20, stride=12)  # left context 8 < 15
    np.testing.assert_allclose(enough, whole, atol=1e-5, equal_nan=True)
    assert np.nanmax(np.abs(too_little - whole)) > 1e-3


def test_bos_gives_the_first_token_a_loss(teacher):
    tok, scorer = teacher
    docs = [Document("d:0", "x = 1 and y = 2")]
    with_bos = score_documents(docs, tok, scorer, WindowSettings(window=64, stride=32, bos_id=tok.eos_token_id))
    without = score_documents(docs, tok, scorer, WindowSettings(window=64, stride=32, bos_id=None))
    a, b = with_bos.documents[0], without.documents[0]
    assert (a.ids == b.ids).all(), "BOS is context only, never stored as a token"
    assert np.isfinite(a.losses).all() and np.isnan(b.losses[0])


class _EncodedScorer:
    """Score pre-tokenized ids through the same window path score_documents uses."""

    def __init__(self, scorer):
        self.scorer = scorer

    def losses(self, ids, window, stride):
        from pipeline.score_teacher.teacher import _score_encodings
        from pipeline.method.tokenization import Encoding

        enc = Encoding(ids=ids, starts=np.zeros_like(ids), ends=np.zeros_like(ids))
        return _score_encodings([enc], self.scorer, WindowSettings(window=window, stride=stride, bos_id=None))[0]


def _record_backbone_calls(scorer):
    """Forward hook on the backbone: each call's keyword arguments and output (real forward)."""
    calls = []
    handle = scorer.backbone.register_forward_hook(
        lambda module, args, kwargs, output: calls.append((kwargs, output)), with_kwargs=True)
    return calls, handle


def test_the_backbone_keeps_no_key_value_cache(teacher):
    _, scorer = teacher
    calls, handle = _record_backbone_calls(scorer)
    try:
        scorer.score([np.arange(1, 40, dtype=np.int32), np.arange(5, 20, dtype=np.int32)])
    finally:
        handle.remove()
    assert calls
    for kwargs, output in calls:
        assert kwargs.get("use_cache") is False
        assert getattr(output, "past_key_values", None) is None  # no layer's K/V was kept


def test_padding_waste_is_small_on_a_mixed_length_batch_and_losses_unchanged(teacher):
    """Pad tokens actually fed to the backbone (counted from the attention masks it receives),
    against the same windows batched in their given order under the same token budget."""
    _, scorer = teacher
    rng = np.random.default_rng(1)
    lengths = [64 if i % 3 == 0 else int(rng.integers(2, 64)) for i in range(30)]  # full windows and tails
    windows = [rng.integers(0, scorer.vocab_size, size=n).astype(np.int32) for n in lengths]
    budget = 256
    sorted_scorer = TransformersScorer(ScorerConfig(model="unused", max_batch_tokens=budget), model=scorer.model)
    calls, handle = _record_backbone_calls(sorted_scorer)
    try:
        got = sorted_scorer.score(windows)
    finally:
        handle.remove()
    pads = sum(int((kwargs["attention_mask"] == 0).sum()) for kwargs, _ in calls)

    in_order_pads, group, width = 0, [], 0  # reference: batches in the given order, same budget
    for n in lengths + [None]:
        if n is None or (group and max(width, n) * (len(group) + 1) > budget):
            in_order_pads += len(group) * width - sum(group)
            group, width = [], 0
        if n is not None:
            group.append(n)
            width = max(width, n)
    assert in_order_pads > 500, "the reference must waste padding for the comparison to mean anything"
    assert pads <= 0.5 * in_order_pads, (pads, in_order_pads)
    for w, losses in zip(windows, got):  # the same losses as each window scored alone
        np.testing.assert_allclose(losses, scorer.score([w])[0], atol=1e-5, equal_nan=True)


def test_weights_are_loaded_onto_the_actor_device(micro_teacher, monkeypatch):
    """No GPU here: the test checks the argument that makes transformers place each weight on the
    device while loading (``device_map``), by wrapping the real ``from_pretrained``, and that the
    loaded model sits on that device."""
    import transformers

    from pipeline.score_teacher.backends.hf import load_causal_lm

    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    device = torch.device("cpu")
    model = load_causal_lm(ScorerConfig(model=str(micro_teacher)), device)
    assert seen and seen[0]["device_map"] == {"": device}
    assert {p.device for p in model.parameters()} == {device}
