"""pipeline.method.alignment against brute-force references, on synthetic span sets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.method.alignment import (
    aggregate_teacher_losses,
    align_document,
    align_spans,
    alignment_quality,
    chunk_align,
    overlap_pairs,
)
from pipeline.method.tokenization import Encoding

SETTINGS = settings(max_examples=200, deadline=None)


# --------------------------------------------------------------------------------------------
# References and strategies
# --------------------------------------------------------------------------------------------


def brute_force_mapping(s_starts, s_ends, t_starts, t_ends) -> list[set[int]]:
    """A(i) by checking every (i, j) pair: O(N * M)."""
    out = []
    for c, d in zip(s_starts, s_ends):
        if d <= c:
            out.append(set())
            continue
        out.append({j for j, (a, b) in enumerate(zip(t_starts, t_ends)) if b > a and a < d and b > c})
    return out


def pairs_as_sets(owner, j, n) -> list[set[int]]:
    out = [set() for _ in range(n)]
    for i, jj in zip(owner.tolist(), j.tolist()):
        assert jj not in out[i], "duplicate pair"
        out[i].add(jj)
    return out


def reference_aggregate(lo, hi, losses, how) -> np.ndarray:
    reduce = {"max": max, "min": min, "mean": lambda v: sum(v) / len(v)}[how]
    out = []
    for a, b in zip(lo, hi):
        vals = [float(x) for x in losses[a:b] if not np.isnan(x)]
        out.append(reduce(vals) if vals else np.nan)
    return np.asarray(out, dtype=np.float32)


def to_arrays(spans):
    arr = np.asarray(spans, dtype=np.int32).reshape(-1, 2)
    return arr[:, 0].copy(), arr[:, 1].copy()


span = st.tuples(st.integers(0, 30), st.integers(0, 8)).map(lambda t: (t[0], t[0] + t[1]))


@st.composite
def general_teacher_spans(draw):
    """Spans sorted by start with arbitrary ends, duplicates and empty spans anywhere."""
    spans = sorted(draw(st.lists(span, max_size=25)), key=lambda s: s[0])
    for _ in range(draw(st.integers(0, 3))):  # special tokens (0, 0) or empty (x, x) anywhere
        pos = draw(st.integers(0, len(spans)))
        x = draw(st.sampled_from([0, draw(st.integers(0, 30))]))
        spans.insert(pos, (x, x))
    return spans


@st.composite
def tokenizer_like_spans(draw, n_chars: int):
    """What real tokenizers produce for a text of ``n_chars`` characters: consecutive pieces
    covering it, byte-fallback pieces repeating one character's span, and characters split across
    byte tokens (``(3,5), (4,5)``)."""
    spans, pos = [], 0
    while pos < n_chars:
        left = n_chars - pos
        kind = draw(st.sampled_from(["plain", "byte_fallback", "split_char"]))
        width = draw(st.integers(1, min(4, left)))
        if kind == "byte_fallback":
            spans += [(pos, pos + 1)] * draw(st.integers(2, 4))
            width = 1
        elif kind == "split_char" and left >= 2:  # ends inside a character, the next re-covers it
            width = min(width, left - 1)
            spans += [(pos, pos + width + 1), (pos + width, pos + width + 1)]
            width += 1
        else:
            spans.append((pos, pos + width))
        pos += width
    return spans


@st.composite
def tokenizer_like_pair(draw):
    """Student and teacher spans of the same text."""
    n_chars = draw(st.integers(0, 40))
    return draw(tokenizer_like_spans(n_chars)), draw(tokenizer_like_spans(n_chars))


# --------------------------------------------------------------------------------------------
# Span search
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(student=st.lists(span, max_size=25), teacher=general_teacher_spans())
def test_pairs_equal_brute_force_on_general_spans(student, teacher):
    c, d = to_arrays(student)
    a, b = to_arrays(teacher)
    expected = brute_force_mapping(c, d, a, b)
    lo, hi = align_spans(c, d, a, b)
    owner, j = overlap_pairs(c, d, a, b)
    assert pairs_as_sets(owner, j, len(c)) == expected
    for i, members in enumerate(expected):
        assert members <= set(range(lo[i], hi[i]))  # the range always contains A(i)
        if members:
            assert lo[i] == min(members)  # and starts at its first member
        else:
            assert lo[i] == hi[i]


@SETTINGS
@given(pair=tokenizer_like_pair())
def test_tokenizer_like_spans_give_exact_ranges_and_full_ios(pair):
    student, teacher = pair
    c, d = to_arrays(student)
    a, b = to_arrays(teacher)
    assert np.all(np.diff(b) >= 0)  # ends never decrease for these patterns
    lo, hi = align_spans(c, d, a, b)
    assert [set(range(x, y)) for x, y in zip(lo, hi)] == brute_force_mapping(c, d, a, b)

    q = alignment_quality(c, d, a, b)  # the teacher covers the whole text
    assert q.n_mapped == int(np.count_nonzero(d > c))
    assert np.all(q.ios[d > c] == 1.0)
    if q.n_mapped:
        assert q.iou == 1.0


def test_non_monotonic_ends_leave_holes_that_overlap_pairs_removes():
    a, b = np.array([0, 1, 5]), np.array([10, 2, 8])  # (1, 2) ends before the student starts
    lo, hi = align_spans([4], [6], a, b)
    assert (lo[0], hi[0]) == (0, 3)
    owner, j = overlap_pairs([4], [6], a, b)
    assert j.tolist() == [0, 2]


def test_empty_student_spans_map_to_nothing_and_empty_teacher_spans_never_match():
    lo, hi = align_spans([0, 2, 3], [0, 5, 3], [0, 0, 3, 4], [0, 4, 3, 6])
    assert (hi - lo).tolist()[0] == 0 and (hi - lo).tolist()[2] == 0
    owner, j = overlap_pairs([0, 2, 3], [0, 5, 3], [0, 0, 3, 4], [0, 4, 3, 6])
    assert list(zip(owner.tolist(), j.tolist())) == [(1, 1), (1, 3)]


def test_unsorted_teacher_starts_are_refused():
    with pytest.raises(ValueError, match="sorted"):
        align_spans([0], [1], [3, 1], [4, 2])


def test_no_teacher_tokens():
    lo, hi = align_spans([0, 1], [1, 2], [], [])
    assert np.array_equal(lo, hi)
    assert np.isnan(aggregate_teacher_losses(lo, hi, [], "max")).all()


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------

loss_value = st.one_of(st.just(float("nan")), st.floats(0.0, 20.0, width=32))


@SETTINGS
@given(
    losses=st.lists(loss_value, max_size=20),
    ranges=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), max_size=20),
    how=st.sampled_from(["max", "mean", "min"]),
)
def test_aggregation_equals_reference(losses, ranges, how):
    losses = np.asarray(losses, dtype=np.float32)
    m = len(losses)
    lo = np.array([min(x, m) for x, _ in ranges], dtype=np.int64)
    hi = np.array([min(x + w, m) for x, w in ranges], dtype=np.int64)
    got = aggregate_teacher_losses(lo, hi, losses, how)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference_aggregate(lo, hi, losses, how), rtol=1e-6)


def test_aggregation_hand_example():
    losses = np.array([1.0, np.nan, 3.0, np.nan, np.nan, 6.0])
    lo, hi = np.array([0, 1, 3, 2, 5]), np.array([3, 2, 5, 2, 6])
    for how, expected in [
        ("max", [3.0, np.nan, np.nan, np.nan, 6.0]),
        ("mean", [2.0, np.nan, np.nan, np.nan, 6.0]),
        ("min", [1.0, np.nan, np.nan, np.nan, 6.0]),
    ]:
        np.testing.assert_array_equal(aggregate_teacher_losses(lo, hi, losses, how), expected)
    with pytest.raises(ValueError):
        aggregate_teacher_losses(lo, hi, losses, "median")


@SETTINGS
@given(
    student=st.lists(span, max_size=20),
    teacher=general_teacher_spans(),
    how=st.sampled_from(["max", "mean", "min"]),
    data=st.data(),
)
def test_align_document_equals_reference(student, teacher, how, data):
    c, d = to_arrays(student)
    a, b = to_arrays(teacher)
    losses = np.asarray(data.draw(st.lists(loss_value, min_size=len(a), max_size=len(a))))
    doc = align_document(Encoding(np.zeros_like(c), c, d), a, b, losses, how)
    reduce = {"max": np.nanmax, "min": np.nanmin, "mean": np.nanmean}[how]
    for i, members in enumerate(brute_force_mapping(c, d, a, b)):
        vals = losses[sorted(members)]
        if np.isnan(vals).all():
            assert not doc.mapped[i] and np.isnan(doc.teacher_loss[i])
        else:
            assert doc.mapped[i]
            np.testing.assert_allclose(doc.teacher_loss[i], np.float32(reduce(vals)), rtol=1e-6)  # float32 output


# --------------------------------------------------------------------------------------------
# Identical tokenizers, chunks, quality
# --------------------------------------------------------------------------------------------


def test_identical_tokenizations_map_one_to_one():
    starts, ends = to_arrays([(0, 3), (3, 4), (4, 9), (9, 10)])
    lo, hi = align_spans(starts, ends, starts, ends)
    assert lo.tolist() == [0, 1, 2, 3] and (hi - lo).tolist() == [1, 1, 1, 1]
    # Byte-fallback pieces share a span: overlap maps each of them to all four teacher pieces,
    # one_to_one (same-vocabulary Rho-1) pairs them by position.
    starts, ends = to_arrays([(0, 2), (2, 3), (2, 3), (2, 3), (2, 3), (3, 5), (0, 0)])
    losses = np.array([0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    enc = Encoding(np.zeros_like(starts), starts, ends)
    doc = align_document(enc, starts, ends, losses, one_to_one=True)
    np.testing.assert_array_equal(doc.teacher_loss, [0.5, 1, 2, 3, 4, 5, np.nan])
    assert doc.mapped.tolist() == [True] * 6 + [False]
    doc = align_document(enc, starts, ends, losses, "max")
    np.testing.assert_array_equal(doc.teacher_loss, [0.5, 4, 4, 4, 4, 5, np.nan])
    with pytest.raises(ValueError, match="identical"):
        align_document(enc, starts[:-1], ends[:-1], losses[:-1], one_to_one=True)
    # A text the teacher stored with zero tokens (whitespace only) is unmapped, as with overlap.
    empty = np.zeros(0, np.int32)
    doc = align_document(enc, empty, empty, np.zeros(0, np.float32), one_to_one=True)
    assert not doc.mapped.any() and np.isnan(doc.teacher_loss).all() and len(doc) == len(enc)


def test_chunk_alignment_hand_example():
    # text of 12 characters, 3 chunks: [0, 4), [4, 8), [8, 12); tokens belong by start.
    s_starts, s_ends = to_arrays([(0, 3), (3, 5), (5, 9), (9, 12), (6, 6)])
    t_starts, t_ends = to_arrays([(0, 2), (2, 4), (4, 7), (7, 8), (8, 12), (0, 0)])
    t_losses = np.array([1.0, 3.0, 5.0, np.nan, np.nan, 100.0])
    got = chunk_align(s_starts, s_ends, t_starts, t_ends, t_losses, n_chunks=3, text_len=12)
    np.testing.assert_array_equal(got, [2.0, 2.0, 5.0, np.nan, np.nan])
    # One chunk: everyone gets the document mean; the empty student span stays unmapped.
    got = chunk_align(s_starts, s_ends, t_starts, t_ends, t_losses, n_chunks=1)
    np.testing.assert_allclose(got, [3.0, 3.0, 3.0, 3.0, np.nan])
    doc = align_document(
        Encoding(np.zeros_like(s_starts), s_starts, s_ends), t_starts, t_ends, t_losses,
        n_chunks=3, text_len=12,
    )
    assert doc.mapped.tolist() == [True, True, True, False, False]


def test_ios_and_iou_hand_example():
    # student [0,4) [4,8) [8,10); teacher [1,3) [3,6): characters 0 and 6..9 uncovered.
    s_starts, s_ends = to_arrays([(0, 4), (4, 8), (8, 10)])
    t_starts, t_ends = to_arrays([(1, 3), (3, 6)])
    q = alignment_quality(s_starts, s_ends, t_starts, t_ends)
    np.testing.assert_allclose(q.ios, [0.75, 0.5, np.nan])
    assert q.n_mapped == 2
    assert q.ios_mean == pytest.approx(0.625)
    assert q.iou == pytest.approx(5 / 8)  # S = [0, 8), T = [1, 6)
    # Restricting to tokens mapped by loss: only token 1 -> S = [4, 8), T = [3, 6)
    q = alignment_quality(s_starts, s_ends, t_starts, t_ends, mapped=[False, True, True])
    assert q.n_mapped == 1 and q.ios_mean == pytest.approx(0.5)
    assert q.iou == pytest.approx(2 / 5)



def test_batched_alignment_equals_one_document_at_a_time():
    """align_documents shifts documents onto one line; the result must not change per document."""
    from types import SimpleNamespace

    from pipeline.method.alignment import align_document, align_documents

    rng = np.random.default_rng(0)
    students, teachers = [], []
    for k in range(150):  # more than one shared line (LINE_DOCUMENTS)
        length = int(rng.integers(0, 60))
        s_cuts = np.unique(np.r_[0, rng.integers(0, length + 1, rng.integers(0, 20)), length])
        t_cuts = np.unique(np.r_[0, rng.integers(0, length + 1, rng.integers(0, 20)), length])
        s_starts, s_ends = s_cuts[:-1], s_cuts[1:]
        if k % 5 == 0 and s_starts.size:  # special tokens with empty spans
            s_starts, s_ends = np.r_[0, s_starts], np.r_[0, s_ends]
        t_starts, t_ends = t_cuts[:-1].copy(), t_cuts[1:].copy()
        if k % 3 == 0 and t_starts.size > 1:  # byte-level style overlapping spans
            t_starts[1] = max(t_starts[1] - 1, 0)
        t_losses = rng.gamma(2.0, 1.0, t_starts.size)
        t_losses[rng.random(t_starts.size) < 0.2] = np.nan
        students.append(SimpleNamespace(starts=s_starts, ends=s_ends))
        teachers.append((t_starts, t_ends, t_losses))
    for how in ("max", "mean", "min"):
        batched = align_documents(students, teachers, how)
        for s, t, got in zip(students, teachers, batched):
            want = align_document(s, *t, how=how)
            np.testing.assert_array_equal(got.teacher_loss, want.teacher_loss)
            np.testing.assert_array_equal(got.mapped, want.mapped)


# --------------------------------------------------------------------------------------------
# Batched alignment: fast path and fallback against align_document
# --------------------------------------------------------------------------------------------


@st.composite
def batch_document(draw):
    """One document of a batch: tokenizer-like spans (the fast path) or general ones, whose starts
    or ends may go back (the fallback); float32 losses as stage 1 stores them, or float64."""
    if draw(st.booleans()):
        student, teacher = draw(tokenizer_like_pair())
        if draw(st.booleans()):  # a teacher BOS stored with an empty span
            teacher = [(0, 0), *teacher]
        # an empty span inside the text where starts and ends stay non-decreasing (the fast path):
        # it lies strictly inside student tokens that cross it and must count for nothing
        gaps = [i + 1 for i in range(len(teacher) - 1) if teacher[i][1] <= teacher[i + 1][0]]
        if gaps and draw(st.booleans()):
            i = draw(st.sampled_from(gaps))
            teacher = [*teacher[:i], (teacher[i - 1][1], teacher[i - 1][1]), *teacher[i:]]
    else:
        student, teacher = draw(st.lists(span, max_size=15)), draw(general_teacher_spans())
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    losses = np.asarray(draw(st.lists(loss_value, min_size=len(teacher), max_size=len(teacher))), dtype=dtype)
    c, d = to_arrays(student)
    a, b = to_arrays(teacher)
    return Encoding(np.zeros_like(c), c, d), (a, b, losses)


@settings(max_examples=300, deadline=None)
@given(docs=st.lists(batch_document(), max_size=6), how=st.sampled_from(["max", "mean", "min"]))
def test_align_documents_equals_align_document_bit_for_bit(docs, how):
    from pipeline.method.alignment import _SharedLine, align_documents

    students, teachers = [s for s, _ in docs], [t for _, t in docs]
    goes_back = [k for k, (a, b, _) in enumerate(teachers) if np.any(np.diff(a) < 0) or np.any(np.diff(b) < 0)]
    if docs:  # exactly the documents whose teacher spans go back fall back to the general path
        assert _SharedLine.of(students, teachers).non_monotone_documents().tolist() == goes_back
    got = align_documents(students, teachers, how)
    assert len(got) == len(docs)
    for s, t, g in zip(students, teachers, got):
        want = align_document(s, *t, how)
        assert g.teacher_loss.dtype == np.float32
        assert np.array_equal(g.teacher_loss.view(np.uint32), want.teacher_loss.view(np.uint32))
        assert np.array_equal(g.mapped, want.mapped)


def test_align_documents_other_methods_and_errors():
    from pipeline.method.alignment import align_documents

    s = Encoding(np.zeros(3, np.int32), np.array([0, 2, 3], np.int32), np.array([2, 3, 5], np.int32))
    same = (s.starts, s.ends, np.array([1.0, 2.0, 3.0], np.float32))
    other = (np.array([0, 1], np.int32), np.array([1, 5], np.int32), np.array([4.0, 6.0], np.float32))
    one = align_documents([s, s], [same, same], one_to_one=True)
    assert all(np.array_equal(x.teacher_loss, [1.0, 2.0, 3.0]) for x in one)
    chunked = align_documents([s], [other], n_chunks=2, text_lens=[6])
    np.testing.assert_array_equal(chunked[0].teacher_loss, align_document(s, *other, n_chunks=2, text_len=6).teacher_loss)
    # Negative offsets (no tokenizer gives them) align each document on its own.
    odd = (np.array([-2, 0], np.int32), np.array([-1, 4], np.int32), np.array([9.0, 6.0], np.float32))
    np.testing.assert_array_equal(align_documents([s, s], [other, odd])[1].teacher_loss, [6.0, 6.0, 6.0])
    with pytest.raises(ValueError, match="document 1: 1 teacher losses for 2"):
        align_documents([s, s], [other, (other[0], other[1], other[2][:1])])
    with pytest.raises(ValueError, match="sorted"):  # unsorted non-empty starts, as align_document
        align_documents([s, s], [other, (np.array([3, 1], np.int32), np.array([4, 2], np.int32), other[2])])
    with pytest.raises(ValueError, match="aggregation"):
        align_documents([s], [other], "median")
    assert align_documents([], []) == []
