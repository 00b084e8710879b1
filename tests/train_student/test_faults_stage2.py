"""Stage 2 under faults: the training process SIGKILLed at random moments and rerun, a checkpoint
cut short by a kill, non-finite losses. Real processes, real signals, the real HF Trainer."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from pipeline.train_student.checkpoints import COMPLETE_NAME
from pipeline.train_student.trainer import NonFiniteLossError
from pipeline.train_student.checkpoints import RunMismatchError
from pipeline.train_student.run import run_training
from test_train_student import make_job, metrics

REPO = Path(__file__).resolve().parents[2]
# What must be equal, step by step, between an interrupted and an uninterrupted run (not the clock).
SAME = ("step", "loss", "grad_norm", "learning_rate", "loss_kept", "loss_all", "kept_fraction",
        "mapped_fraction", "teacher_loss_kept", "teacher_loss_dropped", "excess_loss", "sample_first",
        "sample_last", "tokens_seen", "nonfinite_steps", "skipped_steps")


# --------------------------------------------------------------------------------------------
# SIGKILL and resume, with the stage's own entry point


def overrides(student: Path, scored: Path, out: Path, run: str, steps: int) -> list[str]:
    return [
        "student.embedded=false", f"student.model={student}", "student.seq_len=32", f"data.folders=[{scored}]",
        f"data.cache_dir={out}/lengths", "data.num_workers=1", "train.micro_batch_size=4",
        "train.gradient_accumulation_steps=2", f"train.max_steps={steps}", "train.warmup_steps=2",
        "train.learning_rate=3e-3", "train.min_learning_rate=3e-4", "train.logging_steps=1", "train.save_steps=3",
        "train.save_total_limit=2", "train.use_cpu=true", "train.report_to=[]", "train.progress=false",
        "train.cpu_threads=1", f"output_dir={out}/{run}",
    ]


def stage_command(student: Path, scored: Path, out: Path, run: str, steps: int) -> list[str]:
    """``python -m stages.train_student`` with the tiny student built by the test."""
    return [sys.executable, "-m", "stages.train_student", *overrides(student, scored, out, run, steps),
            f"hydra.run.dir={out}/logs/{run}"]


def reference_run(student: Path, scored: Path, out: Path, steps: int) -> Path:
    """The uninterrupted run, in this process, from the very config the stage composes."""
    from stages.train_student import job_config
    from test_train_student import compose

    job = job_config(compose(overrides(student, scored, out, "reference", steps)))
    run_training(job)
    return Path(job.output_dir)


def spawn(command: list[str], log: Path) -> subprocess.Popen:
    """The stage in a new session, so that it and its data-loader workers die together."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as f:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> bool:
    """SIGKILL the process group; False when the process had already finished."""
    if proc.poll() is not None:
        return False
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return proc.returncode == -signal.SIGKILL


def complete_steps(run: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in run.glob(f"checkpoint-*/{COMPLETE_NAME}"))


