"""How much of two vocabularies is the same (docs/METHOD.md §3.2), raw and normalised.

What is compared
    The tokenizer *model's* vocabulary (the learned BPE/Unigram/WordPiece tokens, byte tokens such
    as Llama's ``<0x41>`` included). Added tokens are left out and reported apart: special tokens
    (``<s>``, ``<|endoftext|>``, also a model-vocabulary entry whose text is a special token's,
    such as DeepSeek's byte-level spelling of ``<｜begin▁of▁sentence｜>``) and non-special added
    tokens (Qwen's and DeepSeek's ``[PADnnnnn]`` placeholders, DeepSeek's literal ``ø``...). So
    Llama-2 and Mistral compare 31,997 tokens each, Qwen2 151,643, DeepSeek 100,000.
Raw
    The token strings exactly as stored (``▁the``, ``Ġthe``, ``<0x0A>``).
Normalised
    Each token as the bytes of the text it stands for, so that tokenizers of different families
    meet: SentencePiece ``▁`` becomes a space and a byte piece ``<0xNN>`` the byte ``NN``;
    byte-level BPE strings (GPT-2's ``bytes_to_unicode`` alphabet: ``Ġ`` is a space, ``Ċ`` a
    newline) are mapped back to their bytes. A byte sequence that is not valid UTF-8 on its own
    (half of a multi-byte character) stays bytes and is compared as bytes, which is the same as
    comparing text wherever the text is valid. Other tokenizers are compared as their UTF-8.
    Distinct raw tokens can share one normalised string (Llama's ``<0x41>`` and ``A``): the
    normalised figures count distinct strings.
Figures
    For each view: the number of distinct strings of each side, the shared ones, the share of the
    teacher's and of the student's, and IoU = shared / union.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from pipeline.method.tokenization import load_tokenizer

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"
PLAIN = "plain"

_SP_SPACE = "\u2581"  # ▁
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: 188 printable bytes stand for themselves, the other
    68 (controls, space, DEL, NBSP, soft hyphen...) for ``chr(256 + n)`` in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in set(printable)]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


UNICODE_TO_BYTE = _byte_level_alphabet()
# Alphabet characters to the code point of their byte; the latin-1 characters that are not in the
# alphabet (space, controls...) to one that latin-1 cannot encode, so that they fail as others do.
_TO_LATIN1 = str.maketrans({**{chr(b): "\uffff" for b in range(256)}, **{ch: chr(b) for ch, b in UNICODE_TO_BYTE.items()}})


def normalise_token(token: str, kind: str) -> bytes:
    """The bytes of the text ``token`` stands for, in a tokenizer of family ``kind``."""
    if kind == BYTE_LEVEL:
        try:  # each alphabet character to the code point of its byte, then one byte each
            return token.translate(_TO_LATIN1).encode("latin-1")
        except UnicodeEncodeError:  # a character outside the alphabet: a literal string
            return token.encode("utf-8")
    if kind == SENTENCEPIECE:
        match = _SP_BYTE.fullmatch(token)
        if match:
            return bytes([int(match.group(1), 16)])
        return token.replace(_SP_SPACE, " ").encode("utf-8")
    return token.encode("utf-8")


def show_bytes(value: bytes) -> str:
    """A normalised string for people: text where it is UTF-8, ``\\xNN`` escapes where not."""
    return value.decode("utf-8", errors="backslashreplace")


# --------------------------------------------------------------------------------------------
# Vocabularies
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Vocabulary:
    source: str
    kind: str  # byte_level | sentencepiece | plain
    tokens: dict[str, int]  # the compared model vocabulary (no special or added tokens)
    special: dict[str, int]  # special tokens (left out)
    added: dict[str, int]  # non-special added tokens (left out)

    def normalised(self) -> set[bytes]:
        return {normalise_token(t, self.kind) for t in self.tokens}

    def describe(self) -> dict:
        return {"source": self.source, "kind": self.kind, "tokens": len(self.tokens),
                "special": len(self.special), "added": len(self.added)}


def tokenizer_kind(tokenizer) -> str:
    """The family of a fast tokenizer, from its pre-tokenizer and decoder."""
    backend = tokenizer.backend_tokenizer
    parts = " ".join(
        json.dumps(json.loads(part.__getstate__()), ensure_ascii=False)
        for part in (backend.pre_tokenizer, backend.decoder) if part is not None
    )
    if '"ByteLevel"' in parts:
        return BYTE_LEVEL
    if '"Metaspace"' in parts or _SP_SPACE in parts:
        return SENTENCEPIECE
    return PLAIN


def vocabulary_from_tokenizer(tokenizer, source: str) -> Vocabulary:
    """Split a fast tokenizer's vocabulary into the compared model tokens, specials and added."""
    backend = tokenizer.backend_tokenizer
    kind = tokenizer_kind(tokenizer)
    model_vocab = backend.get_vocab(with_added_tokens=False)
    added_tokens = backend.get_added_tokens_decoder()  # id -> AddedToken
    special = {t.content: i for i, t in added_tokens.items() if t.special}
    added = {t.content: i for i, t in added_tokens.items() if not t.special and t.content not in special}
    special_text = {s.encode("utf-8") for s in special}
    tokens = {
        t: i for t, i in model_vocab.items()
        if t not in special and t not in added and normalise_token(t, kind) not in special_text
    }
    return Vocabulary(source=source, kind=kind, tokens=tokens, special=special, added=added)


