"""The rehearsal teacher (``scorer.backend=rehearsal``): a stand-in whose forward costs nothing, so
that everything around the forward (Ray actors, tokenization, windows, the writer, markers,
manifest, resume, the card, stage 2 and the export) runs at real size on CPUs
(docs/sizing-a-run.md#rehearsing-at-scale). Its output is named as a rehearsal's and the
consumers refuse it unless told (:mod:`pipeline.folders.rehearsal`).

The teacher is its tokenizer (``teacher.model``: a tokenizer folder, ``.gguf`` or hub id) plus a
fixed function: the loss of token ``w[i]`` of a window is ``Q(u)``, where ``u`` in ``[0, 1)`` is a
64-bit hash of the seed, the token and the :data:`CONTEXT` tokens before it (a sentinel standing
for each one before the window's start) and ``Q`` the quantile function of
:data:`LOSS_QUANTILES`, interpolated linearly; ``losses[0]`` is NaN as for every backend. So the
losses are deterministic, spread as a real teacher's, differ for one phrase in another context,
and are the same for a token whatever window scores it (a window plan keeps at least ``window -
stride`` tokens of left context past the first window: :data:`CONTEXT` or more in any real plan).
The hash is ``mix(mix(seed * G + sum_k M_k * w[i-k]))`` over ``k = 0 .. CONTEXT`` in 64-bit
arithmetic (``mix``: SplitMix64's finaliser; ``M_k = mix((k + 1) * G) | 1``, ``G`` the golden-ratio
constant), its top 53 bits scaled to ``[0, 1)``. The whole batch of windows is hashed at once with
NumPy: some tens of nanoseconds per token.

:data:`LOSS_QUANTILES` are the embedded tiny teacher's losses at probabilities ``k / 64`` over the
first 600 documents of the embedded sample corpus (clean and noise pages, windows of 512 and
stride 384: 565,559 tokens, mean 2.457 nats, standard deviation 3.223, median 1.372, 99th
percentile 13.33): ``python -m rehearsal.calibrate`` recomputes them. Changing them or
the hash changes the data, so :data:`VERSION` is part of the dataset's identity.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pipeline.folders.rehearsal import REHEARSAL_BACKEND
from pipeline.score_teacher.backends.base import ScorerConfig

VERSION = 1
CONTEXT = 8  # tokens before each token that its loss depends on
LOSS_QUANTILES = (  # nats at probabilities k / 64, k = 0 .. 64 (module docstring)
    0.0062, 0.0143, 0.0196, 0.0252, 0.0312, 0.0389, 0.0473, 0.0571, 0.0672, 0.0776, 0.0873, 0.0962, 0.1096,
    0.1269, 0.1472, 0.1710, 0.1983, 0.2305, 0.2698, 0.3085, 0.3437, 0.3930, 0.4508, 0.5127, 0.5817, 0.6601,
    0.7439, 0.8290, 0.9333, 1.0551, 1.1751, 1.2816, 1.3720, 1.4585, 1.5603, 1.6909, 1.8261, 1.9369, 2.0688,
    2.1590, 2.2418, 2.3231, 2.3896, 2.4733, 2.5411, 2.6067, 2.6788, 2.7627, 2.8623, 2.9831, 3.1192, 3.3223,
    3.5891, 3.9386, 4.4156, 5.0816, 6.1030, 7.1455, 8.2202, 9.1788, 9.9599, 10.6109, 11.2815, 12.5652, 18.4546,
)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SENTINEL = np.uint64(0xFFFFFFFF)  # not a token id: stands for a token before the window's start


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over a uint64 array: every input bit moves every output bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _multipliers() -> np.ndarray:
    """``M_k = mix((k + 1) * G) | 1`` for ``k = 0 .. CONTEXT``: odd, unrelated 64-bit constants."""
    return _mix(np.arange(1, CONTEXT + 2, dtype=np.uint64) * GOLDEN) | np.uint64(1)


def context_uniforms(tokens: np.ndarray, lengths: np.ndarray, seed: int) -> np.ndarray:
    """``u`` in ``[0, 1)`` for every position of ``tokens`` (windows of ``lengths`` laid end to
    end): the hash of the seed, the token and the :data:`CONTEXT` tokens before it in its window
    (module docstring). ``(N,)`` float64."""
    t = tokens.astype(np.uint64)  # (N,)
    starts = np.cumsum(lengths) - lengths  # (W,)
    position = np.arange(t.size) - np.repeat(starts, lengths)  # (N,) position inside its window
    m = _multipliers()
    h = np.uint64((seed * int(GOLDEN)) % 2**64) + m[0] * t  # the seed's product in Python: no scalar overflow
    for k in range(1, CONTEXT + 1):
        before = np.full_like(t, SENTINEL)
        before[k:] = t[:-k]
        before[position < k] = SENTINEL
        h += m[k] * before
    return (_mix(_mix(h)) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def quantile_losses(u: np.ndarray) -> np.ndarray:
    """``Q(u)``: the calibrated quantile function, linear between its knots. ``(N,)`` float32."""
    knots = np.asarray(LOSS_QUANTILES, dtype=np.float64)
    probabilities = np.linspace(0.0, 1.0, knots.size)
    return np.interp(u, probabilities, knots).astype(np.float32)


class RehearsalScorer:
    """Scores windows with the rehearsal function (module docstring); loads no model."""

    def __init__(self, cfg: ScorerConfig):
        self.cfg = cfg

    def describe(self) -> dict:
        return {"backend": REHEARSAL_BACKEND, "device": "cpu",
                "engine": {"name": REHEARSAL_BACKEND, "version": VERSION, "device": "cpu"}}

    def score(self, windows: Sequence[np.ndarray]) -> list[np.ndarray]:
        if not windows:
            return []
        lengths = np.fromiter((len(w) for w in windows), dtype=np.int64, count=len(windows))
        starts = np.cumsum(lengths) - lengths
        tokens = np.concatenate([np.asarray(w) for w in windows])  # (N,) every window end to end
        losses = quantile_losses(context_uniforms(tokens, lengths, self.cfg.seed))
        losses[starts[lengths > 0]] = np.nan  # nothing predicts a window's first token
        return np.split(losses, starts[1:])


def rehearsal_identity(cfg: ScorerConfig) -> dict:
    """The teacher part of a rehearsal dataset's identity besides its tokenizer: no model, the
    function's version and seed."""
    return {"source": REHEARSAL_BACKEND, "model": None, "revision": None,
            "rehearsal": {"version": VERSION, "seed": cfg.seed, "context": CONTEXT, "knots": len(LOSS_QUANTILES)}}
