"""The embedded tiny student: a SentencePiece-style tokenizer and a small Llama-architecture model.

The student must not share the tiny teacher's vocabulary (byte-level BPE, see
:mod:`pipeline.embedded.tiny_teacher`), or stage 2 would never exercise cross-vocabulary alignment.
So the student's tokenizer is built the way Llama-2 / TinyLlama's is:

* a BPE model with ``byte_fallback=True``: characters outside the learned alphabet (emoji, most CJK)
  become ``<0xNN>`` byte pieces that all carry their character's span;
* the vocabulary laid out as Llama's: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, the 256 byte pieces
  ``<0x00>``..``<0xFF>`` at 3..258, then the learned pieces;
* a Metaspace pre-tokenizer (``▁`` for spaces, a virtual ``▁`` before the first word, so
  ``▁Let`` has the span ``(0, 3)``) followed by single-digit splitting;
* BOS added in front of every text (``TemplateProcessing``), no EOS, like Llama;
* the learned alphabet chosen here, not by the trainer: the ``limit_alphabet`` most frequent
  characters of the pre-tokenized words, ties broken by code point. The trainer's own cut sorts
  a hash map's order with an unstable sort, so on a small corpus where characters tie at the
  cut, two runs learned different vocabularies (``alphabet`` below).

It is trained on the clean documents of the sample corpus and saved as ``tokenizer.json``, so
``AutoTokenizer.from_pretrained`` loads it as a fast tokenizer with offsets. The model is a
randomly initialised (seeded) ``LlamaForCausalLM`` sized to the vocabulary: stage 2 is continual
pretraining, and for the embedded default "pretrained" would only mean slower to build. Building
takes a few seconds; it is cached under the artifacts folder with a ``_BUILD.json`` stamp of the
build parameters, like the tiny teacher.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

from pipeline.embedded import ensure_sample_corpus
from pipeline.embedded.model_shape import ModelShape
from pipeline.embedded.sample_corpus import clean_texts
from pipeline.embedded.tiny_teacher import build_folder

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIALS = (UNK, BOS, EOS)
BYTE_PIECES = tuple(f"<0x{i:02X}>" for i in range(256))
STAMP_NAME = "_BUILD.json"


@dataclass(frozen=True, kw_only=True)
class TinyStudentSpec(ModelShape):
    """The tiny student's tokenizer and sizes (it is not trained here: stage 2 trains it)."""

    vocab_size: int = 3000  # including the 3 specials and the 256 byte pieces
    limit_alphabet: int = 150  # rarer characters are left to byte fallback
    seed: int = 0
    max_train_docs: int | None = None  # tokenizer training texts (None: all)


def tiny_student_dir(artifacts: str | os.PathLike, corpus_docs: int, seed: int = 0) -> Path:
    return Path(artifacts) / f"tiny-student-n{corpus_docs}-s{seed}"


def alphabet(texts: Sequence[str], pre_tokenizer, limit: int) -> list[str]:
    """The ``limit`` most frequent characters of ``texts`` as the trainer counts them (in the
    pre-tokenizer's words, so spaces appear as ``▁``), most frequent first, ties by code point."""

    counts: Counter[str] = Counter()
    for text in texts:
        for word, _ in pre_tokenizer.pre_tokenize_str(text):
            counts.update(word)
    return sorted(counts, key=lambda c: (-counts[c], ord(c)))[:limit]


def train_student_tokenizer(texts: Sequence[str], vocab_size: int, limit_alphabet: int = 150):
    """A SentencePiece-style BPE ``PreTrainedTokenizerFast`` with byte fallback (module docstring)."""
    from transformers import PreTrainedTokenizerFast  # lazy: seconds to import; a config error is refused first

    texts = list(texts)  # read twice: the alphabet, then the trainer
    n_learned = vocab_size - len(BYTE_PIECES)
    if n_learned <= len(SPECIALS) + limit_alphabet:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges after 256 byte pieces and the alphabet")
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    learner = Tokenizer(models.BPE(unk_token=UNK, byte_fallback=True, fuse_unk=True))
    learner.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=n_learned, special_tokens=list(SPECIALS), limit_alphabet=limit_alphabet,
        initial_alphabet=alphabet(texts, pre_tokenizer, limit_alphabet), min_frequency=2, show_progress=False,
    )
    learner.train_from_iterator(texts, trainer=trainer)

    # Re-lay the vocabulary as Llama's: specials, the 256 byte pieces, then the learned pieces.
    learned = [t for t, _ in sorted(learner.get_vocab().items(), key=lambda kv: kv[1]) if t not in SPECIALS]
    vocab = {t: i for i, t in enumerate([*SPECIALS, *BYTE_PIECES, *learned])}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in json.loads(learner.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizer
    tok.add_special_tokens(list(SPECIALS))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, model_max_length=10**9
    )


def build_tiny_student(texts: Sequence[str], out_dir: str | os.PathLike, spec: TinyStudentSpec = TinyStudentSpec()) -> Path:
    """Build (or return the cached) tiny student in ``out_dir``: tokenizer and random-init Llama."""
    out_dir = Path(out_dir)
    params = {"spec": asdict(spec), "n_texts": len(texts)}
    if _stamp_params(out_dir) == params:
        return out_dir

    t0 = time.perf_counter()
    train_texts = [t for t in texts if t][: spec.max_train_docs]
    random.Random(spec.seed).shuffle(train_texts)
    tokenizer = train_student_tokenizer(train_texts, spec.vocab_size, spec.limit_alphabet)
    model = new_student_model(tokenizer, spec, spec.seed)

    def write(work: Path) -> None:
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        stamp = {
            "params": params,
            "vocab_size": len(tokenizer),
            "n_params": sum(p.numel() for p in model.parameters()),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        (work / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")

    return build_folder(out_dir, write)


def new_student_model(tokenizer, shape: ModelShape, seed: int):
    """A randomly initialised (``torch.manual_seed(seed)``) Llama of ``shape``'s sizes for ``tokenizer``,
    embeddings tied."""
    import torch  # lazy: seconds to import; a config error is refused first
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: seconds to import; a config error is refused first

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=None, **shape.hf_config_args())
    return LlamaForCausalLM(config)


def _stamp_params(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / STAMP_NAME).read_text()).get("params")
    except (OSError, ValueError):
        return None


def ensure_tiny_student(
    artifacts: str | os.PathLike, corpus_docs: int = 3000, seed: int = 0, spec: TinyStudentSpec = TinyStudentSpec()
) -> Path:
    """Build (or reuse) the tiny student from the clean documents of the sample corpus."""

    files = ensure_sample_corpus(artifacts, corpus_docs, seed)
    return build_tiny_student(clean_texts(files), tiny_student_dir(artifacts, corpus_docs, seed), spec)
