"""Scoring documents with the teacher: checks, tokenization, windows, stitching
(docs/METHOD.md §1.1-1.3).

Each document that cannot be scored, or is scored with a remark, gets a ``reason``, counted per
shard in the manifest: the ``SKIP_REASONS`` are not stored (their ids are listed), the
``ZERO_TOKEN_REASONS`` are stored with zero tokens, the ``NOTE_REASONS`` are stored and scored as
is. Each case and its test are in docs/RELIABILITY.md (stage 1, corpus text).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pipeline.score_teacher.backends.base import WindowScorer
from pipeline.score_teacher.corpus import Document
from pipeline.method.tokenization import Encoding, encode_batch
from pipeline.method.windows import plan_windows, stitch
from storage_schemas import SKIP_REASONS, ZERO_TOKEN_REASONS
from storage_schemas.reader import ScoredDocument  # stage 1 builds the contract's rows

log = logging.getLogger(__name__)


@dataclass
class ShardResult:
    documents: list[ScoredDocument] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)  # reason -> count
    skipped: list[dict] = field(default_factory=list)  # [{"doc_id", "reason", "detail"}]

    def note(self, reason: str, doc_id: str, detail: str = "") -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if reason in SKIP_REASONS:
            self.skipped.append({"doc_id": doc_id, "reason": reason, "detail": detail[:200]})


@dataclass(frozen=True)
class WindowSettings:
    window: int  # tokens per forward pass, BOS included
    stride: int  # tokens the window advances; each later token keeps >= window - stride of context
    bos_id: int | None  # prepended (as context only) when the teacher's tokenizer adds a BOS


def classify(doc: Document) -> str | None:
    """The reason a document needs special handling, or None for an ordinary text."""
    if doc.problem is not None:
        return doc.problem.split(":", 1)[0]
    if doc.text is None:
        return "null_text"
    try:
        doc.text.encode("utf-8")
    except UnicodeEncodeError:
        return "lone_surrogate"
    if doc.text == "":
        return "empty_text"
    if doc.text.isspace():
        return "whitespace_only"
    if "\x00" in doc.text:
        return "contains_nul"
    return None


def score_documents(
    docs: Sequence[Document], tokenizer, scorer: WindowScorer, settings: WindowSettings
) -> ShardResult:
    """Check, tokenize and score ``docs``; the result keeps input order for stored documents."""
    result = ShardResult()
    to_score: list[Document] = []
    slots: list[int] = []  # index in result.documents of each document to score
    for doc in docs:
        reason = classify(doc)
        if reason is not None:
            result.note(reason, doc.doc_id, doc.problem or "")
        if reason in SKIP_REASONS:
            continue
        result.documents.append(_empty_document(doc.doc_id, doc.text))
        if reason not in ZERO_TOKEN_REASONS:
            to_score.append(doc)
            slots.append(len(result.documents) - 1)

    encodings = _encode_each(tokenizer, to_score, result)
    keep = [(slot, enc) for slot, enc in zip(slots, encodings) if enc is not None]
    losses = _score_encodings([enc for _, enc in keep], scorer, settings)
    for (slot, enc), doc_losses in zip(keep, losses):
        d = result.documents[slot]
        d.ids, d.starts, d.ends, d.losses = enc.ids, enc.starts, enc.ends, doc_losses
    failed = {slot for slot, enc in zip(slots, encodings) if enc is None}
    if failed:
        result.documents = [d for i, d in enumerate(result.documents) if i not in failed]
    return result


def _empty_document(doc_id: str, text: str) -> ScoredDocument:
    empty_i = np.zeros(0, dtype=np.int32)
    return ScoredDocument(doc_id, text, empty_i, empty_i, empty_i, np.zeros(0, dtype=np.float32))


def _encode_each(tokenizer, docs: list[Document], result: ShardResult) -> list[Encoding | None]:
    """Batch tokenization; if the batch fails, find and record the documents that fail."""
    texts = [d.text for d in docs]
    try:
        return list(encode_batch(tokenizer, texts))
    except Exception:
        log.warning("batch tokenization failed; retrying document by document")
    out: list[Encoding | None] = []
    for doc in docs:
        try:
            out.append(encode_batch(tokenizer, [doc.text])[0])
        except Exception as exc:
            result.note("tokenizer_error", doc.doc_id, f"{type(exc).__name__}: {exc}")
            out.append(None)
    return out


def _score_encodings(encodings: list[Encoding], scorer: WindowScorer, s: WindowSettings) -> list[np.ndarray]:
    """Per-token losses for each encoding, through windows of at most ``s.window`` tokens."""
    prefix = np.asarray([s.bos_id] if s.bos_id is not None else [], dtype=np.int32)
    sequences = [np.concatenate([prefix, enc.ids]) for enc in encodings]  # z = [BOS] + tokens
    plans = [plan_windows(len(z), s.window, s.stride) for z in sequences]
    windows = [z[w.start : w.stop] for z, plan in zip(sequences, plans) for w in plan]
    window_losses = scorer.score(windows) if windows else []
    out, k = [], 0
    for z, plan in zip(sequences, plans):
        z_losses = stitch(len(z), plan, window_losses[k : k + len(plan)])
        k += len(plan)
        out.append(z_losses[len(prefix) :])  # drop the BOS position: only text tokens are stored
    return out
