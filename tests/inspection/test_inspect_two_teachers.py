"""``make inspect ARGS="command=two-teachers ..."``: one corpus scored by two teachers with real,
different tokenizers (Qwen2 and Mistral), seen through a third (Llama-2): correlation of the aligned
losses and disagreement of the top-40% selections against loops over spans and sorted lists."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from rich.console import Console

from pipeline.inspection.two_teachers import two_teachers
from pipeline.score_teacher.teacher import ShardResult
from pipeline.score_teacher.writer import write_manifest, write_shard
from pipeline.method.tokenization import encode_batch
from stages.common import ConfigError
from stages.inspect import run
from storage_schemas.reader import ScoredDataset, ScoredDocument

CONF = Path(__file__).resolve().parents[2] / "conf" / "inspect"


def scored_folder(folder: Path, name: str, tokenizer, texts: dict[str, str], seed: int) -> Path:
    """``texts`` (doc_id -> text) tokenized by ``tokenizer``, random losses (first one NaN), written
    by the stage-1 writer in two shards."""
    rng = np.random.default_rng(seed)
    ids = list(texts)
    encodings = encode_batch(tokenizer, [texts[d] for d in ids])
    docs = []
    for d, enc in zip(ids, encodings):
        losses = rng.gamma(2.0, 1.0, len(enc)).astype(np.float32)
        losses[:1] = np.nan
        docs.append(ScoredDocument(d, texts[d], enc.ids, enc.starts, enc.ends, losses))
    identity = {"teacher": {"name": name}, "corpus": {"name": "c"}}
    folder.mkdir(parents=True)
    half = len(docs) // 2
    done = {i: write_shard(folder, i, ShardResult(documents=part), identity, {"index": i}, "t")
            for i, part in enumerate((docs[:half], docs[half:]))}
    write_manifest(folder, identity, done, 2, "t")
    return folder


@pytest.fixture(scope="module")
def teachers(micro_corpus, real_tokenizer, tmp_path_factory) -> tuple[Path, Path]:
    from pipeline.embedded.sample_corpus import clean_texts

    texts = {f"d:{k}": t for k, t in enumerate(clean_texts(micro_corpus)[:24])}
    only_a = {**texts, "only-a": "Only the first teacher scored this: 1 + 1 = 2."}
    changed = {**texts, "d:3": texts["d:3"] + " (edited)"}
    root = tmp_path_factory.mktemp("two-teachers")
    return (scored_folder(root / "qwen", "qwen", real_tokenizer("qwen2"), only_a, 1),
            scored_folder(root / "mistral", "mistral", real_tokenizer("mistral"), changed, 2))


def loop_alignment(student_enc, record) -> list[float]:
    out = []
    for c, d in zip(student_enc.starts.tolist(), student_enc.ends.tolist()):
        hit = [float(l) for a, b, l in zip(record.starts.tolist(), record.ends.tolist(), record.losses.tolist())
               if a < d and b > c and b > a and not math.isnan(l)]
        out.append(max(hit) if d > c and hit else math.nan)
    return out


def brute_force(first: Path, second: Path, student, ratio: float) -> dict:
    a = {r.doc_id: r for r in ScoredDataset.open(first).iter_documents()}
    b = {r.doc_id: r for r in ScoredDataset.open(second).iter_documents()}
    pairs = []
    for d in a:
        if d in b and a[d].text == b[d].text:
            enc = encode_batch(student, [a[d].text])[0]
            pairs += [(x, y) for x, y in zip(loop_alignment(enc, a[d]), loop_alignment(enc, b[d]))
                      if not math.isnan(x) and not math.isnan(y)]
    n = len(pairs)
    xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
    mx, my = sum(xs) / n, sum(ys) / n
    cov = sum((x - mx) * (y - my) for x, y in pairs)
    r = cov / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))
    k = math.ceil(ratio * n - 1e-6)
    pick_a = set(sorted(range(n), key=lambda i: (xs[i], i))[:k])
    pick_b = set(sorted(range(n), key=lambda i: (ys[i], i))[:k])
    return {"n": n, "pearson": r, "k": k, "disagree": len(pick_a ^ pick_b),
            "jaccard": len(pick_a & pick_b) / len(pick_a | pick_b)}


def test_two_teacher_report_matches_brute_force(teachers, real_tokenizer):
    first, second = teachers
    student = real_tokenizer("llama-spm")
    report = two_teachers(ScoredDataset.open(first), ScoredDataset.open(second), student, student="llama", ratio=0.4)
    want = brute_force(first, second, student, 0.4)
    assert report.documents == {"shared_ids": 24, "only_first": 1, "only_second": 0, "examined": 24, "text_differs": 1}
    assert report.mapped["both"] == want["n"] > 500
    assert report.pearson == pytest.approx(want["pearson"], abs=1e-9)
    assert (report.k, report.disagree) == (want["k"], want["disagree"])
    assert report.disagree_share == pytest.approx(want["disagree"] / want["n"])
    assert report.selection_jaccard == pytest.approx(want["jaccard"])
    assert 0 < report.disagree_share < 1 and abs(report.pearson) < 0.5  # independent random losses


def test_a_teacher_against_itself_agrees_completely(teachers, real_tokenizer):
    first, _ = teachers
    ds = ScoredDataset.open(first)
    report = two_teachers(ds, ds, real_tokenizer("llama-spm"))
    assert report.pearson == pytest.approx(1.0) and report.spearman == pytest.approx(1.0)
    assert report.disagree == 0 and report.selection_jaccard == 1.0


def test_make_inspect_two_teachers_prints_and_writes(teachers, shared_tokenizers, tmp_path):
    first, second = teachers
    student = shared_tokenizers / "ggml-vocab-llama-spm.gguf"
    console = Console(record=True, width=160, soft_wrap=True)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("inspect", overrides=["progress=false", "command=two-teachers", f"path={first}",
                                            f"other={second}", f"student={student}", f"out_dir={tmp_path}"])
        missing = compose("inspect", overrides=["command=two-teachers", f"path={first}"])
    assert run(cfg, console) == 0
    text = console.export_text()
    saved = json.loads(next((tmp_path / "two-teachers").glob("*.json")).read_text())
    assert f"{saved['pearson']:.4f}" in text and "tokens exactly one teacher selects" in text
    assert saved["documents"]["text_differs"] == 1
    with pytest.raises(ConfigError, match=r"student: command=two-teachers needs(.|\n)*other: command=two-teachers needs"):
        run(missing, console)
