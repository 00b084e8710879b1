"""The warm study's endpoints on the held-out text (conf/repro_real.yaml ``endpoints``), from one pass
of the student over it (:func:`pipeline.method.bits_per_byte.token_losses`):

* ``overall``: bits per UTF-8 byte of all of it (total bits over total bytes), and per source;
* ``teacher_easy`` / ``teacher_hard``: bits per byte of the student tokens whose teacher loss
  ``L_t`` (the max over the teacher tokens their span overlaps, as stage 2 aligns them) is at most /
  above the median teacher-token loss of the held-out text, over the bytes of those tokens;
* ``gsm8k_answers``: bits per byte of GSM8K test answers alone, each read after its question (the
  text after the first blank line; the answer's tokens are those that start in it).

The bytes of a token are those of its character span; tokens that share one span (the byte-fallback
pieces of one character) share its bytes equally, so the bytes of the tokens of a text add up to the
bytes their spans cover. Tokens no teacher token maps to (an empty span, the first token of a
document, which the teacher does not predict) belong to neither the easy nor the hard part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LN2 = math.log(2)
ANSWER_SOURCE = "gsm8k"
QUESTION_END = "\n\n"


@dataclass(frozen=True)
class TeacherDocument:
    """The teacher's tokens of one held-out document: character spans and losses (NaN: unscored)."""

    starts: np.ndarray
    ends: np.ndarray
    losses: np.ndarray


def teacher_documents(scored_folder: str) -> dict[str, TeacherDocument]:
    """The scored held-out text's documents by their text."""
    from storage_schemas.reader import open_scored_dataset

    out = {}
    for record in open_scored_dataset([scored_folder]).iter_documents():
        out[record.text] = TeacherDocument(np.asarray(record.starts), np.asarray(record.ends),
                                           np.asarray(record.losses, dtype=np.float64))
    return out


def median_teacher_loss(documents: dict[str, TeacherDocument]) -> float:
    """The median loss over every scored teacher token of the held-out text."""
    losses = np.concatenate([d.losses for d in documents.values()]) if documents else np.zeros(0)
    losses = losses[~np.isnan(losses)]
    if not losses.size:
        raise ValueError("the scored held-out text has no teacher loss")
    return float(np.median(losses))


def token_bytes(text: str, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Each token's share of the UTF-8 bytes of its span (tokens of one span share it equally)."""
    if not len(starts):
        return np.zeros(0)
    # the UTF-8 length of every prefix of the text: bytes of [a, b) = prefix[b] - prefix[a]
    prefix = np.zeros(len(text) + 1, dtype=np.int64)
    prefix[1:] = np.cumsum([len(ch.encode("utf-8")) for ch in text])
    spans = np.stack([starts, ends], axis=1)
    own = (prefix[ends] - prefix[starts]).astype(np.float64)
    _, inverse, counts = np.unique(spans, axis=0, return_inverse=True, return_counts=True)
    return own / counts[inverse.reshape(-1)]


def _part(nats: float, n_bytes: float, tokens: int) -> dict:
    return {"bits_per_byte": nats / LN2 / n_bytes if n_bytes else math.nan, "nats": nats, "bytes": n_bytes,
            "tokens": tokens}


def measure(model_folder: str, rows: list[dict], teacher: dict[str, TeacherDocument], threshold: float,
            window: int, batch_size: int = 16) -> dict:
    """Every endpoint of one model on the held-out ``rows`` (``text``, ``origin``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.method.alignment import align_document
    from pipeline.method.bits_per_byte import token_losses

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    model = AutoModelForCausalLM.from_pretrained(model_folder, use_safetensors=True)
    per_token = token_losses(model, tokenizer, [r["text"] for r in rows], window=window, batch_size=batch_size)
    sums = {k: [0.0, 0.0, 0] for k in ("easy", "hard", "unmapped", "answers")}
    by_source: dict[str, list] = {}
    answers = 0
    missing = 0
    for row, t in zip(rows, per_token):
        text = row["text"]
        n_bytes = len(text.encode("utf-8"))
        s = by_source.setdefault(row["origin"], [0.0, 0, 0, 0])
        s[0] += float(t.nats.sum())
        s[1] += n_bytes
        s[2] += len(t.nats)
        s[3] += 1
        share = token_bytes(text, t.starts, t.ends)
        doc = teacher.get(text)
        if doc is None:
            missing += 1
            l_t = np.full(len(t.nats), np.nan)
        else:
            l_t = align_document(t, doc.starts, doc.ends, doc.losses, how="max").teacher_loss
        for name, mask in (("easy", l_t <= threshold), ("hard", l_t > threshold), ("unmapped", np.isnan(l_t))):
            sums[name][0] += float(t.nats[mask].sum())
            sums[name][1] += float(share[mask].sum())
            sums[name][2] += int(mask.sum())
        if row["origin"] == ANSWER_SOURCE and QUESTION_END in text:
            start = text.index(QUESTION_END) + len(QUESTION_END)
            mask = t.starts >= start
            sums["answers"][0] += float(t.nats[mask].sum())
            sums["answers"][1] += len(text[start:].encode("utf-8"))
            sums["answers"][2] += int(mask.sum())
            answers += 1
    if missing:
        raise ValueError(f"{missing} held-out documents are not in the scored held-out text: score it again")
    total_nats = math.fsum(v[0] for v in by_source.values())
    total_bytes = sum(v[1] for v in by_source.values())
    return {
        "bits_per_byte": total_nats / LN2 / total_bytes, "bytes": total_bytes, "nats": total_nats,
        "per_source": {src: {**_part(v[0], v[1], v[2]), "documents": v[3]} for src, v in sorted(by_source.items())},
        "teacher_easy": _part(*sums["easy"]), "teacher_hard": _part(*sums["hard"]),
        "unmapped": _part(*sums["unmapped"]),
        "gsm8k_answers": {**_part(*sums["answers"]), "documents": answers},
        "teacher_median": threshold,
    }


def endpoint_value(result: dict, endpoint: str, source: str | None = None) -> float:
    """The value a comparison reads: ``overall`` (or one source of it), or a part's bits per byte."""
    if endpoint == "overall":
        return result["bits_per_byte"] if source is None else result["per_source"][source]["bits_per_byte"]
    return result[endpoint]["bits_per_byte"]
