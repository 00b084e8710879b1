"""The rehearsal teacher's function (scorer.backend=rehearsal), against a reference written from its
definition one token at a time with Python integers: deterministic, the same loss for a token
whatever window scores it, NaN at each window's first token, spread as its calibration says, and
another loss for the same phrase after other context."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.rehearsal import LOSS_QUANTILES, RehearsalScorer
from pipeline.method.windows import plan_windows, stitch
from rehearsal_reference import reference_window

def test_losses_equal_the_definition_token_by_token():
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 151_646, size=n).astype(np.int32) for n in (1, 2, 3, 17, 200)]
    for seed in (0, 7):
        got = RehearsalScorer(ScorerConfig(backend="rehearsal", seed=seed)).score(windows)
        for w, losses in zip(windows, got):
            assert losses.dtype == np.float32 and losses.shape == w.shape
            np.testing.assert_array_equal(losses, np.asarray(reference_window(seed, w.tolist()), np.float32))


def test_deterministic_and_the_seed_changes_the_losses():
    w = [np.arange(50, dtype=np.int32) * 37 % 1000]
    a = RehearsalScorer(ScorerConfig(backend="rehearsal")).score(w)[0]
    b = RehearsalScorer(ScorerConfig(backend="rehearsal")).score([w[0].copy()])[0]
    c = RehearsalScorer(ScorerConfig(backend="rehearsal", seed=1)).score(w)[0]
    np.testing.assert_array_equal(a, b)
    assert np.isnan(a[0]) and np.isfinite(a[1:]).all()
    assert (a[1:] != c[1:]).mean() > 0.9


@pytest.mark.parametrize("window, stride", [(64, 32), (16, 8), (300, 100)])
def test_a_document_scored_in_windows_equals_one_window(window, stride):
    """Stitched windows give every token the loss one whole-document window gives it: each later
    window keeps window - stride >= 8 tokens of left context, all the function looks at."""
    z = np.random.default_rng(1).integers(0, 5000, size=1000).astype(np.int32)
    scorer = RehearsalScorer(ScorerConfig(backend="rehearsal"))
    plan = plan_windows(len(z), window, stride)
    stitched = stitch(len(z), plan, scorer.score([z[w.start:w.stop] for w in plan]))
    whole = scorer.score([z])[0]
    np.testing.assert_array_equal(stitched, whole)


def test_the_losses_are_spread_as_the_calibration():
    """Over 400,000 distinct contexts the empirical quantiles are the knots' (the hash is uniform)."""
    z = np.random.default_rng(2).integers(0, 151_646, size=400_001).astype(np.int32)
    losses = RehearsalScorer(ScorerConfig(backend="rehearsal")).score([z])[0][1:]
    probabilities = np.linspace(0, 1, len(LOSS_QUANTILES))[1:-1]
    expected = np.asarray(LOSS_QUANTILES)[1:-1]
    got = np.quantile(losses, probabilities)
    spacing = np.diff(LOSS_QUANTILES)
    tolerance = 0.02 * np.maximum(spacing[:-1], spacing[1:]) * len(LOSS_QUANTILES) + 1e-3
    assert np.all(np.abs(got - expected) <= tolerance), np.abs(got - expected).max()
    assert losses.min() >= LOSS_QUANTILES[0] and losses.max() <= LOSS_QUANTILES[-1]


def test_one_phrase_after_another_context_gets_other_losses():
    phrase = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133]
    scorer = RehearsalScorer(ScorerConfig(backend="rehearsal"))
    a, b, c = scorer.score([np.asarray([1, 2, *phrase]), np.asarray([3, 4, *phrase]), np.asarray([1, 2, *phrase])])
    np.testing.assert_array_equal(a, c)
    assert (a[2:10] != b[2:10]).all()  # within CONTEXT of the differing tokens
    np.testing.assert_array_equal(a[11:], b[11:])  # further than CONTEXT tokens: the same context
