"""``data.mixture``: several corpora drawn into one stream at set weights (pipeline/train_student/mixture.py).

The corpora here are written by the stage-1 writer (no Ray) with one teacher identity and teacher
losses in disjoint ranges (corpus ``math`` within [0.5, 1.5], ``web`` within [4.5, 5.5], ``extra``
within [8.5, 9.5]), so the corpus of any sample can be told from its teacher losses alone: the
independent count the realised proportions are checked against. The order is checked against a
loop written from the rule's description (docs/configuration.md, "Data mixtures").
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from pipeline.runtime.config import ConfigError
from pipeline.score_teacher.teacher import ShardResult
from pipeline.score_teacher.writer import write_manifest, write_shard
from pipeline.method.tokenization import encode_batch, load_tokenizer
from pipeline.train_student.mixture import BLOCK, TAG, MixtureOrder
from pipeline.train_student.checkpoints import RunMismatchError
from pipeline.train_student.config import DataConfig, MixtureCorpus, StudentConfig, TrainConfig, TrainJobConfig
from pipeline.train_student.data import prepare_data
from pipeline.train_student.run import run_training
from stages.train_student import print_summary
from storage_schemas.reader import ScoredDocument
from test_train_student import CrashAt, metrics

REPO = Path(__file__).resolve().parents[2]
LOSS_RANGES = {"math": 1.0, "web": 5.0, "extra": 9.0}  # centre of each corpus's teacher losses (+- 0.5)


def scored_corpus(folder: Path, tokenizer, texts: list[str], centre: float, teacher: str = "t",
                  per_shard: int = 8) -> Path:
    """``texts`` scored by a stand-in teacher (the student's own spans) with losses in ``centre +- 0.5``."""
    rng = np.random.default_rng(int(centre * 10))
    encodings = encode_batch(tokenizer, texts)
    docs = [ScoredDocument(f"{folder.name}.parquet:{i}", t, e.ids, e.starts, e.ends,
                           rng.uniform(centre - 0.5, centre + 0.5, len(e)).astype(np.float32))
            for i, (t, e) in enumerate(zip(texts, encodings))]
    n_shards = -(-len(docs) // per_shard)
    identity = {"teacher": {"name": teacher}, "corpus": {"name": folder.name, "n_shards": n_shards}}
    folder.mkdir(parents=True)
    done = {i: write_shard(folder, i, ShardResult(documents=docs[i * per_shard:(i + 1) * per_shard]), identity,
                           {"index": i}, "t") for i in range(n_shards)}
    write_manifest(folder, identity, done, n_shards, "t")
    return folder


@pytest.fixture(scope="module")
def corpora(tiny_student, tmp_path_factory) -> dict[str, Path]:
    """Three corpora of different pages: math (48 documents), web (24), extra (8; scored by another teacher too)."""
    from pipeline.embedded.sample_corpus import generate_documents

    tok = load_tokenizer(str(tiny_student))
    texts = [d["text"] for d in generate_documents(120, seed=7) if d["text"] and d["text"].strip()]
    root = tmp_path_factory.mktemp("mixture")
    return {"math": scored_corpus(root / "math", tok, texts[:48], LOSS_RANGES["math"]),
            "web": scored_corpus(root / "web", tok, texts[48:72], LOSS_RANGES["web"]),
            "extra": scored_corpus(root / "extra", tok, texts[72:80], LOSS_RANGES["extra"]),
            "other-teacher": scored_corpus(root / "other-teacher", tok, texts[48:72], LOSS_RANGES["web"], teacher="u")}


def make_job(student: Path, out: Path, mixture: list[MixtureCorpus], steps: int | None = 6, workers: int = 0,
             **data) -> TrainJobConfig:
    return TrainJobConfig(
        student=StudentConfig(name="t", model=str(student), seq_len=32),
        data=DataConfig(folders=[], mixture=mixture, num_workers=workers, cache_dir=str(out.parent / "lengths"), **data),
        train=TrainConfig(micro_batch_size=4, gradient_accumulation_steps=2, max_steps=steps, learning_rate=3e-3,
                          min_learning_rate=3e-4, warmup_steps=1, logging_steps=1, save_steps=2, report_to=[],
                          progress=False, use_cpu=True, cpu_threads=1),
        output_dir=str(out))


def corpus_of(sample) -> str:
    """The corpus a sample comes from, told by its teacher losses alone."""
    losses = sample["teacher_loss"].numpy()
    centre = float(np.nanmean(losses))
    name = min(LOSS_RANGES, key=lambda n: abs(LOSS_RANGES[n] - centre))
    assert np.nanmax(np.abs(losses - LOSS_RANGES[name])) <= 0.5 + 1e-2, "one corpus per sample"
    return name


# --------------------------------------------------------------------------------------------
# The order, against a loop over the rule's description


def reference_order(weights: list[float], seed: int, n: int, block: int) -> tuple[list[int], list[int]]:
    """(corpus, sample within it) of each of the first ``n`` samples, one sample at a time: the next
    sample goes to the corpus with the smallest (given + 1/2) / share (ties: the first listed); each
    block of ``block`` samples keeps its counts, its labels sorted by corpus and then placed by
    ``default_rng([seed, TAG, block]).permutation(block)``."""
    shares = [w / sum(weights) for w in weights]
    given, sequence = [0] * len(weights), []
    n_blocks = -(-n // block)
    for _ in range(n_blocks * block):
        c = min(range(len(weights)), key=lambda i: ((given[i] + 0.5) / shares[i], i))
        sequence.append(c)
        given[c] += 1
    corpus = []
    for b in range(n_blocks):
        labels = sorted(sequence[b * block:(b + 1) * block])
        corpus += [labels[i] for i in np.random.default_rng([seed, TAG, b]).permutation(block)]
    within, seen = [], [0] * len(weights)
    for c in corpus:
        within.append(seen[c])
        seen[c] += 1
    return corpus[:n], within[:n]


@pytest.mark.parametrize("weights,block", [([3, 1], 16), ([0.5, 0.3, 0.2], 10), ([1, 1], 7), ([0.9, 0.07, 0.03], 32)])
def test_the_order_follows_the_rule_sample_by_sample(weights, block):
    n = 7 * block + 3
    order = MixtureOrder(weights, seed=11, block=block)
    corpus, within = order.locate(range(n))
    expected_corpus, expected_within = reference_order(weights, 11, n, block)
    assert corpus.tolist() == expected_corpus and within.tolist() == expected_within
    # the same answers asked out of order, a few at a time, from a fresh (unpickled) order
    import pickle
    again = pickle.loads(pickle.dumps(order))
    for k in np.random.default_rng(0).permutation(n)[:40]:
        c, j = again.locate([k])
        assert (c[0], j[0]) == (expected_corpus[k], expected_within[k])
    # every block boundary holds each corpus's share to within one sample
    shares = np.asarray(weights) / sum(weights)
    for b in range(8):
        assert np.abs(order.counts(b * block) - b * block * shares).max() < 1
    # another seed places the samples of a block elsewhere, with the same counts
    other, _ = MixtureOrder(weights, seed=12, block=block).locate(range(n))
    assert other.tolist() != corpus.tolist()
    assert np.bincount(other[:7 * block]).tolist() == np.bincount(corpus[:7 * block]).tolist()


def test_the_order_by_hand():
    """Weights 3:1, blocks of 4: keys of math 2/3, 2, 10/3, 14/3, ...; of web 2, 6, ...: math, math,
    web (ties to math, listed first), math; every block of 4 holds 3 math and 1 web."""
    order = MixtureOrder([3, 1], seed=0, block=4)
    assert order.bounds(3).tolist() == [[0, 0], [3, 1], [6, 2], [9, 3]]
    first = order.block_labels(0)
    assert sorted(first.tolist()) == [0, 0, 0, 1]
    assert first.tolist() == [[0, 0, 0, 1][i] for i in np.random.default_rng([0, TAG, 0]).permutation(4)]
    # equal weights tie at every key: the corpus listed first goes first, so an odd block holds one more of it
    assert MixtureOrder([1, 1], seed=0, block=5).bounds(2).tolist() == [[0, 0], [3, 2], [5, 5]]
    # the first web sample past 2 available: web gives its 3rd sample in block 2
    web_third = 8 + int(np.nonzero(order.block_labels(2) == 1)[0][0])
    assert order.length([100, 2]) == web_third


def test_the_default_block_keeps_the_shares_of_a_long_stream():
    order = MixtureOrder([0.7, 0.2, 0.1], seed=0)
    n = 40 * BLOCK
    counts = order.counts(n)
    assert counts.sum() == n and np.abs(counts - n * np.array([0.7, 0.2, 0.1])).max() < 1
    corpus, _ = order.locate(range(n))
    assert np.bincount(corpus).tolist() == counts.tolist()


# --------------------------------------------------------------------------------------------
# The data


def test_samples_are_each_corpus_read_in_its_own_order(tiny_student, corpora, tmp_path):
    """Every sample of the mixture is the next unread sample of one corpus's own stream (the stream
    a run of that corpus alone trains on), and the corpora give samples in proportion to their weights."""
    tok = load_tokenizer(str(tiny_student))
    mixture = [MixtureCorpus("math", 3.0, folders=[str(corpora["math"])]),
               MixtureCorpus("web", 1.0, folders=[str(corpora["web"])])]
    data = prepare_data(make_job(tiny_student, tmp_path / "run", mixture), tok)
    alone = {c.name: prepare_data(replace(make_job(tiny_student, tmp_path / c.name, None),
                                          data=DataConfig(folders=c.folders, num_workers=0)), tok).dataset
             for c in mixture}
    n = len(data.dataset)
    assert n > 3 * BLOCK
    seen, names = {"math": 0, "web": 0}, []
    for k in range(n):
        sample = data.dataset[k]
        name = corpus_of(sample)
        expected = alone[name][seen[name]]
        assert sample["input_ids"].tolist() == expected["input_ids"].tolist(), (k, name)
        assert int(sample["sample_index"]) == k and int(sample["corpus"]) == ["math", "web"].index(name)
        seen[name] += 1
        names.append(name)
    # every block boundary holds 3/4 math, 1/4 web, to within one sample
    for end in range(BLOCK, n + 1, BLOCK):
        assert abs(names[:end].count("web") - end / 4) < 1, end
    # the stream ends where the first corpus runs out: its next sample would be one past its end
    ran_out = [name for name in seen if seen[name] == len(alone[name])]
    assert ran_out and corpus_of_next(data.dataset.order, n, ["math", "web"]) in ran_out
    summary = data.summary()
    assert [(m["name"], m["samples"]) for m in summary["mixture"]] == [("math", seen["math"]), ("web", seen["web"])]
    assert [m["share"] for m in summary["mixture"]] == [seen["math"] / n, seen["web"] / n]


def corpus_of_next(order, k: int, names: list[str]) -> str:
    return names[int(order.locate([k])[0][0])]


# --------------------------------------------------------------------------------------------
# Training


def two_corpora(corpora, web_weight: float = 1.0) -> list[MixtureCorpus]:
    return [MixtureCorpus("math", 3.0, folders=[str(corpora["math"])]),
            MixtureCorpus("web", web_weight, folders=[str(corpora["web"])])]


def test_a_mixture_run_logs_the_realised_shares_and_resumes_exactly(tiny_student, corpora, tmp_path):
    """The logged ``mixture_share_<name>`` of every step equals the share counted from the step's
    samples by their teacher losses; a run killed after step 5 and resumed logs what an
    uninterrupted one does (samples, shares, losses); the summary gives the shares of the whole run."""
    straight = make_job(tiny_student, tmp_path / "straight", two_corpora(corpora), workers=1)  # a data-loader process
    summary = run_training(straight)
    records = metrics(Path(straight.output_dir))
    assert [r["step"] for r in records] == list(range(1, 7))

    data = prepare_data(straight, load_tokenizer(str(tiny_student)))
    names = [corpus_of(data.dataset[k]) for k in range(48)]  # 6 steps x 8 samples
    for r in records:
        drawn = names[int(r["sample_first"]):int(r["sample_last"]) + 1]
        assert len(drawn) == 8
        assert (r["mixture_share_math"], r["mixture_share_web"]) == (drawn.count("math") / 8, drawn.count("web") / 8)
    assert [(m["name"], m["share"], m["samples"]) for m in summary.data["mixture"]] == [
        ("math", names.count("math") / 48, names.count("math")), ("web", names.count("web") / 48, names.count("web"))]
    assert [m["weight"] for m in summary.data["mixture"]] == [0.75, 0.25]
    console = Console(width=400, record=True)
    print_summary(summary, console)
    assert f"math {names.count('math') / 48:.3f} of the samples (weight 0.750), {names.count('math')} samples" \
        in console.export_text()

    interrupted = replace(straight, output_dir=str(tmp_path / "interrupted"))
    with pytest.raises(KeyboardInterrupt):
        run_training(interrupted, callbacks=[CrashAt(5)])
    resumed = run_training(interrupted)
    assert resumed.resumed_from.endswith("checkpoint-4")
    keys = ("step", "loss", "loss_kept", "kept_fraction", "learning_rate", "grad_norm", "sample_first", "sample_last",
            "mixture_share_math", "mixture_share_web", "teacher_loss_kept")
    assert [{k: r[k] for k in keys} for r in metrics(Path(interrupted.output_dir))] == \
        [{k: r[k] for k in keys} for r in records]


def test_a_changed_weight_is_another_run(tiny_student, corpora, tmp_path):
    job = make_job(tiny_student, tmp_path / "run", two_corpora(corpora), steps=2)
    run_training(job)
    with pytest.raises(RunMismatchError) as refused:
        run_training(replace(job, data=replace(job.data, mixture=two_corpora(corpora, web_weight=2.0))))
    message = str(refused.value)
    assert "recipe data.mixture.corpora.web.weight: 1.0 != 2.0" in message
    assert "data mixture.corpora.web.weight: 1.0 != 2.0" in message  # the data identity records it too
    identity = json.loads((Path(job.output_dir) / "final" / "data_identity.json").read_text())["mixture"]
    assert [(c["name"], c["weight"], c["epochs"]) for c in identity["corpora"]] == [("math", 3.0, 1), ("web", 1.0, 1)]


def test_a_mixture_of_one_corpus_trains_the_run_of_that_corpus(tiny_student, corpora, tmp_path):
    mixed = make_job(tiny_student, tmp_path / "mixed", [MixtureCorpus("math", 1.0, folders=[str(corpora["math"])])],
                     steps=3)
    plain = replace(mixed, output_dir=str(tmp_path / "plain"),
                    data=replace(mixed.data, mixture=None, folders=[str(corpora["math"])]))
    run_training(mixed)
    run_training(plain)
    a, b = metrics(tmp_path / "mixed"), metrics(tmp_path / "plain")
    assert all(r.pop("mixture_share_math") == 1.0 for r in a)
    drop = ("time", "tokens_per_s", "train_runtime", "train_samples_per_second", "train_steps_per_second")
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == \
        [{k: v for k, v in r.items() if k not in drop} for r in b]


def test_a_corpus_that_runs_out_is_refused_with_the_passes_it_needs(tiny_student, corpora, tmp_path):
    """extra (8 documents) at an equal weight with math runs out first: the run is refused before
    training, naming it and the passes it needs; with that many passes (its own ``epochs``) the run
    trains, and extra's samples after its first pass are those of its second pass."""
    tok = load_tokenizer(str(tiny_student))
    mixture = [MixtureCorpus("math", 1.0, folders=[str(corpora["math"])]),
               MixtureCorpus("extra", 1.0, folders=[str(corpora["extra"])])]
    data = prepare_data(make_job(tiny_student, tmp_path / "probe", mixture), tok)
    one_pass = data.corpora[1].data.plan.n_samples
    steps = (2 * one_pass + 8) // 4 + 1  # extra gives half of 8 samples per step (+-1): more than 2 passes hold
    job = make_job(tiny_student, tmp_path / "run", mixture, steps=steps)
    with pytest.raises(ConfigError) as refused:
        run_training(job)
    message = str(refused.value)
    assert f"corpus extra (weight 1) would give" in message and f"it holds {one_pass:,} in 1 pass(es)" in message
    passes = int(message.split("data.mixture[1].epochs=")[1].split()[0])
    assert passes == 3 and "corpus math" not in message
    assert not Path(job.output_dir).exists(), "refused before anything is written"

    longer = replace(job, data=replace(job.data, mixture=[mixture[0], replace(mixture[1], epochs=passes)]))
    summary = run_training(longer)
    extra = next(m for m in summary.data["mixture"] if m["name"] == "extra")
    assert extra["samples"] > 2 * one_pass and extra["epochs"] == 3
    three = prepare_data(replace(longer, data=DataConfig(folders=mixture[1].folders, num_workers=0, epochs=3)), tok)
    data = prepare_data(longer, tok)
    given = [k for k in range(steps * 8) if corpus_of(data.dataset[k]) == "extra"]
    assert len(given) == extra["samples"]
    for j, k in enumerate(given):
        assert data.dataset[k]["input_ids"].tolist() == three.dataset[j]["input_ids"].tolist()


def test_corpora_scored_by_different_teachers_are_refused(tiny_student, corpora, tmp_path):
    mixture = [MixtureCorpus("math", 1.0, folders=[str(corpora["math"])]),
               MixtureCorpus("web", 1.0, folders=[str(corpora["other-teacher"])])]
    with pytest.raises(ConfigError, match="every corpus must be scored by the same teacher.*corpus math: t; corpus web: u"):
        run_training(make_job(tiny_student, tmp_path / "run", mixture))


# --------------------------------------------------------------------------------------------
# Configuration


def test_mixture_settings_are_checked_together(tmp_path):
    from test_train_student import compose

    from stages.train_student import job_config

    good = job_config(compose([f"data.mixture=[{{name:math,weight:3,folders:[{tmp_path}/a]}},"
                               f"{{name:web,weight:1,folders:[{tmp_path}/b],epochs:2}}]"]))
    assert [(c.name, c.weight, c.folders, c.epochs) for c in good.data.mixture] == [
        ("math", 3, [f"{tmp_path}/a"], None), ("web", 1, [f"{tmp_path}/b"], 2)]
    with pytest.raises(ConfigError) as err:
        job_config(compose(["data.mixture=[{name:'a b',weight:0,folders:[x],export:y},{name:c,wieght:1},"
                            "{name:c,weight:1,folders:[z],epochs:0}]", "data.export=e", "data.held_out_shards=1"]))
    problems = err.value.problems
    assert len(problems) == len(set(problems)), "each problem once"
    for expected in ("data.mixture[0].name: 'a b' must be letters", "data.mixture[0].weight: 0 must be a finite number",
                     "data.mixture[0].folders: give the corpus's scored folders or its export",
                     "data.mixture[1].wieght: unknown key; did you mean weight?", "data.mixture[1].weight: required",
                     "data.mixture[2].epochs: 0 must be >= 1"):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    # a job built in code is checked the same way before any work
    from pipeline.train_student.config import validate
    job = make_job(Path("s"), tmp_path / "run", [MixtureCorpus("a", 0.0, folders=["x"]), MixtureCorpus("a", 1.0)])
    assert validate(job) == [
        "data.mixture[0].weight: 0.0 must be a finite number > 0",
        "data.mixture[1].folders: give the corpus's scored folders or its export (data.mixture[...].export), one of them",
        "data.mixture: corpus name(s) a used twice; name each corpus once"]


def test_a_missing_corpus_folder_through_the_entry_point_is_one_line(tmp_path, corpora):
    result = subprocess.run(  # the default data.folders (the embedded scoring) do not exist here
        [sys.executable, "-m", "stages.train_student", f"hydra.run.dir={tmp_path}/logs", f"output_dir={tmp_path}/run",
         f"scored_root={tmp_path}/none", f"data.mixture=[{{name:math,weight:3,folders:[{corpora['math']}]}},{{name:web,weight:1,folders:[{tmp_path}/nowhere]}}]"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == (f"error: data.mixture[1].folders: scored dataset folder not found: {tmp_path}/nowhere "
                             "(score the corpus first: make score-teacher with the same teacher and data, or point "
                             "data.mixture[1].folders at a scored dataset)\n"), "the default data.folders are not read"
    assert not (tmp_path / "run").exists()


def test_a_mixture_run_is_filed_under_its_corpora_not_the_default_corpus(tiny_student, corpora, tmp_path):
    """Through ``python -m stages.train_student`` without ``output_dir``: the run folder is
    ``<student_root>/mixture-math+web/<run_name>`` (written out here by hand), nothing is filed under
    the default ``data.corpus`` (owm-sample)."""
    root = tmp_path / "students"
    result = subprocess.run(
        [sys.executable, "-m", "stages.train_student", f"hydra.run.dir={tmp_path}/logs", f"student_root={root}",
         "run_name=r", "student.embedded=false", f"student.model={tiny_student}", "student.seq_len=32",
         f"data.cache_dir={tmp_path}/lengths", "data.num_workers=0", "data.held_out_shards=0", "train.eval_every=null",
         "train.max_steps=2", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1", "train.warmup_steps=0",
         "train.use_cpu=true", "train.report_to=[]", "train.cpu_threads=1", "train.progress=false",
         f"data.mixture=[{{name:math,weight:3,folders:[{corpora['math']}]}},{{name:web,weight:1,folders:[{corpora['web']}]}}]"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("summary.json")) == ["mixture-math+web/r/summary.json"]
    assert f"{root}/mixture-math+web/r/final" in result.stdout