def load_vocabulary(source: str) -> Vocabulary:
    """A hub id, a tokenizer folder, a ``.gguf`` vocabulary or a SentencePiece ``.model`` file."""

    return vocabulary_from_tokenizer(load_tokenizer(source), source)


# --------------------------------------------------------------------------------------------
# Overlap
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SetOverlap:
    teacher: int  # distinct strings on each side
    student: int
    shared: int

    @property
    def union(self) -> int:
        return self.teacher + self.student - self.shared

    @property
    def share_of_teacher(self) -> float:
        return self.shared / self.teacher if self.teacher else float("nan")

    @property
    def share_of_student(self) -> float:
        return self.shared / self.student if self.student else float("nan")

    @property
    def iou(self) -> float:
        return self.shared / self.union if self.union else float("nan")

    @classmethod
    def of(cls, teacher: set, student: set) -> "SetOverlap":
        return cls(teacher=len(teacher), student=len(student), shared=len(teacher & student))

    def to_dict(self) -> dict:
        return {"teacher": self.teacher, "student": self.student, "shared": self.shared, "union": self.union,
                "share_of_teacher": self.share_of_teacher, "share_of_student": self.share_of_student, "iou": self.iou}


@dataclass(frozen=True)
class VocabOverlap:
    teacher: Vocabulary
    student: Vocabulary
    raw: SetOverlap
    normalised: SetOverlap
    special: SetOverlap  # special tokens, raw strings (reported, not part of the figures above)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "teacher": self.teacher.describe(), "student": self.student.describe(),
            "raw": self.raw.to_dict(), "normalised": self.normalised.to_dict(), "special": self.special.to_dict(),
            "examples": self.examples,
        }


def vocab_overlap(teacher: Vocabulary, student: Vocabulary, n_examples: int = 12) -> VocabOverlap:
    t_norm, s_norm = teacher.normalised(), student.normalised()
    return VocabOverlap(
        teacher=teacher,
        student=student,
        raw=SetOverlap.of(set(teacher.tokens), set(student.tokens)),
        normalised=SetOverlap.of(t_norm, s_norm),
        special=SetOverlap.of(set(teacher.special), set(student.special)),
        examples={
            "shared_longest": _examples(t_norm & s_norm, n_examples),
            "teacher_only_longest": _examples(t_norm - s_norm, n_examples),
            "student_only_longest": _examples(s_norm - t_norm, n_examples),
        },
    )


def _examples(values: set[bytes], n: int) -> list[str]:
    """The ``n`` longest normalised strings (ties by value), for a glance at what differs."""
    return [show_bytes(v) for v in sorted(values, key=lambda v: (-len(v), v))[:n]]
