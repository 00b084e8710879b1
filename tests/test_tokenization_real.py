"""Teacher tokenization on the paper's real vocabularies (../shared/tokenizers)."""

import shutil

import numpy as np
import pytest

from pipeline.method.tokenization import TokenizerError, bos_token_id, encode, encode_batch, fingerprint

TEXTS = [
    "Let $x^2 + y^2 = r^2$ and \\frac{a}{b} \\le \\sqrt{2}.",
    "∑_{k=1}^n k = n(n+1)/2 → ∞; θ ∈ ℝ, x² ≠ y₁",
    "Nice proof 🙂👍 and a family 👨‍👩‍👧 flag 🇩🇪",
    "设 x 为实数，求 x² 的最小值。二次関数のグラフ",
    "line one\r\nline two\r\n\r\n\tindented    with   runs of spaces  \n\n",
    "special strings as text: <|endoftext|> </s> <s> <|im_start|>",
]

FILES = {
    "llama-spm": "ggml-vocab-llama-spm.gguf",
    "qwen2": "ggml-vocab-qwen2.gguf",
    "deepseek": "ggml-vocab-deepseek-llm.gguf",
    "mistral": "mistral-v1.tokenizer.model",
}


@pytest.fixture(params=sorted(FILES))
def named_tokenizer(request, real_tokenizer):
    return request.param, real_tokenizer(request.param)


def test_offsets_are_in_range_and_ordered(named_tokenizer):
    name, tok = named_tokenizer
    for text, enc in zip(TEXTS, encode_batch(tok, TEXTS)):
        assert len(enc) > 0
        assert enc.ids.dtype == np.int32 and enc.starts.dtype == np.int32
        assert (0 <= enc.starts).all() and (enc.starts <= enc.ends).all() and (enc.ends <= len(text)).all()
        assert (np.diff(enc.starts) >= 0).all(), f"{name}: starts decrease on {text!r}"


def test_every_clean_token_decodes_to_its_text_slice(named_tokenizer):
    """Tokens that own their span alone (no byte-split character shares it) decode to exactly the
    characters their offsets point at, up to the SentencePiece word-boundary space."""
    name, tok = named_tokenizer
    checked = 0
    for text, enc in zip(TEXTS, encode_batch(tok, TEXTS)):
        spans = list(zip(enc.starts.tolist(), enc.ends.tolist()))
        for k, (tid, (s, e)) in enumerate(zip(enc.ids.tolist(), spans)):
            shares = (k > 0 and spans[k - 1][1] > s) or (k + 1 < len(spans) and spans[k + 1][0] < e)
            if shares or s == e:
                continue
            piece = tok.convert_tokens_to_string([tok.convert_ids_to_tokens(tid)])
            assert piece.strip(" ") == text[s:e].strip(" "), f"{name}: token {tid} {piece!r} vs slice {text[s:e]!r}"
            checked += 1
    assert checked > 50


def test_special_token_strings_are_plain_text(named_tokenizer):
    name, tok = named_tokenizer
    special_ids = set(tok.all_special_ids)
    enc = encode(tok, TEXTS[-1])
    assert not special_ids & set(enc.ids.tolist()), f"{name}: a special token string became a control token"
    covered = "".join(TEXTS[-1][s:e] for s, e in zip(enc.starts, enc.ends))
    assert "endoftext" in covered and "</" in covered


def test_method_offset_quirks_are_present(real_tokenizer):
    llama = real_tokenizer("llama-spm")
    enc = encode(llama, "Let me 🙂")
    assert (enc.starts[0], enc.ends[0]) == (0, 3), "virtual leading space has no source character"
    emoji = [(s, e) for s, e in zip(enc.starts, enc.ends) if (s, e) == (7, 8)]
    assert len(emoji) == 4, "byte-fallback pieces of one character share its span"
    qwen = real_tokenizer("qwen2")
    enc = encode(qwen, "x = ∑ y")
    spans = list(zip(enc.starts.tolist(), enc.ends.tolist()))
    assert any(a[1] > b[0] for a, b in zip(spans, spans[1:])), "byte-level split character gives overlapping spans"
    assert bos_token_id(qwen) is None and bos_token_id(llama) == llama.bos_token_id


def test_fingerprint_tells_vocabularies_apart(real_tokenizer, shared_tokenizers, tmp_path):
    """Equal for the same vocabulary however it is loaded (two separate loads, a save and reload),
    different for another vocabulary and for the same one with a single token added."""
    from transformers import AutoTokenizer

    from pipeline.method.tokenization import load_tokenizer

    a, b = real_tokenizer("llama-spm"), real_tokenizer("mistral")
    again = load_tokenizer(str(shared_tokenizers / FILES["llama-spm"]))
    assert again is not a and fingerprint(again) == fingerprint(a)
    a.save_pretrained(tmp_path / "saved")
    assert fingerprint(AutoTokenizer.from_pretrained(tmp_path / "saved")) == fingerprint(a)
    assert fingerprint(a) != fingerprint(b)
    assert again.add_tokens(["<extra_token_for_the_test>"]) == 1
    assert fingerprint(again) != fingerprint(a)
    assert len({fingerprint(a), fingerprint(b), fingerprint(again)}) == 3 and len(fingerprint(a)) == 64


def test_slow_tokenizer_is_refused(shared_tokenizers, tmp_path):
    """A real pure-Python (SentencePiece) tokenizer reports no offsets and must be refused."""
    from transformers import BertGenerationTokenizer

    shutil.copy(shared_tokenizers / FILES["mistral"], tmp_path / "tokenizer.model")
    slow = BertGenerationTokenizer.from_pretrained(str(tmp_path))
    assert not slow.is_fast
    with pytest.raises(TokenizerError, match="slow"):
        encode(slow, "text")