def wait_for_step(run: Path, step: int, since: float, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until the process started at ``since`` has logged optimizer step ``step`` (or ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
        for line in reversed(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # being written
            if record.get("time", 0) > since and record["step"] >= step:
                return
        time.sleep(0.005)


def run_to_completion(command: list[str], log: Path) -> None:
    proc = spawn(command, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]


def assert_same_training(run: Path, reference: Path, steps: int) -> None:
    got, want = metrics(run), metrics(reference)
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # each step once, in order
    assert [{k: r[k] for k in SAME} for r in got] == [{k: r[k] for k in SAME} for r in want]
    a, b = load_file(run / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit


def kill_and_resume(student: Path, scored: Path, tmp_path: Path, steps: int, kills: int, seed: int,
                    after: tuple[int, int], early_kills: int = 0) -> list[int]:
    """Kill the stage ``kills`` times, rerun it to the end after each, and compare with an
    uninterrupted run. The first ``early_kills`` land at a random moment of its start-up, the
    others a random moment after the run logged a random step ``after`` steps past the checkpoint
    it resumed from (save_steps=3: in training, logging, saving or rotating checkpoints). Returns
    the newest complete checkpoint after each kill."""
    reference = reference_run(student, scored, tmp_path, steps)
    command = stage_command(student, scored, tmp_path, "killed", steps)
    run, rng, resumed_at = tmp_path / "killed", random.Random(seed), []
    for k in range(kills):
        previous, started = max(complete_steps(run), default=0), time.time()
        proc = spawn(command, tmp_path / "killed.log")
        if k < early_kills:
            time.sleep(rng.uniform(0.5, 4.0))
        else:
            wait_for_step(run, previous + rng.randint(*after), started, proc)
            time.sleep(rng.uniform(0.0, 0.05))
        assert kill_group(proc), f"kill {k} came after the run had finished; use more steps"
        resumed_at.append(max(complete_steps(run), default=0))
    assert not (run / "final").exists()
    run_to_completion(command, tmp_path / "killed.log")
    assert_same_training(run, reference, steps)
    assert json.loads((run / "summary.json").read_text())["resumed_from"].endswith(f"checkpoint-{resumed_at[-1]}")
    return resumed_at


@pytest.mark.long
def test_training_killed_after_a_checkpoint_resumes_to_the_same_losses(tiny_student, micro_scored, tmp_path):
    """SIGKILL at a random moment after the first checkpoint; the rerun resumes from the newest
    complete checkpoint and logs exactly the uninterrupted run's per-step losses."""
    resumed_at = kill_and_resume(tiny_student, micro_scored, tmp_path, steps=24, kills=1, seed=0, after=(4, 9))
    print("newest complete checkpoint after the kill:", resumed_at)
    assert resumed_at[0] >= 3


@pytest.mark.slow
def test_training_killed_many_times_resumes_to_the_same_losses(tiny_student, micro_scored, tmp_path):
    """Six kills: one during start-up, five at random moments of training (some while saving)."""
    resumed_at = kill_and_resume(tiny_student, micro_scored, tmp_path, steps=90, kills=6, seed=1, after=(3, 7),
                                 early_kills=1)
    print("newest complete checkpoint after each kill:", resumed_at)
    assert resumed_at == sorted(resumed_at) and resumed_at[-1] > 0


def test_checkpoint_cut_short_by_a_kill_is_not_resumed(tiny_student, micro_scored, tmp_path):
    """The state a kill while saving checkpoint-4 leaves (no completion marker, a truncated
    optimizer file, a half-written metrics line): the rerun resumes from checkpoint-2, deletes the
    broken checkpoint, and reproduces the run."""
    job = make_job(tiny_student, micro_scored, tmp_path / "run", steps=4)
    run_training(job)
    run = Path(job.output_dir)
    before = metrics(run)
    broken = run / "checkpoint-4"
    (broken / COMPLETE_NAME).unlink()
    optimizer = broken / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1.2')
    for resume, error in ((str(broken), RunMismatchError), (str(run / "checkpoint-99"), FileNotFoundError)):
        with pytest.raises(error, match="incomplete" if error is RunMismatchError else "not found"):
            run_training(replace(job, train=replace(job.train, resume=resume)))

    summary = run_training(job)
    assert summary.resumed_from.endswith("checkpoint-2") and summary.steps == 4
    assert [{k: r[k] for k in SAME} for r in metrics(run)] == [{k: r[k] for k in SAME} for r in before]
    assert (broken / COMPLETE_NAME).is_file()  # saved again, whole


# --------------------------------------------------------------------------------------------
# Non-finite losses


class NonFiniteLogits(TrainerCallback):
    """Injects non-finite logits: a forward hook on the student's output layer, registered when
    training begins, adds ``value`` to the logits of the chosen micro-batches of chosen steps.
    ``where``: optimizer step (1-based) -> micro-batch indices, or None for all of them."""

    def __init__(self, where: dict[int, tuple[int, ...] | None], value: float = math.nan):
        self.where, self.value = where, value
        self.step = self.micro = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.get_output_embeddings().register_forward_hook(self.hook)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step, self.micro = state.global_step + 1, 0

    def on_substep_end(self, args, state, control, **kwargs):
        self.micro += 1

    def hook(self, module, inputs, output):
        chosen = self.where.get(self.step, ())
        if module.training and self.step in self.where and (chosen is None or self.micro in chosen):
            return output + self.value
        return None


class Snapshots(TrainerCallback):
    """Parameters and AdamW state before and after each optimizer step."""

    def __init__(self):
        self.before, self.after = {}, {}

    @staticmethod
    def take(model, optimizer) -> dict:
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "adam": copy.deepcopy(optimizer.state_dict()["state"])}

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.before[state.global_step + 1] = self.take(model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.after[state.global_step] = self.take(model, optimizer)

    def unchanged(self, step: int) -> bool:
        a, b = self.before[step], self.after[step]
        same_params = all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        same_adam = a["adam"].keys() == b["adam"].keys() and all(
            torch.equal(torch.as_tensor(a["adam"][i][k]), torch.as_tensor(b["adam"][i][k]))
            for i in a["adam"] for k in a["adam"][i])
        return same_params and same_adam


def test_isolated_nonfinite_steps_are_skipped_counted_and_training_goes_on(tiny_student, micro_scored, tmp_path):
    """NaN logits in the second micro-batch of step 3 (gradient accumulation 2: the whole step is
    skipped) and +inf logits in every micro-batch of step 5. Weight decay 0.1 and AdamW momentum
    would move the weights if the optimizer stepped at all."""
    job = make_job(tiny_student, micro_scored, tmp_path / "run", steps=7, max_nonfinite_in_a_row=2)
    snapshots = Snapshots()
    summary = run_training(job, callbacks=[NonFiniteLogits({3: (1,)}), NonFiniteLogits({5: None}, math.inf),
                                           snapshots])
    assert summary.steps == 7 and summary.nonfinite_steps == [3, 5]
    assert snapshots.unchanged(3) and snapshots.unchanged(5)  # parameters, moments, step counts
    assert not any(snapshots.unchanged(s) for s in (1, 2, 4, 6, 7))  # applied steps do move them
    records = {r["step"]: r for r in metrics(Path(job.output_dir))}
    assert [records[s]["skipped_steps"] for s in range(1, 8)] == [0, 0, 1, 0, 1, 0, 0]
    assert [records[s]["nonfinite_steps"] for s in range(1, 8)] == [0, 0, 1, 1, 2, 2, 2]
    assert math.isnan(records[3]["grad_norm"]) and math.isnan(records[3]["loss_kept"])  # nothing applied
    assert all(math.isfinite(records[s]["loss_kept"]) for s in (1, 2, 4, 6, 7))
    assert records[4]["learning_rate"] < records[3]["learning_rate"]  # the schedule advanced through the skip
    final = load_file(Path(summary.final_model) / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in final.values())


def test_nonfinite_steps_in_a_row_stop_the_run_with_a_usable_checkpoint(tiny_student, micro_scored, tmp_path):
    from transformers import AutoModelForCausalLM

    job = make_job(tiny_student, micro_scored, tmp_path / "run", steps=8, max_nonfinite_in_a_row=3)
    run = Path(job.output_dir)
    with pytest.raises(NonFiniteLossError, match=r"stopped at step 5: 3 optimizer steps in a row \(steps 3-5, "
                                                 r"packed samples 16-39\)") as err:
        run_training(job, callbacks=[NonFiniteLogits({s: None for s in range(3, 9)})])
    assert f"{run / 'checkpoint-5'} holds the weights of step 2" in str(err.value)
    assert "max_nonfinite_in_a_row" in str(err.value) and not (run / "final").exists()
    assert (run / "checkpoint-5" / COMPLETE_NAME).is_file()
    stopped, last_good = (load_file(run / c / "model.safetensors") for c in ("checkpoint-5", "checkpoint-2"))
    assert all(torch.equal(stopped[k], last_good[k]) and torch.isfinite(stopped[k]).all() for k in stopped)
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoint-5", use_safetensors=True)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 9, 11]])).logits).all()
    assert metrics(run)[-1]["step"] == 5 and metrics(run)[-1]["nonfinite_steps"] == 3

    summary = run_training(job)  # the cause is gone: the rerun resumes from the stop and finishes
    assert summary.resumed_from.endswith("checkpoint-5") and summary.steps == 8
    assert summary.nonfinite_steps == [3, 4, 5]  # the count survives the resume


def test_second_training_on_the_same_run_folder_is_refused(tiny_student, micro_scored, tmp_path):
    from pipeline.folders.folder_lock import DatasetBusyError, exclusive_writer

    job = make_job(tiny_student, micro_scored, tmp_path / "run")
    with exclusive_writer(job.output_dir, what="training run"):  # as if another launch were training
        with pytest.raises(DatasetBusyError, match="another training run is writing this folder"):
            run_training(job)
    assert not list(Path(job.output_dir).glob("checkpoint-*"))


# --------------------------------------------------------------------------------------------
# SIGTERM and SIGUSR1: a checkpoint at the step under way, then the signal's exit status


@pytest.fixture(scope="module")
def signal_reference(tiny_student, micro_scored, tmp_path_factory) -> tuple[Path, int]:
    steps = 14
    return reference_run(tiny_student, micro_scored, tmp_path_factory.mktemp("signal-reference"), steps), steps


@pytest.mark.long
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_saves_a_checkpoint_at_the_current_step_and_the_rerun_ends_as_an_uninterrupted_run(
        sig, tiny_student, micro_scored, signal_reference, tmp_path):
    """The signal to every process of the stage (its data-loader worker too, as a scheduler sends
    it), with ``train.save_steps`` far past the run's end: the stage saves a complete checkpoint at
    the step it was in, logs it, and exits with the signal's status (143, 138) in one line naming
    the checkpoint; the same command resumes from it and ends with the uninterrupted run's per-step
    figures and final weights, bit for bit."""
    reference, steps = signal_reference
    command = stage_command(tiny_student, micro_scored, tmp_path, "signalled", steps)
    command[command.index("train.save_steps=3")] = "train.save_steps=1000"  # no checkpoint but the signal's
    run, log = tmp_path / "signalled", tmp_path / "signalled.log"
    started = time.time()
    proc = spawn(command, log)
    wait_for_step(run, 4, started, proc)
    assert proc.poll() is None, log.read_text()[-3000:]
    os.killpg(proc.pid, sig)  # the stage and its data-loader worker
    status = proc.wait(timeout=300)
    last_logged = max(r["step"] for r in metrics(run))
    assert status == {signal.SIGTERM: 143, signal.SIGUSR1: 138}[sig], log.read_text()[-3000:]
    assert 4 <= last_logged < steps and complete_steps(run) == [last_logged], (last_logged, complete_steps(run))
    last_line = [ln for ln in log.read_text().splitlines() if ln.strip()][-1]
    assert last_line == (f"interrupted ({signal.Signals(sig).name}): checkpoint-{last_logged} saved at step "
                         f"{last_logged} of {steps} ({run / f'checkpoint-{last_logged}'}); the same command resumes "
                         "from it"), log.read_text()[-3000:]
    assert "Traceback" not in log.read_text() and not (run / "final").exists()
    assert not (run / ".lock").exists()

    run_to_completion(command, log)
    assert_same_training(run, reference, steps)
    assert json.loads((run / "summary.json").read_text())["resumed_from"].endswith(f"checkpoint-{last_logged}")
