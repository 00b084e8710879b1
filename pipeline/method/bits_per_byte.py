"""Held-out bits per UTF-8 byte of a causal LM: the standard measure of continual pretraining,
comparable across student tokenizers because it divides by bytes, not tokens. ``make eval-student``
reports it (docs/evaluation.md), stage 2 logs it while training (``train.eval_every``) and ``make
repro`` judges its students by it (docs/METHOD.md §4.2); all three call :func:`text_losses`.

:func:`text_losses` gives, per text, the summed next-token loss in nats, the UTF-8 byte count and
the token count. Every text token is predicted: the text follows the tokenizer's BOS (or, for a
tokenizer without one, its EOS, the separator between documents in training), and a text longer
than ``window`` tokens is cut into blocks that each carry the previous block's last token as their
first input, so each token is predicted exactly once with up to ``window`` tokens of context.
Blocks of similar length share a forward pass, padded on the right and without an attention mask
(attention is causal, so no real token sees the padding), and each block's loss is taken over its
own predictions only, never over the padding. Losses are float32 log-softmax (whatever the model's
dtype), summed per text in float64.

:func:`summarize` gives the statistics the reproduction reports: bits per byte overall (total bits
over total bytes), nats per token, and the per-document bits per byte with its mean and a 95%
Student-t interval over documents (``scipy.stats.t``).

The held-out text itself: :func:`text_file_documents` reads a ``.txt`` file (one document) or a
``.jsonl`` file (one document per line, its ``"text"``), and :func:`shard_documents` the documents
of some shards of a scored dataset.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.runtime.config import UserError
from storage_schemas import filesystem as sfs
from storage_schemas.reader import ScoredDataset

LEVEL = 0.95  # two-sided confidence level of the interval over documents
TEXT_SUFFIXES = (".txt", ".jsonl")


class HeldOutTextError(UserError, ValueError):
    """A held-out text file that cannot be read; the message names the file (and line)."""


@dataclass(frozen=True)
class TextLoss:
    """One text's summed next-token loss (nats), its UTF-8 bytes and its tokens."""

    nats: float
    n_bytes: int
    n_tokens: int


def first_token(tokenizer) -> int:
    """The token a text follows: the tokenizer's BOS, else its EOS."""
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if first is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to start a text with")
    return first


def blocks(ids: Sequence[int], first: int, window: int) -> list[list[int]]:
    """``[first, *ids]`` cut into blocks of at most ``window + 1`` tokens that overlap by one: block
    ``k`` predicts ids ``k*window .. (k+1)*window - 1`` from what precedes them in the block."""
    seq = [first, *ids]
    return [seq[start: start + window + 1] for start in range(0, len(seq) - 1, window)]


def default_window(model) -> int:
    """Tokens of context per block when none is asked for: the model's context minus the one
    position the token before the block takes (1024 for a model that states no context)."""
    context = getattr(model.config, "max_position_embeddings", None)
    return context - 1 if context else 1024


def text_losses(model, tokenizer, texts: Sequence[str], window: int = 256, batch_size: int = 16) -> list[TextLoss]:
    """Per text: summed next-token loss in nats, UTF-8 bytes, tokens (module docstring)."""
    import torch  # lazy: seconds to import; a config error is refused first

    encoded = tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True)["input_ids"] if texts else []
    nats = [0.0] * len(encoded)
    for owner, _, loss in _block_losses(model, first_token(tokenizer), encoded, window, batch_size):
        nats[owner] += loss.sum(dtype=torch.float64).item()
    return [TextLoss(nats=n, n_bytes=len(t.encode("utf-8")), n_tokens=len(ids))
            for n, t, ids in zip(nats, texts, encoded)]


@dataclass(frozen=True)
class TokenLosses:
    """One text's tokens: ids, character spans ``[starts, ends)`` and each token's loss in nats."""

    ids: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    nats: np.ndarray  # float64


def token_losses(model, tokenizer, texts: Sequence[str], window: int = 256, batch_size: int = 16) -> list[TokenLosses]:
    """Per text, every token's next-token loss with its character span: the same predictions as
    :func:`text_losses` (whose sums these are), kept per token so that a part of the text can be
    measured (needs a fast tokenizer, for the offsets)."""
    enc = tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True,
                    return_offsets_mapping=True) if texts else {"input_ids": [], "offset_mapping": []}
    encoded = enc["input_ids"]
    nats = [np.zeros(len(ids), dtype=np.float64) for ids in encoded]
    for owner, start, loss in _block_losses(model, first_token(tokenizer), encoded, window, batch_size):
        nats[owner][start: start + loss.numel()] = loss.double().cpu().numpy()
    out = []
    for ids, spans, n in zip(encoded, enc["offset_mapping"], nats):
        spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        out.append(TokenLosses(np.asarray(ids, dtype=np.int64), spans[:, 0], spans[:, 1], n))
    return out


