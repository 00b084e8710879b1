"""The peers' alignment, written for the benchmark: dynamic time warping over token strings with a
minimum-edit-distance cost, as FuseLLM's token alignment and DSKD's
min-edit-distance cross-tokenizer distillation do.

For a student sequence ``s_1..s_N`` and a teacher sequence ``t_1..t_M`` of token *strings* (with
the tokenizers' word-boundary markers ``▁``/``Ġ`` removed, as FuseLLM does):

    D[i, j] = lev(s_i, t_j) + min(D[i-1, j], D[i, j-1], D[i-1, j-1]),   D[0, 0] = 0, borders inf

filled for every ``(i, j)``: O(N M) time and memory, then one backtrack from ``(N, M)`` picks the
warping path; each student token maps to the teacher tokens the path pairs it with. To compare like
with like, the aligned teacher losses are then aggregated (max) exactly as the project does.

This implementation is *kinder* to the peer method than the original: the DP rows are Python lists
(FuseLLM indexes a NumPy matrix per cell, several times slower), and the edit distance of a token
pair is memoised (FuseLLM calls the C ``editdistance`` package for every cell). The backtrack is
FuseLLM's (``argmin`` over diagonal, up, left).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

MARKERS = ("▁", "Ġ")  # SentencePiece and byte-level BPE word-boundary markers


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; unit costs) between two strings."""
    if a == b:
        return 0
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def token_strings(tokenizer, ids: Sequence[int]) -> list[str]:
    """Token strings as the vocabulary stores them, word-boundary markers removed (FuseLLM)."""
    strings = tokenizer.convert_ids_to_tokens([int(i) for i in ids])
    out = []
    for s in strings:
        for marker in MARKERS:
            s = s.replace(marker, "")
        out.append(s)
    return out


def dtw_path(series_1: Sequence[str], series_2: Sequence[str]) -> list[list[int]]:
    """For every element of ``series_1`` the indices of ``series_2`` the DTW path pairs it with."""
    n, m = len(series_1), len(series_2)
    if n == 0 or m == 0:
        return [[] for _ in range(n)]
    cache: dict[tuple[str, str], int] = {}
    inf = math.inf
    rows = [[inf] * (m + 1) for _ in range(n + 1)]  # (N+1, M+1) accumulated cost
    rows[0][0] = 0.0
    for i in range(1, n + 1):
        a = series_1[i - 1]
        above, row = rows[i - 1], rows[i]
        for j in range(1, m + 1):
            key = (a, series_2[j - 1])
            cost = cache.get(key)
            if cost is None:
                cost = cache[key] = levenshtein(*key)
            best = above[j]
            if row[j - 1] < best:
                best = row[j - 1]
            if above[j - 1] < best:
                best = above[j - 1]
            row[j] = cost + best
    # Backtrack as FuseLLM: from (N-1, M-1) in 0-based cells, prefer diagonal, then up, then left.
    mapping: list[list[int]] = [[] for _ in range(n)]
    i, j = n, m
    while i > 1 or j > 1:
        mapping[i - 1].append(j - 1)
        diag = rows[i - 1][j - 1] if i > 1 and j > 1 else inf
        up = rows[i - 1][j] if i > 1 else inf
        left = rows[i][j - 1] if j > 1 else inf
        if diag <= up and diag <= left:
            i, j = i - 1, j - 1
        elif up <= left:
            i -= 1
        else:
            j -= 1
    mapping[0].append(0)
    return mapping


def dtw_align(student_tokenizer, student_ids, teacher_tokenizer, teacher_ids, teacher_losses) -> np.ndarray:
    """Per student token the max of the teacher losses its DTW-paired teacher tokens carry (NaN if
    none is finite): the peers' answer to the question :func:`pipeline.method.alignment.align_document` answers."""
    s = token_strings(student_tokenizer, student_ids)
    t = token_strings(teacher_tokenizer, teacher_ids)
    losses = np.asarray(teacher_losses, dtype=np.float64)
    out = np.full(len(s), np.nan, dtype=np.float32)
    for i, js in enumerate(dtw_path(s, t)):
        values = losses[js]
        values = values[~np.isnan(values)]
        if values.size:
            out[i] = values.max()
    return out


def dtw_cells(n_student: Sequence[int], n_teacher: Sequence[int], chunk: int | None = None) -> int:
    """DP cells DTW fills for documents of these lengths; with ``chunk``, each document is first cut
    into pieces of at most ``chunk`` student tokens and the teacher tokens in proportion (FuseLLM
    aligns training blocks of 2048 tokens, not whole documents)."""
    total = 0
    for n, m in zip(n_student, n_teacher):
        if chunk is None or n <= chunk:
            total += n * m
            continue
        pieces = math.ceil(n / chunk)
        total += pieces * math.ceil(n / pieces) * math.ceil(m / pieces)
    return total
