"""Vocabulary overlap on the real tokenizers (../shared/tokenizers), checked against an independent
count: the token lists and token types read straight from the GGUF files by a small parser written
here (and from the SentencePiece model with ``sentencepiece``), normalised by code written here.

The implementation goes through transformers (``load_tokenizer``) instead; the tokenizers come from
the session's ``real_tokenizer`` fixture (each loaded once per test session; Qwen2's takes ~10 s).
"""

from __future__ import annotations

import re
import struct
from functools import cache
from pathlib import Path

import pytest

from pipeline.inspection.vocab_overlap import (
    BYTE_LEVEL,
    SENTENCEPIECE,
    UNICODE_TO_BYTE,
    load_vocabulary,
    vocabulary_from_tokenizer,
    normalise_token,
    vocab_overlap,
)

TOKENIZERS = Path(__file__).resolve().parents[2].parent / "shared" / "tokenizers"
pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason=f"real tokenizer vocabularies not found at {TOKENIZERS}")

STUDENT = "ggml-vocab-llama-spm.gguf"
TEACHERS = {"qwen2.5": "ggml-vocab-qwen2.gguf", "deepseekmath": "ggml-vocab-deepseek-llm.gguf", "mistral": "mistral-v1.tokenizer.model"}
FIXTURE_NAMES = {STUDENT: "llama-spm", TEACHERS["qwen2.5"]: "qwen2", TEACHERS["deepseekmath"]: "deepseek",
                 TEACHERS["mistral"]: "mistral"}

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
NORMAL, BYTE = 1, 6


# --------------------------------------------------------------------------------------------
# The independent side
# --------------------------------------------------------------------------------------------


def read_gguf_vocab(path: Path) -> tuple[list[str], list[int], str]:
    """Tokens, token types and tokenizer model of a GGUF file, parsed from its bytes (format v2/v3:
    header, then key/value pairs; little-endian)."""
    data = path.read_bytes()
    assert data[:4] == b"GGUF"
    pos = 4 + 4 + 8  # magic, version, tensor count
    (n_kv,) = struct.unpack_from("<Q", data, pos)
    pos += 8
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        return data[at + 8 : at + 8 + n].decode("utf-8"), at + 8 + n

    def value(kind: int, at: int):
        if kind == 8:
            return string(at)
        if kind == 9:
            elem, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if elem == 8:
                items = []
                for _ in range(count):
                    item, at = string(at)
                    items.append(item)
                return items, at
            fmt = {4: "I", 5: "i", 6: "f", 0: "B", 1: "b", 7: "?", 10: "Q", 11: "q"}[elem]
            return list(struct.unpack_from(f"<{count}{fmt}", data, at)), at + count * sizes[elem]
        fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[kind]
        return struct.unpack_from(f"<{fmt}", data, at)[0], at + sizes[kind]

    fields = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", data, pos)
        fields[key], pos = value(kind, pos + 4)
    return fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"], fields["tokenizer.ggml.model"]


@cache
def independent_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte alphabet derived from Unicode properties: a byte stands for itself when its
    latin-1 character is printable and not whitespace; the others take 256, 257, ... in order."""
    own = [b for b in range(256) if chr(b).isprintable() and not chr(b).isspace()]
    rest = [b for b in range(256) if b not in own]
    return {**{chr(b): b for b in own}, **{chr(256 + n): b for n, b in enumerate(rest)}}


def independent_normalise(token: str, token_type: int, family: str) -> bytes:
    if family == "llama":  # SentencePiece: byte tokens are known by their type, not their spelling
        if token_type == BYTE:
            return bytes.fromhex(token[3:5])
        return token.replace("\u2581", " ").encode()
    alphabet = independent_byte_alphabet()
    return bytes(alphabet[ch] for ch in token)


@cache
def independent_vocab(file: str) -> tuple[set[str], set[bytes]]:
    """(raw strings, normalised strings) of the compared vocabulary: normal and byte tokens."""
    path = TOKENIZERS / file
    if path.suffix == ".model":
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        pieces = [(sp.id_to_piece(i), BYTE if sp.is_byte(i) else NORMAL)
                  for i in range(sp.get_piece_size())
                  if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))]
        family = "llama"
    else:
        tokens, types, model = read_gguf_vocab(path)
        pieces = [(t, k) for t, k in zip(tokens, types) if k in (NORMAL, BYTE)]
        family = "llama" if model == "llama" else "gpt2"
    return {t for t, _ in pieces}, {independent_normalise(t, k, family) for t, k in pieces}


@pytest.fixture(scope="module")
def vocabulary(real_tokenizer):
    """``vocabulary(file)``: the implementation's view of a real tokenizer, built once per module."""
    return cache(lambda file: vocabulary_from_tokenizer(real_tokenizer(FIXTURE_NAMES[file]), file))


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_byte_alphabet_matches_the_independent_derivation_and_the_tokenizers_library():
    from tokenizers.pre_tokenizers import ByteLevel

    assert UNICODE_TO_BYTE == independent_byte_alphabet()
    assert set(UNICODE_TO_BYTE) == set(ByteLevel.alphabet())
    assert sum(ord(ch) == b for ch, b in UNICODE_TO_BYTE.items()) == 188