def _block_losses(model, first: int, encoded: Sequence[Sequence[int]], window: int, batch_size: int):
    """Yield ``(text index, index of the block's first predicted token, its losses (n,) float32)``
    for every block of every text (module docstring), batched by similar length."""
    import torch  # lazy: seconds to import; a config error is refused first
    import torch.nn.functional as F  # lazy: seconds to import; a config error is refused first

    if window < 1 or batch_size < 1:
        raise ValueError(f"window ({window}) and batch_size ({batch_size}) must be >= 1")
    work = [(b, owner, k * window) for owner, ids in enumerate(encoded) for k, b in enumerate(blocks(ids, first, window))]
    work.sort(key=lambda item: len(item[0]))  # similar lengths share a batch
    device = next(model.parameters()).device
    model.eval()
    with torch.inference_mode():
        for i in range(0, len(work), batch_size):
            batch = work[i: i + batch_size]
            width = max(len(b) for b, _, _ in batch)
            x = torch.zeros(len(batch), width, dtype=torch.long)
            for r, (b, _, _) in enumerate(batch):
                x[r, : len(b)] = torch.tensor(b)
            x = x.to(device)
            # No attention mask: the padding is on the right and attention is causal, so no real token
            # sees it, and without a mask the attention takes its causal fast path.
            logits = model(input_ids=x).logits  # (B, T, V)
            for r, (b, owner, start) in enumerate(batch):  # each row's own predictions: no work on the padding
                n = len(b) - 1
                yield owner, start, F.cross_entropy(logits[r, :n].float(), x[r, 1: n + 1], reduction="none")  # (n,)


def summarize(losses: Sequence[TextLoss], level: float = LEVEL) -> dict:
    """Bits per byte overall (total bits / total bytes), nats per token, and the per-document bits
    per byte: mean and a ``level`` t interval over documents (``None`` with fewer than two).
    Documents without a byte are counted but take no part in the per-document statistics."""
    n_bytes = sum(x.n_bytes for x in losses)
    n_tokens = sum(x.n_tokens for x in losses)
    nats = math.fsum(x.nats for x in losses)
    per_document = [x.nats / math.log(2) / x.n_bytes for x in losses if x.n_bytes > 0]
    mean = statistics.fmean(per_document) if per_document else math.nan
    interval = None
    if len(per_document) > 1:
        from scipy import stats  # heavy (~1 s): training imports this module and never needs it

        t = float(stats.t.ppf(0.5 + level / 2, len(per_document) - 1))  # two-sided: 0.95 -> t(0.975, n - 1)
        half = t * statistics.stdev(per_document) / math.sqrt(len(per_document))
        interval = [mean - half, mean + half]
    return {
        "bits_per_byte": nats / math.log(2) / n_bytes if n_bytes else math.nan,
        "nats_per_token": nats / max(n_tokens, 1),
        "documents": len(losses),
        "bytes": n_bytes,
        "tokens": n_tokens,
        "nats": nats,
        "document_mean": mean,
        "document_ci": interval,
        "level": level,
    }


# ---- reading held-out text --------------------------------------------------------------------


def text_file_documents(path: str | Path) -> list[str]:
    """The documents of a held-out text file: a ``.txt`` file is one document (its whole UTF-8
    text), a ``.jsonl`` file one per line (its ``"text"`` field; blank lines skipped)."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise HeldOutTextError(f"{path}: cannot be read as UTF-8 text ({exc})") from None
    if path.suffix == ".txt":
        return [raw]
    texts = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HeldOutTextError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise HeldOutTextError(f"{path}:{number}: expected an object with a \"text\" string")
        texts.append(row["text"])
    return texts


def shard_documents(dataset: ScoredDataset, files: Sequence[str], limit: int | None = None) -> list[str]:
    """The non-empty texts of the shards of ``dataset`` named ``files`` (file names), in the
    dataset's order, at most ``limit``."""
    wanted = set(files)
    part = ScoredDataset(folders=dataset.folders, shards=[s for s in dataset.shards if sfs.name(s.path) in wanted])
    taken: list[str] = []
    for record in part.iter_documents():
        if limit is not None and len(taken) >= limit:
            break
        if record.text:
            taken.append(record.text)
    return taken
