"""The wsd schedule, ``train.continue_from`` and ``train.eval_every``, end to end on CPU: the real HF
Trainer, the tiny real student and the micro scored dataset.

The continuation's reference is an uninterrupted run of the full length, trained here; the
schedule's is the warm-up / stable / cosine-decay formula worked out in the test; the evaluation's
is the saved model's own loss over the held-out documents (read from the shard file with pyarrow),
one unpadded block per forward pass. Through the command: a run's final ``train_loss`` against the
mean of the per-step losses in its metrics.jsonl, a rerun of a finished run against the sha256 and
modification time of every file it holds, and the warning for a weight missing from a checkpoint."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import pipeline.train_student.run as run_module
from pipeline.runtime.config import ConfigError, MissingPathError
from pipeline.student_data.dataset import collate_packed
from pipeline.train_student.checkpoints import RunMismatchError
from pipeline.train_student.config import TrainJobConfig, validate
from pipeline.train_student.run import run_training
from storage_schemas import file_sha256
from tests.train_student.test_train_student import make_job, metrics

LR, MIN_LR, WARMUP = 3e-3, 3e-4, 1


def wsd_job(student, scored, out: Path, steps: int, decay: int = 2, **changes) -> TrainJobConfig:
    """2 sequences x 2 micro-batches per step; warm-up 1, then stable, then ``decay`` steps of decay."""
    return make_job(student, scored, out, steps, micro_batch_size=2, lr_scheduler="wsd", lr_decay_steps=decay,
                    **changes)


def wsd_rate(step: int, steps: int, decay: int) -> float:
    """The learning rate optimizer step ``step`` (1-based) runs at, worked out from the definition:
    linear warm-up from the minimum, stable at the peak, then a half cosine down towards the minimum
    over the last ``decay`` steps (the step count the schedule sees is ``step - 1``)."""
    s, r = step - 1, MIN_LR / LR
    if s < WARMUP:
        return LR * (r + (1 - r) * s / WARMUP)
    if s < steps - decay:
        return LR
    progress = (s - (steps - decay)) / decay
    return LR * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress)))


class SampleLog:
    """Wraps the collator: the packed sample indices of every batch the trainer draws, in order (the
    data loader runs in this process, ``data.num_workers=0``)."""

    def __init__(self, collate):
        self.collate, self.batches = collate, []

    def __call__(self, samples):
        batch = self.collate(samples)
        self.batches.append(batch["sample_index"].tolist())
        return batch


def train_logging_samples(job, monkeypatch) -> list[list[int]]:
    log = SampleLog(collate_packed)
    monkeypatch.setattr(run_module, "collate_packed", log)
    run_training(job)
    return log.batches


def per_step(records: list[dict], keys: tuple[str, ...]) -> list[dict]:
    return [{k: r[k] for k in keys} for r in records]


def test_wsd_schedule_and_its_stable_checkpoint(tiny_student, micro_scored, tmp_path):
    job = wsd_job(tiny_student, micro_scored, tmp_path / "run", steps=6, decay=2, save_steps=4, save_total_limit=1)
    run_training(job)
    records = metrics(Path(job.output_dir))
    assert [r["learning_rate"] for r in records] == pytest.approx([wsd_rate(s, 6, 2) for s in range(1, 7)], rel=1e-9)
    assert [r["learning_rate"] for r in records][1:5] == [LR] * 4 and records[-1]["learning_rate"] < LR
    run = Path(job.output_dir)
    # the stable phase ends after step 4; the Trainer's rotation (save_total_limit=1) removed
    # checkpoint-4 once checkpoint-6 was saved, the kept copy stays
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-6"]
    state = json.loads((run / "stable" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and (run / "stable" / "checkpoint_complete.json").is_file()
    assert (run / "stable" / "optimizer.pt").is_file() and (run / "stable" / "scheduler.pt").is_file()
    # a cosine run keeps none, and its recipe reads as before wsd existed
    cosine = make_job(tiny_student, micro_scored, tmp_path / "cosine", 2)
    assert not {"lr_scheduler", "lr_decay_share", "lr_decay_steps", "continue_from"} & set(cosine.recipe()["train"])


def test_stable_checkpoint_missed_by_a_kill_is_kept_on_resume_and_overwrite_removes_it(tiny_student, micro_scored,
                                                                                        tmp_path):
    """A run killed after the stable step's checkpoint was saved but before its copy (played by
    removing ``stable/`` after a crash at step 3) makes the copy when it resumes; ``overwrite=true``
    removes it with the checkpoints."""
    from tests.train_student.test_train_student import CrashAt

    job = wsd_job(tiny_student, micro_scored, tmp_path / "run", steps=4)
    with pytest.raises(KeyboardInterrupt):
        run_training(job, callbacks=[CrashAt(3)])
    run = Path(job.output_dir)
    shutil.rmtree(run / "stable")
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]
    assert run_training(job).resumed_from.endswith("checkpoint-2")
    assert json.loads((run / "stable" / "trainer_state.json").read_text())["global_step"] == 2
    run_training(replace(job, overwrite=True, train=replace(job.train, lr_scheduler="cosine")))
    assert not (run / "stable").exists(), "a cosine run started afresh in the folder keeps no stable checkpoint"


def test_a_continuation_equals_one_longer_run(tiny_student, micro_scored, tmp_path, monkeypatch):
    """Run A (4 steps, stable phase to step 2), then its continuation B to 6 steps under another
    name, against one straight run S of 6 steps: the same samples in the same order, the same
    learning rate at every step, the same losses."""
    straight = wsd_job(tiny_student, micro_scored, tmp_path / "S", steps=6)
    s_batches = train_logging_samples(straight, monkeypatch)
    first = wsd_job(tiny_student, micro_scored, tmp_path / "A", steps=4)
    a_batches = train_logging_samples(first, monkeypatch)
    longer = replace(wsd_job(tiny_student, micro_scored, tmp_path / "B", steps=6),
                     train=replace(straight.train, continue_from=first.output_dir))
    b_batches = train_logging_samples(longer, monkeypatch)

    # samples: A drew 2 micro-batches per step for 4 steps; B starts after A's step 2 (its stable
    # checkpoint) and draws the rest; together they are S's, in S's order
    assert len(s_batches) == 12 and len(a_batches) == 8 and len(b_batches) == 8
    assert a_batches[:4] + b_batches == s_batches
    assert [i for b in s_batches for i in b] == list(range(24))  # the packed order, each sample once

    keys = ("step", "learning_rate", "sample_first", "sample_last")
    s, a, b = (metrics(Path(j.output_dir)) for j in (straight, first, longer))
    assert per_step(b, keys) == per_step(s, keys)  # B's folder reads as one run from step 1
    assert [r["learning_rate"] for r in s] == pytest.approx([wsd_rate(i, 6, 2) for i in range(1, 7)], rel=1e-9)
    assert a[3]["learning_rate"] < s[3]["learning_rate"], "A decays at step 4; the longer run does not"
    for key in ("loss", "loss_kept", "loss_all", "grad_norm"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in s], rel=1e-5, abs=1e-7), key
    assert json.loads((Path(longer.output_dir) / "continued_from.json").read_text())["step"] == 2

    # B keeps its own stable checkpoint (step 4) and can be continued in turn; rerunning B resumes it
    again = run_training(longer)
    assert again.tokens_trained == 0 and again.steps == 6
    assert json.loads((Path(longer.output_dir) / "stable" / "trainer_state.json").read_text())["global_step"] == 4


def test_continuations_that_would_not_equal_one_run_are_refused(tiny_student, micro_scored, tmp_path):
    first = wsd_job(tiny_student, micro_scored, tmp_path / "A", steps=4)
    run_training(first)
    before = {p.name: file_sha256(p) for p in Path(first.output_dir).rglob("*") if p.is_file()}

    def continuation(name: str, steps: int = 6, **train):
        job = wsd_job(tiny_student, micro_scored, tmp_path / name, steps=steps)
        return replace(job, train=replace(job.train, continue_from=first.output_dir, **train))

    with pytest.raises(RunMismatchError, match=r"settings differ .*\n  recipe loss.ratio: 0.4 != 0.3") as differ:
        run_training(replace(continuation("ratio"), selection=replace(first.selection, ratio=0.3)))
    assert "recipe train.max_steps" not in str(differ.value), "the length may change"
    changed = continuation("lr", learning_rate=1e-3)
    with pytest.raises(RunMismatchError, match=r"recipe train.learning_rate: 0.003 != 0.001"):
        run_training(changed)
    with pytest.raises(RunMismatchError, match=r"data packing.seed: 0 != 5"):
        run_training(replace(continuation("seed"), data=replace(first.data, seed=5)))
    with pytest.raises(RunMismatchError, match=r"would start its decay after step 1, before the step 2 .* "
                                               r"train.max_steps=4 or more"):
        run_training(continuation("short", steps=3))
    # a decay of another length is allowed where the stable phase still reaches step 2
    assert run_training(continuation("other-decay", steps=5, lr_decay_steps=3)).steps == 5

    cosine = make_job(tiny_student, micro_scored, tmp_path / "cosine", 2)
    run_training(cosine)
    with pytest.raises(RunMismatchError, match=r"cannot continue .*cosine: it was trained with the cosine schedule; "
                                               r"the cosine schedule's learning rate at every step depends"):
        run_training(replace(continuation("of-cosine"), train=replace(continuation("x").train,
                                                                       continue_from=cosine.output_dir)))
    no_stable = tmp_path / "no-stable"
    no_stable.mkdir()
    (no_stable / "run.json").write_text((Path(first.output_dir) / "run.json").read_text())
    with pytest.raises(RunMismatchError, match=r"no complete stable/ checkpoint .* Resume it first"):
        run_training(replace(continuation("y"), train=replace(continuation("y").train, continue_from=str(no_stable))))
    with pytest.raises(MissingPathError, match=r"is not a train-student run folder \(no run.json\)"):
        run_training(replace(continuation("z"), train=replace(continuation("z").train, continue_from=str(tmp_path))))

    after = {p.name: file_sha256(p) for p in Path(first.output_dir).rglob("*") if p.is_file()}
    assert after == before, "the source run is never written"
    # the finished run, asked for more steps, names the way on
    with pytest.raises(RunMismatchError, match=rf"continue it as a new run: train.continue_from={first.output_dir} "
                                               r"run_name=<a new name> train.max_steps=6 "):
        run_training(replace(first, train=replace(first.train, max_steps=6)))


def test_settings_that_cannot_continue_are_refused_up_front(tiny_student, micro_scored, tmp_path):
    job = make_job(tiny_student, micro_scored, tmp_path / "run", 4)
    cosine = replace(job, train=replace(job.train, continue_from=str(tmp_path)))
    assert any(p.startswith("train.continue_from: a continuation follows the wsd schedule") for p in validate(cosine))
    no_text = replace(job, train=replace(job.train, eval_every=2))
    assert any(p.startswith("train.eval_every: no held-out text") for p in validate(no_text))
    whole = wsd_job(tiny_student, micro_scored, tmp_path / "whole", steps=3, decay=3)
    with pytest.raises(ConfigError, match="a decay of 3 steps leaves nothing before it in a run of 3 steps"):
        run_training(whole)
    # a warm-up longer than the run before its decay is a ramp, as with cosine; the kept checkpoint
    # (step 1) lies in the warm-up, whose rates do not depend on the length either
    ramp = wsd_job(tiny_student, micro_scored, tmp_path / "ramp", steps=3, decay=2, warmup_steps=20)
    run_training(ramp)
    assert [r["learning_rate"] for r in metrics(Path(ramp.output_dir))] == pytest.approx(
        [LR * (0.1 + 0.9 * s / 20) for s in range(3)], rel=1e-9)
    assert json.loads((Path(ramp.output_dir) / "stable" / "trainer_state.json").read_text())["global_step"] == 1


def test_held_out_bits_per_byte_while_training(tiny_student, micro_scored, tmp_path):
    """``train.eval_every=2`` with one shard held out: ``eval_bits_per_byte`` at steps 2 and 4, the
    last equal to a token-by-token computation with the saved model on the same documents; the
    training itself is the same as without the evaluation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = make_job(tiny_student, micro_scored, tmp_path / "plain", 4)
    plain = replace(plain, data=replace(plain.data, held_out_shards=1))
    run_training(plain)
    evaluated = replace(plain, output_dir=str(tmp_path / "eval"),
                        train=replace(plain.train, eval_every=2, eval_max_documents=6, eval_batch_size=4,
                                      report_to=["tensorboard"]))
    run_training(evaluated)
    lines = [json.loads(x) for x in (Path(evaluated.output_dir) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "eval_bits_per_byte" in r]
    assert [r["step"] for r in evals] == [2, 4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(next((Path(evaluated.output_dir) / "runs").rglob("events.out.tfevents.*")).parent))
    board.Reload()
    scalars = board.Scalars("eval/bits_per_byte")
    assert [e.step for e in scalars] == [2, 4]
    assert [e.value for e in scalars] == pytest.approx([r["eval_bits_per_byte"] for r in evals], rel=1e-6)  # float32
    keys = ("step", "loss", "loss_kept", "learning_rate", "grad_norm", "sample_first", "sample_last")
    assert per_step(metrics(Path(evaluated.output_dir)), keys) == per_step(metrics(Path(plain.output_dir)), keys)

    held = sorted(Path(micro_scored).glob("shard-*.parquet"))[-1]  # the last planned shard
    texts = [t for t in pq.read_table(held, columns=["text"]).column("text").to_pylist() if t][:6]
    model = AutoModelForCausalLM.from_pretrained(Path(evaluated.output_dir) / "final", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(Path(evaluated.output_dir) / "final")
    nats, n_tokens = by_blocks(model, tokenizer, texts, window=model.config.max_position_embeddings - 1)
    want = nats / math.log(2) / sum(len(t.encode("utf-8")) for t in texts)
    assert evals[-1]["eval_bits_per_byte"] == pytest.approx(want, rel=1e-5)
    assert evals[-1]["eval_nats_per_token"] == pytest.approx(nats / n_tokens, rel=1e-5)
    assert evals[0]["eval_bits_per_byte"] != evals[-1]["eval_bits_per_byte"]


def by_blocks(model, tokenizer, texts: list[str], window: int) -> tuple[float, int]:
    """Summed next-token loss (nats) and tokens of ``texts``: each text after BOS, cut into blocks of
    ``window`` predictions that start with the previous block's last token, one unpadded block per
    forward pass, the loss the model's own (``labels=``, a mean over the block's predictions)."""
    import torch

    nats, n_tokens = 0.0, 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        seq, n_tokens = [tokenizer.bos_token_id, *ids], n_tokens + len(ids)
        for start in range(0, len(seq) - 1, window):
            block = torch.tensor([seq[start: start + window + 1]])
            with torch.no_grad():
                nats += model(input_ids=block, labels=block).loss.item() * (block.shape[1] - 1)
    return nats, n_tokens


# ---- through the command: the whole run's train_loss, a rerun of a finished run, tied weights ---------


def train_stage(student: Path, scored: Path, run: Path, steps: int, *args: str) -> subprocess.CompletedProcess:
    """``python -m stages.train_student``: the tiny student, 2 sequences per step, wsd with 2 decay steps."""
    return subprocess.run(
        [sys.executable, "-m", "stages.train_student", "student.embedded=false", f"student.model={student}",
         "student.seq_len=32", f"data.folders=[{scored}]", f"data.cache_dir={run.parent}/lengths", "data.num_workers=0",
         "data.held_out_shards=0", "train.eval_every=null", "train.micro_batch_size=2",
         "train.gradient_accumulation_steps=1", f"train.max_steps={steps}", "train.logging_steps=1", "train.save_steps=2",
         "train.warmup_steps=1", "train.lr_scheduler=wsd", "train.lr_decay_steps=2", "train.use_cpu=true",
         "train.report_to=[]", "train.cpu_threads=1", "train.progress=false", f"output_dir={run}",
         f"hydra.run.dir={run.parent}/logs", *args],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)


def finished(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def wsd_runs(tiny_student, micro_scored, tmp_path_factory) -> dict:
    """Through the command: S, 6 steps straight; A, 4 steps; B, A continued to 6 steps (each result and folder)."""
    root = tmp_path_factory.mktemp("wsd-runs")
    runs = {"S": finished(train_stage(tiny_student, micro_scored, root / "S", 6)),
            "A": finished(train_stage(tiny_student, micro_scored, root / "A", 4))}
    runs["B"] = finished(train_stage(tiny_student, micro_scored, root / "B", 6, f"train.continue_from={root / 'A'}"))
    return {"root": root, **runs}


def whole_run_mean(run: Path) -> tuple[float, int]:
    """The reference: the mean of the per-step losses metrics.jsonl logs (one line per step), and their number."""
    losses = [r["loss"] for r in metrics(run)]
    return sum(losses) / len(losses), len(losses)


def test_train_loss_is_the_whole_runs_mean_after_a_resume_and_a_continuation(tiny_student, micro_scored, wsd_runs):
    """An uninterrupted 6-step run, the same run killed after checkpoint-4 and resumed (played by
    removing what the run wrote after that checkpoint), and a 4-step run continued to 6 steps:
    each reports as train_loss (its last log line, summary.json, the printed summary) the mean of
    the 6 per-step losses its metrics.jsonl holds, and the three agree."""
    root = wsd_runs["root"]
    resumed = root / "R"
    shutil.copytree(root / "S", resumed)
    for name in ("checkpoint-6", "final"):
        shutil.rmtree(resumed / name)
    (resumed / "summary.json").unlink()
    r = finished(train_stage(tiny_student, micro_scored, resumed, 6))
    assert "resumed from checkpoint-4" in r.stdout
    reported = {}
    for name, result in (("S", wsd_runs["S"]), ("R", r), ("B", wsd_runs["B"])):
        run = root / name
        mean, steps = whole_run_mean(run)
        last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
        summary = json.loads((run / "summary.json").read_text())
        assert steps == 6 and last["train_loss"] == pytest.approx(mean, rel=1e-6), name
        assert summary["train_loss"] == last["train_loss"], name
        assert f"train_loss {mean:.4g}, the mean over all 6" in result.stdout, name
        reported[name] = summary["train_loss"]
    assert reported["R"] == pytest.approx(reported["S"], rel=1e-5)
    assert reported["B"] == pytest.approx(reported["S"], rel=1e-5)
    # the continuation's own steps (3 to 6) alone would give another mean: the test tells them apart
    own = [rec["loss"] for rec in metrics(root / "B")][2:]
    assert abs(sum(own) / len(own) - reported["B"]) > 1e-3


def test_a_rerun_of_a_finished_run_changes_nothing_and_says_so(tiny_student, micro_scored, wsd_runs):
    """The same command again after the run's end: every file under the run folder keeps its bytes
    and its modification time, and the command says in one line that the run is already complete."""
    run = wsd_runs["root"] / "S"

    def files() -> dict:
        return {str(p.relative_to(run)): (file_sha256(p), p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))
                if p.is_file()}

    before = files()
    assert "summary.json" in before and "final/model.safetensors" in before
    again = finished(train_stage(tiny_student, micro_scored, run, 6))
    assert files() == before
    said = [line for line in again.stdout.splitlines() if "][INFO]" not in line]  # the log's lines aside
    assert said == [f"train-student: {run} is already complete (6 steps, its final model in {run / 'final'}); nothing "
                    "was trained or written (overwrite=true trains it again)"]


def test_a_tied_weight_missing_from_a_checkpoint_is_silent_another_is_named(tiny_student, micro_scored, wsd_runs):
    """The student ties its output layer to its embeddings: checkpoints hold no ``lm_head.weight``,
    and loading one (a resume, a continuation) says nothing of it. A checkpoint that lacks a weight
    the model does not tie (``model.norm.weight``, removed here from a copy of A's stable/) is named."""
    from safetensors.torch import load_file, save_file

    root = wsd_runs["root"]
    stable = load_file(root / "A" / "stable" / "model.safetensors")
    assert "lm_head.weight" not in stable and "model.norm.weight" in stable  # tied: never saved
    for result in (wsd_runs["B"], wsd_runs["S"]):
        assert "missing keys" not in result.stderr and "lm_head" not in result.stderr
    damaged = root / "A-damaged"
    shutil.copytree(root / "A", damaged)
    del stable["model.norm.weight"]
    save_file(stable, damaged / "stable" / "model.safetensors", metadata={"format": "pt"})
    c = finished(train_stage(tiny_student, micro_scored, root / "C", 6, f"train.continue_from={damaged}"))
    warned = [line for line in c.stderr.splitlines() if "missing keys" in line]
    assert warned == ["[transformers] There were missing keys in the checkpoint model loaded: ['model.norm.weight']."]
