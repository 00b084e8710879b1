"""Tokenization with character offsets, shared by the teacher (stage 1) and the student (stage 2)
(docs/METHOD.md §1.1).

Two rules hold for every tokenizer the project touches:

* it must be a *fast* (Rust ``tokenizers``-backed) tokenizer, because only those report character
  offsets; a slow (pure Python) tokenizer is refused with :class:`TokenizerError`;
* special-token strings that occur in the text (``<|endoftext|>``, ``</s>``, ``<s>``) are tokenized
  as plain text, never turned into control tokens (``split_special_tokens=True``).

Offsets are Python string (code point) offsets ``[start, end)`` into the text, as the fast
tokenizer reports them for ``str`` input.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.runtime.config import MissingPathError, UserError


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be used for offset-based alignment."""


@dataclass(frozen=True)
class Encoding:
    """One document's tokens: ids and ``[start, end)`` character spans, all int32 arrays."""

    ids: np.ndarray  # (M,) int32
    starts: np.ndarray  # (M,) int32
    ends: np.ndarray  # (M,) int32

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def require_fast(tokenizer, name: str = "tokenizer") -> None:
    """Refuse tokenizers that cannot report character offsets."""
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "backend_tokenizer", None) is None:
        raise TokenizerError(
            f"{name} {type(tokenizer).__name__} is a slow (Python) tokenizer and reports no character "
            "offsets; offset-based alignment needs a fast tokenizer (a tokenizer.json, or "
            "AutoTokenizer.from_pretrained(..., use_fast=True))."
        )


def encode_batch(tokenizer, texts: Sequence[str]) -> list[Encoding]:
    """Tokenize ``texts`` without adding special tokens; special-token strings stay text."""
    require_fast(tokenizer)
    if not texts:
        return []
    out = tokenizer(
        list(texts),
        add_special_tokens=False,
        return_offsets_mapping=True,
        split_special_tokens=True,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    encodings = []
    for ids, offsets in zip(out["input_ids"], out["offset_mapping"]):
        spans = np.asarray(offsets, dtype=np.int32).reshape(-1, 2)
        encodings.append(
            Encoding(
                ids=np.asarray(ids, dtype=np.int32),
                starts=np.ascontiguousarray(spans[:, 0]),
                ends=np.ascontiguousarray(spans[:, 1]),
            )
        )
    return encodings


def encode(tokenizer, text: str) -> Encoding:
    return encode_batch(tokenizer, [text])[0]


def bos_token_id(tokenizer) -> int | None:
    """The BOS id the tokenizer itself puts in front of a text, or None if it adds none.

    Detected from the tokenizer's own behaviour (``add_special_tokens=True``) rather than from
    ``bos_token`` alone: Qwen2 defines no BOS, DeepSeek and Llama prepend one.
    """
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    return int(bos) if probe and probe[0] == bos else None


BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def byte_fallback_ids(tokenizer) -> np.ndarray:
    """A bool per id of the tokenizer's vocabulary (added tokens included): whether the token is a
    byte-fallback piece, SentencePiece's ``<0x41>`` that spells one byte of a character the
    vocabulary has no piece for. A byte-level BPE (GPT-2, Qwen2) has none: all False."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return np.fromiter((isinstance(p, str) and BYTE_PIECE.fullmatch(p) is not None for p in pieces), dtype=bool,
                       count=len(pieces))


def fingerprint(tokenizer) -> str:
    """A sha256 of the tokenizer's full serialisation (vocabulary, merges, normaliser, specials)."""
    require_fast(tokenizer)
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()


def load_tokenizer(source: str, *, revision: str | None = None, trust_remote_code: bool = False):
    """Load a fast tokenizer from a hub id, a local folder, a ``.gguf`` vocabulary or a
    SentencePiece ``.model`` file, and refuse it if it cannot report offsets.

    * ``org/name`` or a folder: ``AutoTokenizer.from_pretrained``;
    * ``path/to/vocab.gguf``: ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``;
    * ``path/to/tokenizer.model`` (SentencePiece): copied into a cache folder as
      ``tokenizer.model`` and loaded with ``LlamaTokenizer`` (which converts it to a fast tokenizer).
    """
    from transformers import AutoTokenizer, LlamaTokenizer  # lazy: seconds to import; a config error is refused first

    path = Path(os.path.expanduser(source))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise MissingPathError(f"GGUF vocabulary not found: {path}")
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    elif path.suffix == ".model" and path.is_file():
        folder = _sentencepiece_folder(path)
        tok = LlamaTokenizer.from_pretrained(str(folder))
    else:
        tok = AutoTokenizer.from_pretrained(
            source, revision=revision, trust_remote_code=trust_remote_code, use_fast=True
        )
    require_fast(tok, name=f"tokenizer {source!r}")
    return tok


def _sentencepiece_folder(model_file: Path) -> Path:
    digest = hashlib.sha256(model_file.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("VOCAGNO_CACHE", Path.home() / ".cache" / "vocagno"))
    folder = cache / "sentencepiece" / digest
    if not (folder / "tokenizer.model").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"tokenizer.model.tmp{os.getpid()}"
        shutil.copyfile(model_file, tmp)
        os.replace(tmp, folder / "tokenizer.model")
    return folder
