"""What the terminal view and the HTML page share: loss colours and cutting a text into pieces.

Colours: losses are binned by quantile (deciles of the whole dataset by default, from the summary's
histogram), so a colour means the same thing in every document; NaN (no prediction) is grey.

Pieces: teacher spans may overlap (a character split across byte-level tokens gives ``(3,5),
(4,5)``) and student spans cut the text elsewhere, so a text is cut at every boundary of every
tokenization into pieces that each show once; a piece's loss is the max over the teacher tokens
covering it (via :func:`pipeline.method.alignment.align_document`, the pieces standing in for a student).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.method.alignment import align_document, overlap_pairs
from pipeline.method.tokenization import Encoding

# Low loss (easy for the teacher) pale, high loss dark red: matplotlib's YlOrRd in ten steps.
PALETTE = ("#ffffcc", "#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#bd0026", "#980026", "#800026")
NAN_COLOUR = "#d0d0d0"


@dataclass(frozen=True)
class LossScale:
    """``len(PALETTE) - 1`` ascending cut points: bucket ``k`` holds losses in ``[edge_{k-1}, edge_k)``."""

    edges: tuple[float, ...]

    @classmethod
    def from_quantile_function(cls, quantile) -> "LossScale":
        n = len(PALETTE)
        return cls(edges=tuple(float(quantile(k / n)) for k in range(1, n)))

    @classmethod
    def from_values(cls, losses: np.ndarray) -> "LossScale":
        finite = np.asarray(losses, dtype=np.float64)
        finite = finite[np.isfinite(finite)]
        if finite.size == 0:
            return cls(edges=tuple(float(k) for k in range(1, len(PALETTE))))
        return cls.from_quantile_function(lambda q: np.quantile(finite, q))

    def bucket(self, losses) -> np.ndarray:
        """Bucket index per loss, -1 for NaN or infinite."""
        losses = np.asarray(losses, dtype=np.float64)
        out = np.searchsorted(np.asarray(self.edges), losses, side="right")
        return np.where(np.isfinite(losses), out, -1)

    def colour(self, bucket: int) -> str:
        return NAN_COLOUR if bucket < 0 else PALETTE[bucket]

    def text_colour(self, bucket: int) -> str:
        return "#ffffff" if bucket >= len(PALETTE) - 4 else "#000000"

    def labels(self) -> list[str]:
        """Human range of each bucket, lowest first: ``< 0.06``, ``0.06 to 0.14``, ..., ``>= 9.39``."""
        middle = [f"{lo:.2f} to {hi:.2f}" for lo, hi in zip(self.edges[:-1], self.edges[1:])]
        return [f"< {self.edges[0]:.2f}", *middle, f">= {self.edges[-1]:.2f}"]


@dataclass(frozen=True)
class Pieces:
    """A text cut at every boundary: piece ``p`` is ``text[starts[p]:ends[p]]``."""

    starts: np.ndarray  # (P,) int64
    ends: np.ndarray  # (P,) int64
    loss: np.ndarray  # (P,) float32, max teacher loss over the teacher tokens covering it (NaN: none)

    def __len__(self) -> int:
        return int(self.starts.size)

    def covering(self, starts, ends) -> list[list[int]]:
        """For each piece, the indices of the spans ``[starts, ends)`` that cover it."""
        owner, j = overlap_pairs(self.starts, self.ends, starts, ends)
        out: list[list[int]] = [[] for _ in range(len(self))]
        for p, k in zip(owner.tolist(), j.tolist()):
            out[p].append(k)
        return out


def cut_pieces(text_len: int, t_starts, t_ends, t_losses, *other_spans) -> Pieces:
    """Cut ``[0, text_len)`` at every teacher boundary (and every boundary of ``other_spans``,
    pairs of starts/ends arrays); each piece gets the max loss of its covering teacher tokens."""
    cuts = [np.asarray([0, text_len]), np.asarray(t_starts), np.asarray(t_ends)]
    for starts, ends in other_spans:
        cuts += [np.asarray(starts), np.asarray(ends)]
    bounds = np.unique(np.clip(np.concatenate(cuts).astype(np.int64), 0, text_len))  # (P+1,)
    starts, ends = bounds[:-1], bounds[1:]
    stand_in = Encoding(ids=np.zeros(starts.size, np.int32), starts=starts.astype(np.int32), ends=ends.astype(np.int32))
    loss = align_document(stand_in, t_starts, t_ends, t_losses, how="max").teacher_loss
    return Pieces(starts=starts, ends=ends, loss=loss)
