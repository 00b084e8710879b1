import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.method.windows import plan_windows, stitch


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 400), window=st.integers(2, 64), data=st.data())
def test_every_position_scored_exactly_once_with_enough_context(n, window, data):
    stride = data.draw(st.integers(1, window - 1))
    plan = plan_windows(n, window, stride)
    counts = np.zeros(max(n, 1), dtype=int)
    for k, w in enumerate(plan):
        assert 0 <= w.start < w.first_scored <= w.stop <= n
        assert w.stop - w.start <= window
        counts[w.first_scored : w.stop] += 1
        assert w.start == k * stride, "window k starts at k * stride"
        if k > 0:  # later windows keep at least window - stride tokens of left context
            assert w.first_scored - w.start >= window - stride
            assert w.first_scored == plan[k - 1].stop, "a window scores what the one before could not"
    if n > 1:
        assert counts[0] == 0 and (counts[1:n] == 1).all()
    else:
        assert plan == []


def test_hand_worked_plans():
    # 10 positions, window 4, stride 2: starts 0, 2, 4, 6; each later window scores the two
    # positions past the previous window's end, with two tokens of left context.
    assert [(w.start, w.stop, w.first_scored) for w in plan_windows(10, 4, 2)] == [
        (0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    # stride 3 of window 5 over 12 positions: the last window is cut at the end of the sequence.
    assert [(w.start, w.stop, w.first_scored) for w in plan_windows(12, 5, 3)] == [
        (0, 5, 1), (3, 8, 5), (6, 11, 8), (9, 12, 11)]
    # A sequence that fits one window is one window; a single position has nothing to predict.
    assert [(w.start, w.stop, w.first_scored) for w in plan_windows(4, 4, 1)] == [(0, 4, 1)]
    assert plan_windows(1, 4, 2) == [] and plan_windows(0, 4, 2) == []


def test_stitch_takes_each_loss_from_its_window():
    plan = plan_windows(10, 4, 2)
    losses = [np.arange(w.start, w.stop, dtype=np.float32) + 100 * k for k, w in enumerate(plan)]
    out = stitch(10, plan, losses)
    assert np.isnan(out[0])
    for k, w in enumerate(plan):
        assert (out[w.first_scored : w.stop] == np.arange(w.first_scored, w.stop) + 100 * k).all()


@pytest.mark.parametrize("window,stride", [(1, 1), (8, 0), (8, 8)])
def test_bad_window_settings_are_refused(window, stride):
    with pytest.raises(ValueError):
        plan_windows(10, window, stride)