def test_gguf_parser_agrees_with_the_gguf_package():
    from gguf import GGUFReader

    reader = GGUFReader(TOKENIZERS / STUDENT)  # the small file: ~1 s
    tokens, types, model = read_gguf_vocab(TOKENIZERS / STUDENT)
    assert tokens == reader.fields["tokenizer.ggml.tokens"].contents()
    assert types == reader.fields["tokenizer.ggml.token_type"].contents()
    assert model == "llama"


@pytest.mark.parametrize(
    ("token", "kind", "expected"),
    [
        ("\u2581the", SENTENCEPIECE, b" the"),
        ("<0x0A>", SENTENCEPIECE, b"\n"),
        ("<0xE2>", SENTENCEPIECE, b"\xe2"),  # half a character stays bytes
        ("\u0120the", BYTE_LEVEL, b" the"),  # Ġthe
        ("\u010a", BYTE_LEVEL, b"\n"),  # Ċ
        ("\u00f0\u0141", BYTE_LEVEL, b"\xf0\x9f"),  # ðŁ: first bytes of an emoji
        ("a b", BYTE_LEVEL, b"a b"),  # a real space is not in the alphabet: kept literally
    ],
)
def test_normalise_token(token, kind, expected):
    assert normalise_token(token, kind) == expected


def test_load_vocabulary_from_a_sentencepiece_model_file():
    vocab = load_vocabulary(str(TOKENIZERS / TEACHERS["mistral"]))
    assert vocab.kind == SENTENCEPIECE and len(vocab.tokens) == 31_997 and set(vocab.special) == {"<s>", "</s>", "<unk>"}


def test_compared_vocabulary_leaves_out_special_and_added_tokens(vocabulary):
    sizes = {name: len(vocabulary(file).tokens) for name, file in {**TEACHERS, "llama": STUDENT}.items()}
    assert sizes == {"qwen2.5": 151_643, "deepseekmath": 100_000, "mistral": 31_997, "llama": 31_997}
    assert {"<s>", "</s>", "<unk>"} <= set(vocabulary(STUDENT).special)
    assert "<|endoftext|>" in vocabulary(TEACHERS["qwen2.5"]).special
    assert "[PAD151646]" in vocabulary(TEACHERS["qwen2.5"]).added


@pytest.mark.parametrize("teacher", list(TEACHERS))
def test_overlap_with_llama_matches_an_independent_count_both_ways(teacher, vocabulary):
    t_raw, t_norm = independent_vocab(TEACHERS[teacher])
    s_raw, s_norm = independent_vocab(STUDENT)
    forward = vocab_overlap(vocabulary(TEACHERS[teacher]), vocabulary(STUDENT))
    backward = vocab_overlap(vocabulary(STUDENT), vocabulary(TEACHERS[teacher]))
    for view, t_set, s_set in (("raw", t_raw, s_raw), ("normalised", t_norm, s_norm)):
        fwd, bwd = getattr(forward, view), getattr(backward, view)
        shared = len(t_set & s_set)
        assert (fwd.teacher, fwd.student, fwd.shared) == (len(t_set), len(s_set), shared), view
        assert (bwd.teacher, bwd.student, bwd.shared) == (len(s_set), len(t_set), shared), view
        assert fwd.share_of_teacher == pytest.approx(shared / len(t_set)) == bwd.share_of_student
        assert fwd.share_of_student == pytest.approx(shared / len(s_set)) == bwd.share_of_teacher
        assert fwd.iou == pytest.approx(shared / len(t_set | s_set)) == bwd.iou


def test_normalisation_is_what_makes_byte_level_and_sentencepiece_meet(vocabulary):
    qwen_llama = vocab_overlap(vocabulary(TEACHERS["qwen2.5"]), vocabulary(STUDENT))
    # Raw strings meet only on tokens without a space marker; decoded, most of Llama is in Qwen.
    assert qwen_llama.raw.share_of_student < 0.35 < 0.75 < qwen_llama.normalised.share_of_student
    same = vocab_overlap(vocabulary(STUDENT), vocabulary(STUDENT))
    assert same.raw.iou == same.normalised.iou == 1.0
    assert any(re.match(r"^ \w", s) for s in qwen_llama.examples["shared_longest"])


def test_hub_tokenizers_that_cannot_be_had_end_in_one_line_at_once(tmp_path):
    """Offline, a hub id not in the cache: one line naming the setting and the ways out, exit 2,
    in seconds (no retries inside transformers)."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "stages.inspect", "command=vocab-overlap", "teacher=org/no-such-model",
                          "student=org/another", f"out_dir={tmp_path}", f"hydra.run.dir={tmp_path}/logs"],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: teacher (org/no-such-model): ") and "HF_HUB_OFFLINE" in lines[0]
    assert time.monotonic() - t0 < 60
