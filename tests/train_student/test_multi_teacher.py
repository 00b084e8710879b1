"""Several teachers, one student (docs/METHOD.md §2.6): matching, combining, metrics, training, resume.

The second teacher of most tests is the micro scored dataset written again, row by row through the
real stage-1 writer, under another teacher name (what scoring the corpus twice with the same model
under two names stores), optionally with documents changed, dropped or added.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.score_teacher.teacher import ShardResult
from pipeline.score_teacher.writer import write_manifest, write_shard
from pipeline.method.alignment import align_document
from pipeline.student_data.build import build_student_data
from pipeline.student_data.settings import AlignmentConfig, PackingConfig
from pipeline.method.guided_loss import SelectionConfig, select_tokens
from pipeline.train_student.run import run_training
from pipeline.student_data.several_teachers import TeacherMismatchError, combine_losses, open_teachers
from pipeline.train_student.several_teachers import TeacherMetrics, decision_credit
from pipeline.method.tokenization import Encoding, load_tokenizer
from storage_schemas.reader import ScoredDataset, ScoredDocument, ShardReader
from test_train_student import CrashAt, make_job, metrics

NAN = float("nan")


# --------------------------------------------------------------------------------------------
# Helpers


def rewrite(src: Path, dst: Path, name: str, change=None, extra: list[ScoredDocument] = ()) -> Path:
    """``src`` written again under teacher name ``name``; ``change(doc)`` returns the document to
    store instead (None drops it); ``extra`` documents go into the last shard."""
    ds = ScoredDataset.open(src)
    identity = copy.deepcopy(ds.manifest["identity"])
    identity["teacher"]["name"] = name
    dst.mkdir(parents=True)
    done = {}
    for index, shard in enumerate(ds.shards):
        t = pq.read_table(shard.path).to_pydict()
        docs = [ScoredDocument(t["doc_id"][r], t["text"][r], np.asarray(t["token_ids"][r], np.int32),
                               np.asarray(t["starts"][r], np.int32), np.asarray(t["ends"][r], np.int32),
                               np.asarray(t["losses"][r], np.float32)) for r in range(len(t["doc_id"]))]
        docs = [d for d in (change(d) if change else d for d in docs) if d is not None]
        if index == len(ds.shards) - 1:
            docs += list(extra)
        done[index] = write_shard(dst, index, ShardResult(documents=docs), identity, {"index": index}, "test")
    write_manifest(dst, identity, done, len(ds.shards), "test")
    return dst


@pytest.fixture(scope="module")
def twin(micro_scored, tmp_path_factory) -> Path:
    """The micro scored dataset under another teacher name: same documents, same losses."""
    return rewrite(micro_scored, tmp_path_factory.mktemp("twin") / "v1", "micro-twin")


@pytest.fixture(scope="module")
def student_tok(tiny_student):  # noqa: F811
    return load_tokenizer(str(tiny_student))


def text_of(ds, d: int) -> str:
    """The text of the document at stream position ``d``, read directly."""
    return ShardReader(ds.shards).row(int(ds.plan.doc_shard[d]), int(ds.plan.doc_row[d])).text


def samples(data) -> list[dict]:
    return [data.dataset[k] for k in range(len(data.dataset))]


def build(folders, tok, tmp_path=None, **alignment):
    missing = alignment.pop("missing", "refuse")
    return build_student_data(open_teachers([str(f) for f in folders]), tok, PackingConfig(seq_len=32, seed=1),
                              AlignmentConfig(**alignment), missing_documents=missing)


def brute_teacher_loss(encoding, starts, ends, losses, how="max") -> np.ndarray:
    """Per student token, the aggregated loss of the teacher tokens whose spans overlap it (loops)."""
    out = []
    for c, d in zip(encoding.starts.tolist(), encoding.ends.tolist()):
        hit = [float(l) for a, b, l in zip(starts, ends, losses) if a < d and b > c and b > a and not math.isnan(l)]
        out.append(NAN if d <= c or not hit else {"max": max, "min": min}.get(how, lambda v: sum(v) / len(v))(hit))
    return np.asarray(out, np.float64)


def brute_combine(values: list[float], how: str, weights=None) -> float:
    present = [(v, w) for v, w in zip(values, weights or [1.0] * len(values)) if not math.isnan(v)]
    if not present:
        return NAN
    if how == "min":
        return min(v for v, _ in present)
    if how == "max":
        return max(v for v, _ in present)
    return sum(v * w for v, w in present) / sum(w for _, w in present)


# --------------------------------------------------------------------------------------------
# Combining: hand-worked


def test_hand_worked_two_teachers_combine_per_student_token():
    """Text ``ab cd``: teacher A cuts ``ab`` `` cd`` (losses 1.0, 3.0), teacher B ``a`` ``b cd``
    (2.0, 0.5), the student ``ab`` `` c`` ``d``. With max aggregation A gives 1.0, 3.0, 3.0 and B
    gives max(2.0, 0.5) = 2.0, 0.5, 0.5; combined by hand below."""
    student = Encoding(ids=np.arange(3, dtype=np.int32), starts=np.array([0, 2, 4], np.int32),
                       ends=np.array([2, 4, 5], np.int32))
    a = align_document(student, [0, 2], [2, 5], [1.0, 3.0], "max").teacher_loss
    b = align_document(student, [0, 1], [1, 5], [2.0, 0.5], "max").teacher_loss
    both = np.stack([a, b], axis=1)
    assert combine_losses(both, "min").tolist() == [1.0, 0.5, 0.5]
    assert combine_losses(both, "max").tolist() == [2.0, 3.0, 3.0]
    assert combine_losses(both, "mean").tolist() == [1.5, 1.75, 1.75]
    assert combine_losses(both, "weighted", [3.0, 1.0]).tolist() == [1.25, 2.375, 2.375]


def test_a_token_is_unmapped_only_when_no_teacher_maps_it():
    losses = np.array([[NAN, 2.0], [4.0, NAN], [NAN, NAN], [1.0, 3.0]], np.float32)
    for how, want in (("min", [2.0, 4.0, NAN, 1.0]), ("max", [2.0, 4.0, NAN, 3.0]),
                      ("mean", [2.0, 4.0, NAN, 2.0]), ("weighted", [2.0, 4.0, NAN, 2.5])):
        got = combine_losses(losses, how, [1.0, 3.0] if how == "weighted" else None)
        np.testing.assert_array_equal(got, np.asarray(want, np.float32))


def test_combine_matches_brute_force_on_random_values():
    rng = np.random.default_rng(0)
    losses = rng.gamma(2.0, 1.0, (200, 3)).astype(np.float32)
    losses[rng.random((200, 3)) < 0.3] = np.nan
    weights = [0.5, 2.0, 1.0]
    for how in ("min", "max", "mean", "weighted"):
        got = combine_losses(losses, how, weights if how == "weighted" else None)
        want = [brute_combine(row.tolist(), how, weights if how == "weighted" else None) for row in losses]
        np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=1e-6, equal_nan=True)


# --------------------------------------------------------------------------------------------
# Per-teacher metrics against loops


def test_decision_credit_hand_worked():
    losses = torch.tensor([[1.0, 1.0], [2.0, 0.5], [NAN, 3.0], [NAN, NAN]])
    for how, weights, want in (
        ("min", None, [[0.5, 0.5], [0, 1], [0, 1], [0, 0]]),
        ("max", None, [[0.5, 0.5], [1, 0], [0, 1], [0, 0]]),
        ("mean", None, [[0.5, 0.5], [0.5, 0.5], [0, 1], [0, 0]]),
        ("weighted", (3.0, 1.0), [[0.75, 0.25], [0.75, 0.25], [0, 1], [0, 0]]),
    ):
        combined = torch.from_numpy(combine_losses(losses.numpy(), how, weights))
        got = decision_credit(losses, combined, how, weights)
        assert got.tolist() == want, how


@pytest.mark.parametrize("rank_over", ["batch", "sequence"])
def test_teacher_metrics_match_loops(rank_over):
    """Shares decided and Jaccard of the teachers' own top-k against a loop over tokens; the own
    selections come from :func:`select_tokens` with one teacher's losses (the single-teacher rule)."""
    gen = torch.Generator().manual_seed(3)
    B, L, T = 2, 24, 3
    token_loss = torch.rand(B, L, generator=gen) * 5
    valid = torch.rand(B, L, generator=gen) > 0.1
    teacher = (torch.rand(B, L, T, generator=gen) * 4).round()  # rounded: ties between teachers happen
    teacher[torch.rand(B, L, T, generator=gen) < 0.25] = NAN
    config = SelectionConfig(ratio=0.4, rank_over=rank_over)
    names = ("a", "b", "c")
    for how, weights in (("min", None), ("max", None), ("mean", None), ("weighted", (1.0, 2.0, 0.5))):
        combined = torch.from_numpy(combine_losses(teacher.reshape(-1, T).numpy(), how, weights)).view(B, L)
        _, selected = select_tokens(token_loss, valid, combined, ~torch.isnan(combined), config)
        m = TeacherMetrics(names, how, weights, config)
        got = m.metrics(m.sums(token_loss, valid, selected, teacher, combined).tolist())

        credit = [0.0] * T
        for b, i in itertools.product(range(B), range(L)):
            if not selected[b, i]:
                continue
            values = teacher[b, i].tolist()
            if how in ("min", "max"):
                winners = [t for t in range(T) if values[t] == float(combined[b, i])]
                for t in winners:
                    credit[t] += 1 / len(winners)
            else:
                w = weights or (1.0,) * T
                total = sum(w[t] for t in range(T) if not math.isnan(values[t]))
                for t in range(T):
                    credit[t] += 0 if math.isnan(values[t]) else w[t] / total
        n_selected = int(selected.sum())
        for t in range(T):
            assert got[f"decided_t{t}"] == pytest.approx(credit[t] / n_selected), (how, t)
            mapped = sum(1 for b, i in itertools.product(range(B), range(L))
                         if valid[b, i] and not math.isnan(float(teacher[b, i, t])))
            assert got[f"mapped_fraction_t{t}"] == pytest.approx(mapped / int(valid.sum()))
        assert sum(got[f"decided_t{t}"] for t in range(T)) == pytest.approx(1.0)
        own = [select_tokens(token_loss, valid, teacher[..., t], ~torch.isnan(teacher[..., t]), config)[1]
               for t in range(T)]
        for a, b in itertools.combinations(range(T), 2):
            sa = {(x, y) for x, y in itertools.product(range(B), range(L)) if own[a][x, y]}
            sb = {(x, y) for x, y in itertools.product(range(B), range(L)) if own[b][x, y]}
            assert got[f"selection_jaccard_t{a}_t{b}"] == pytest.approx(len(sa & sb) / len(sa | sb))


# --------------------------------------------------------------------------------------------
# The data pipeline


def test_folders_of_one_teacher_stay_one_teacher(micro_scored, twin):
    assert len(open_teachers([str(micro_scored)])) == 1
    grouped = open_teachers([str(micro_scored), str(twin)])
    assert [d.teacher["teacher"]["name"] for d in grouped] == ["micro", "micro-twin"]


@pytest.mark.parametrize("how", ["min", "mean", "max"])
def test_the_same_teacher_twice_gives_the_single_teacher_samples(micro_scored, twin, student_tok, how):
    one = build([micro_scored], student_tok, combine=how)
    two = build([micro_scored, twin], student_tok, combine=how)
    assert one.plan.summary() == two.plan.summary() and one.dataset.teachers is None
    for a, b in zip(samples(one), samples(two)):
        assert set(b) - set(a) == {"teacher_losses"}
        for key in a:
            assert torch.equal(a[key], b[key]) if key != "teacher_loss" else \
                torch.equal(a[key].nan_to_num(-1.0), b[key].nan_to_num(-1.0)), key
        for t in range(2):
            assert torch.equal(b["teacher_losses"][:, t].nan_to_num(-1.0), a["teacher_loss"].nan_to_num(-1.0))


def test_two_teachers_against_a_brute_force_alignment(micro_scored, tmp_path, student_tok):
    """Teacher B: the same texts, its losses changed (scaled, a few tokens NaN); every sample's
    per-teacher and combined losses equal a loop over spans, for every combination."""
    def change(doc):
        losses = doc.losses * np.float32(1.7) - np.float32(0.4)
        losses[::7] = np.nan
        return replace(doc, losses=losses.astype(np.float32))

    other = rewrite(micro_scored, tmp_path / "b", "micro-b", change)
    rows = {}
    for folder in (micro_scored, other):
        for record in ScoredDataset.open(folder).iter_documents():
            rows.setdefault(record.text, []).append(record)
    for how, weights in (("min", None), ("max", None), ("mean", None), ("weighted", [2.0, 0.5])):
        data = build([micro_scored, other], student_tok, combine=how, teacher_weights=weights)
        ds = data.dataset
        for d in range(min(40, ds.plan.doc_row.size)):
            doc = ds.document(d)
            text = text_of(ds, d)
            enc = student_tok(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
            spans = np.asarray(enc["offset_mapping"], np.int32).reshape(-1, 2)
            encoding = Encoding(np.asarray(enc["input_ids"], np.int32), spans[:, 0].copy(), spans[:, 1].copy())
            per = [brute_teacher_loss(encoding, r.starts.tolist(), r.ends.tolist(), r.losses.tolist()) for r in rows[text]]
            inner = slice(int(ds.plan.add_bos), doc.ids.size - 1)
            for t in range(2):
                np.testing.assert_allclose(doc.teacher_losses[inner, t], per[t], rtol=1e-6, equal_nan=True)
            want = [brute_combine([per[0][i], per[1][i]], how, weights) for i in range(len(encoding.ids))]
            np.testing.assert_allclose(doc.teacher_loss[inner], want, rtol=1e-6, equal_nan=True)
            np.testing.assert_array_equal(doc.mapped[inner], ~np.isnan(np.asarray(want)))


def test_different_corpora_are_refused_naming_documents(micro_scored, tmp_path, student_tok):
    other = rewrite(micro_scored, tmp_path / "b", "micro-b", lambda d: replace(d, doc_id="other:" + d.doc_id))
    with pytest.raises(TeacherMismatchError, match=r"shares no document .*different corpora.*other:"):
        build([micro_scored, other], student_tok)


def test_a_changed_text_is_refused_naming_the_document(micro_scored, tmp_path, student_tok):
    victim = ScoredDataset.open(micro_scored).find_document(None, min_tokens=1).doc_id
    other = rewrite(micro_scored, tmp_path / "b", "micro-b",
                    lambda d: replace(d, text=d.text + "!") if d.doc_id == victim else d)
    with pytest.raises(TeacherMismatchError, match=rf"another text .*{victim}"):
        build([micro_scored, other], student_tok)
    with pytest.raises(TeacherMismatchError, match=rf"another text .*{victim}"):
        build([micro_scored, other], student_tok, missing="unmapped")  # no rule lets it through


def test_a_missing_document_is_refused_or_unmapped_for_that_teacher(micro_scored, tmp_path, student_tok):
    first = ScoredDataset.open(micro_scored)
    victim = first.find_document(None, min_tokens=5).doc_id
    other = rewrite(micro_scored, tmp_path / "b", "micro-b", lambda d: None if d.doc_id == victim else d)
    with pytest.raises(TeacherMismatchError, match=rf"micro-b .*lacks 1 document.*{victim}.*missing_documents=unmapped"):
        build([micro_scored, other], student_tok)
    data = build([micro_scored, other], student_tok, missing="unmapped")
    single = build([micro_scored], student_tok)
    assert data.teachers.missing == [0, 1] and data.plan.summary() == single.plan.summary()
    ds = data.dataset
    position = next(d for d in range(ds.plan.doc_row.size)
                    if text_of(ds, d) == first.find_document(victim).text)
    doc, alone = ds.document(position), single.dataset.document(position)
    assert np.isnan(doc.teacher_losses[:, 1]).all()  # the teacher lacking it maps nothing
    np.testing.assert_array_equal(doc.teacher_loss, alone.teacher_loss)  # the other teacher decides alone
    np.testing.assert_array_equal(doc.mapped, alone.mapped)


def test_a_document_only_a_later_teacher_holds_joins_the_stream(micro_scored, tmp_path, student_tok):
    text = "Let x = 3. Then 2x + 1 = 7, so the answer is 7."
    extra = ScoredDocument("extra:0", text, np.array([1, 2], np.int32), np.array([0, 6], np.int32),
                           np.array([6, len(text)], np.int32), np.array([2.5, 0.75], np.float32))
    other = rewrite(micro_scored, tmp_path / "b", "micro-b", extra=[extra])
    with pytest.raises(TeacherMismatchError, match=r"teacher micro .*lacks 1 document.*extra:0"):
        build([micro_scored, other], student_tok)
    data = build([micro_scored, other], student_tok, missing="unmapped")
    single = build([micro_scored], student_tok)
    assert data.plan.summary()["n_documents"] == single.plan.summary()["n_documents"] + 1
    assert data.plan.n_empty == single.plan.n_empty  # rows of the later shard that were matched are not "empty"
    ds = data.dataset
    found = [d for d in range(ds.plan.doc_row.size)
             if text_of(ds, d) == text]
    assert len(found) == 1
    doc = ds.document(found[0])
    enc = student_tok(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
    spans = np.asarray(enc["offset_mapping"], np.int32).reshape(-1, 2)
    want = brute_teacher_loss(Encoding(np.asarray(enc["input_ids"], np.int32), spans[:, 0].copy(), spans[:, 1].copy()),
                              [0, 6], [6, len(text)], [2.5, 0.75])
    inner = slice(int(ds.plan.add_bos), doc.ids.size - 1)
    assert np.isnan(doc.teacher_losses[:, 0]).all()
    np.testing.assert_allclose(doc.teacher_loss[inner], want, equal_nan=True)


def test_a_document_listed_twice_by_one_teacher_is_refused(micro_scored, tmp_path, student_tok):
    doubled = ScoredDataset.open(micro_scored).find_document(None, min_tokens=1)
    again = ScoredDocument(doubled.doc_id, doubled.text, doubled.ids, doubled.starts, doubled.ends, doubled.losses)
    other = rewrite(micro_scored, tmp_path / "b", "micro-b", extra=[again])
    with pytest.raises(TeacherMismatchError, match=rf"micro-b .*more than once: {doubled.doc_id}"):
        build([micro_scored, other], student_tok)


def test_a_teachers_unreadable_shard_is_named_or_skipped_and_its_documents_missing(micro_scored, tmp_path, student_tok):
    other = rewrite(micro_scored, tmp_path / "b", "micro-b")
    victim = other / "shard-000001.parquet"
    data = victim.read_bytes()
    victim.write_bytes(data[:100] + bytes(len(data) - 100))  # same size, footer gone
    from storage_schemas.reader import BadShardError

    with pytest.raises(BadShardError, match="shard-000001.parquet"):
        build([micro_scored, other], student_tok)
    lost = pq.read_table(micro_scored / "shard-000001.parquet", columns=["doc_id"]).column("doc_id").to_pylist()
    with pytest.raises(TeacherMismatchError, match=rf"micro-b .*lacks {len(lost)} document.*{lost[0]}"):
        build_student_data(open_teachers([str(micro_scored), str(other)], on_bad_shard="skip"), student_tok,
                           PackingConfig(seq_len=32), AlignmentConfig(), on_bad_shard="skip")
    data = build_student_data(open_teachers([str(micro_scored), str(other)], on_bad_shard="skip"), student_tok,
                              PackingConfig(seq_len=32), AlignmentConfig(), on_bad_shard="skip",
                              missing_documents="unmapped")
    assert data.teachers.missing == [0, len(lost)]
    assert [s["file"] for s in data.scored.skipped] == ["shard-000001.parquet"]


def test_teacher_weights_must_match_the_teachers(micro_scored, twin, student_tok):
    with pytest.raises(ValueError, match=r"3 weight\(s\) for 2 teachers \(micro, micro-twin"):
        build([micro_scored, twin], student_tok, combine="weighted", teacher_weights=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="combine=weighted needs one weight per teacher"):
        AlignmentConfig(combine="weighted")
    with pytest.raises(ValueError, match="must all be finite and > 0"):
        AlignmentConfig(combine="weighted", teacher_weights=[1.0, 0.0])


# --------------------------------------------------------------------------------------------
# Training


def two_teacher_job(model, folders, out, steps=4, combine="min", **changes):
    job = make_job(model, folders[0], out, steps, **changes)
    return replace(job, data=replace(job.data, folders=[str(f) for f in folders]),
                   alignment=replace(job.alignment, combine=combine))


LOGGED = ("step", "loss", "loss_kept", "loss_all", "kept_fraction", "mapped_fraction", "excess_loss", "grad_norm",
          "sample_first", "sample_last")


@pytest.mark.parametrize("how", ["min", "mean", "max"])
def test_identical_teachers_train_exactly_the_single_teacher_run(tiny_student, micro_scored, twin, tmp_path, how):  # noqa: F811
    one = run_training(make_job(tiny_student, micro_scored, tmp_path / "one", steps=3))
    two = run_training(two_teacher_job(tiny_student, [micro_scored, twin], tmp_path / "two", steps=3, combine=how))
    a, b = metrics(Path(one.output_dir)), metrics(Path(two.output_dir))
    assert [{k: r[k] for k in LOGGED} for r in a] == [{k: r[k] for k in LOGGED} for r in b]
    for r in b:  # identical teachers: every decision a tie, split evenly; their own selections coincide
        assert r["decided_t0"] == r["decided_t1"] == 0.5 and r["selection_jaccard_t0_t1"] == 1.0
        assert r["mapped_fraction_t0"] == r["mapped_fraction_t1"] == r["mapped_fraction"]
    assert two.data["teachers"] == ["micro", "micro-twin"] and two.data["combine"] == how
    assert "teachers" not in one.data and "decided_t0" not in a[-1]


def test_two_teacher_run_resumes_exactly_and_refuses_another_combination(tiny_student, micro_scored, tmp_path):  # noqa: F811
    def change(doc):
        return replace(doc, losses=(doc.losses[::-1].copy() + np.float32(0.25)).astype(np.float32))

    other = rewrite(micro_scored, tmp_path / "b", "micro-b", change)
    steps = 6
    straight = two_teacher_job(tiny_student, [micro_scored, other], tmp_path / "straight", steps, combine="mean",
                               workers=1)
    run_training(straight)
    interrupted = replace(straight, output_dir=str(tmp_path / "interrupted"))
    with pytest.raises(KeyboardInterrupt):
        run_training(interrupted, callbacks=[CrashAt(5)])
    summary = run_training(interrupted)
    assert summary.resumed_from.endswith("checkpoint-4") and summary.steps == steps
    keys = (*LOGGED, "decided_t0", "decided_t1", "mapped_fraction_t0", "mapped_fraction_t1", "selection_jaccard_t0_t1")
    a, b = metrics(Path(straight.output_dir)), metrics(Path(interrupted.output_dir))
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    assert 0 < a[-1]["decided_t0"] < 1 and 0 < a[-1]["selection_jaccard_t0_t1"] < 1  # teachers that differ
    identity = json.loads((Path(interrupted.output_dir) / "checkpoint-4" / "data_identity.json").read_text())
    assert [t["teacher"]["teacher"]["name"] for t in identity["teachers"]] == ["micro", "micro-b"]
    from pipeline.train_student.checkpoints import RunMismatchError

    with pytest.raises(RunMismatchError, match=r"data combine.how: 'mean' != 'max'"):
        run_training(replace(interrupted, alignment=replace(interrupted.alignment, combine="max"),
                             train=replace(interrupted.train, max_steps=8)))
