"""Stage 2 end to end on CPU: the real HF Trainer, tiny real students, the micro scored dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import TrainerCallback

from pipeline.train_student.checkpoints import DATA_IDENTITY_NAME
from pipeline.student_data.settings import AlignmentConfig
from pipeline.method.guided_loss import SelectionConfig
from pipeline.train_student.checkpoints import RunMismatchError
from pipeline.train_student.config import DataConfig, StudentConfig, TrainConfig, TrainJobConfig
from pipeline.train_student.run import run_training
from storage_schemas import file_sha256

REPO = Path(__file__).resolve().parents[2]
METRICS = ("loss", "loss_kept", "loss_all", "kept_fraction", "mapped_fraction", "teacher_loss_kept",
           "teacher_loss_dropped", "excess_loss", "tokens_per_s", "learning_rate", "grad_norm")



def make_job(model: Path, scored: Path, out: Path, steps: int = 4, **changes) -> TrainJobConfig:
    loss = changes.pop("loss", {})  # as the config's loss group: selection and alignment settings
    selection = SelectionConfig(**{k: v for k, v in loss.items() if k in ("mode", "ratio", "rank_over", "unmapped")})
    alignment = AlignmentConfig(**{("method" if k == "alignment" else k): v for k, v in loss.items()
                                   if k in ("alignment", "aggregate", "n_chunks")})
    data = DataConfig(folders=[str(scored)], cache_dir=str(out.parent / "lengths"), num_workers=changes.pop("workers", 0))
    train = TrainConfig(**{
        "micro_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": steps, "learning_rate": 3e-3,
        "min_learning_rate": 3e-4, "warmup_steps": 1, "logging_steps": 1, "save_steps": 2, "report_to": [],
        "progress": False, "use_cpu": True, "cpu_threads": 1, **changes})
    return TrainJobConfig(student=StudentConfig(name="t", model=str(model), seq_len=32), data=data, selection=selection,
                          alignment=alignment, train=train, output_dir=str(out))


def metrics(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss_kept" in r]


class CrashAt(TrainerCallback):
    """Simulates a killed job: raises at the end of optimizer step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"simulated crash at step {self.step}")


def test_trains_logs_checkpoints_and_saves_a_loadable_model(tiny_student, micro_scored, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = make_job(tiny_student, micro_scored, tmp_path / "run", workers=1, report_to=["tensorboard"])
    summary = run_training(job)
    run = Path(job.output_dir)
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and summary.steps == 4
    for r in records:
        assert all(k in r for k in METRICS), r.keys()
        # guided top 40% of the mapped tokens plus every unmapped token (ceil per micro-batch)
        expected = 0.4 * r["mapped_fraction"] + 1 - r["mapped_fraction"]
        assert expected <= r["kept_fraction"] <= expected + 0.01
        assert r["teacher_loss_kept"] < r["teacher_loss_dropped"] or r["excess_loss"] > 0
        # the run's own selection, trained against left: the two groups make up every valid token, and
        # with byte pieces ranked every trained token with a teacher loss is a selected one
        share = r["kept_fraction"]
        assert r["loss_all"] == pytest.approx(share * r["loss_kept"] + (1 - share) * r["student_loss_left"], rel=1e-4)
        assert r["teacher_loss_trained"] == pytest.approx(r["teacher_loss_kept"], rel=1e-6)
        assert r["teacher_loss_left"] == pytest.approx(r["teacher_loss_dropped"], rel=1e-6)
        assert r["sample_last"] - r["sample_first"] == 7  # 4 sequences x 2 micro-batches, in order
    assert [r["sample_first"] for r in records] == [0, 8, 16, 24]
    # epoch: passes over the packed data (samples trained over the plan's samples), not the share of
    # the run's own sampler, which would read 1.0 at the last step of any run
    n_samples = summary.data["n_samples"]
    assert n_samples > 32
    assert [r["epoch"] for r in records] == pytest.approx([(r["sample_last"] + 1) / n_samples for r in records])
    rates = [r["learning_rate"] for r in records]  # warmup from 0, then cosine towards the minimum
    assert rates[0] == 0 and rates[1] == 3e-3 and rates[1] > rates[2] > rates[3] > 3e-4

    manifest_sha = file_sha256(micro_scored / "manifest.json")
    for folder in (run / "checkpoint-2", run / "checkpoint-4", run / "final"):
        identity = json.loads((folder / DATA_IDENTITY_NAME).read_text())
        assert identity["folders"][0]["manifest_sha256"] == manifest_sha
        assert identity["packing"]["seq_len"] == 32 and identity["alignment"]["method"] == "token"
    assert list((run / "runs").rglob("events.out.tfevents.*"))
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    ids = tok("Solve 2x + 3 = 7.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("mode", ["guided", pytest.param("random", marks=pytest.mark.slow)])
def test_resumed_run_sees_the_same_batches_and_losses(tiny_student, micro_scored, tmp_path, mode):
    steps = 6
    straight = make_job(tiny_student, micro_scored, tmp_path / "straight", steps, workers=1, loss={"mode": mode})
    run_training(straight)
    interrupted = replace(straight, output_dir=str(tmp_path / "interrupted"))
    with pytest.raises(KeyboardInterrupt):
        run_training(interrupted, callbacks=[CrashAt(5)])
    assert sorted(p.name for p in Path(interrupted.output_dir).glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    summary = run_training(interrupted)  # resume=auto picks up the newest, checkpoint-4
    assert summary.resumed_from.endswith("checkpoint-4") and summary.steps == steps

    keys = ("step", "loss", "loss_kept", "loss_all", "kept_fraction", "excess_loss", "learning_rate",
            "grad_norm", "sample_first", "sample_last")
    a, b = metrics(Path(straight.output_dir)), metrics(Path(interrupted.output_dir))
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]

    again = run_training(interrupted)  # a finished run: nothing more is trained
    assert again.steps == steps and again.tokens_trained == 0 and again.last_log["step"] == steps
    assert metrics(Path(interrupted.output_dir)) == b


def test_resume_is_refused_when_the_recipe_or_the_data_change(tiny_student, micro_scored, tmp_path):
    job = make_job(tiny_student, micro_scored, tmp_path / "run", steps=2)
    run_training(job)
    with pytest.raises(RunMismatchError, match="recipe loss.ratio: 0.4 != 0.3") as refused:
        run_training(replace(job, selection=replace(job.selection, ratio=0.3)))
    assert "To train further" not in str(refused.value)
    with pytest.raises(RunMismatchError, match="recipe train.max_steps: 2 != 3") as longer:
        run_training(replace(job, train=replace(job.train, max_steps=3)))
    assert f"To train further, start a new run from this one's model: student.model={tmp_path / 'run' / 'final'}" \
        in str(longer.value), "a longer run is told the way on"
    with pytest.raises(RunMismatchError, match="data packing.seed"):
        run_training(replace(job, data=replace(job.data, seed=5)))
    with pytest.raises(RunMismatchError, match="resume=never"):
        run_training(replace(job, train=replace(job.train, resume="never")))
    fresh = run_training(replace(job, selection=replace(job.selection, ratio=0.3), overwrite=True))
    assert fresh.resumed_from is None and fresh.steps == 2


def llama2_student(tok, folder: Path) -> Path:
    """A tiny random Llama with the real Llama-2 (TinyLlama) tokenizer, 32,000 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_one_scored_dataset_feeds_two_students_with_different_tokenizers(
    tiny_student, micro_scored, real_tokenizer, tmp_path
):
    manifest_before = file_sha256(micro_scored / "manifest.json")
    llama = llama2_student(real_tokenizer("llama-spm"), tmp_path / "llama2-student")
    identities, summaries = [], []
    for name, model in (("sentencepiece-tiny", tiny_student), ("llama2-vocab", llama)):
        job = make_job(model, micro_scored, tmp_path / name, steps=2)
        summaries.append(run_training(job))
        identities.append(json.loads((Path(job.output_dir) / "final" / DATA_IDENTITY_NAME).read_text()))
        assert all(r["mapped_fraction"] > 0.8 for r in metrics(Path(job.output_dir)))
    assert identities[0]["folders"] == identities[1]["folders"]  # the same scored data, not rescored
    assert identities[0]["student_tokenizer_sha256"] != identities[1]["student_tokenizer_sha256"]
    assert summaries[0].data["n_tokens"] != summaries[1].data["n_tokens"]
    assert file_sha256(micro_scored / "manifest.json") == manifest_before


def test_cpt_trains_every_token_and_random_keeps_k_percent(tiny_student, micro_scored, tmp_path):
    for mode, check in (("cpt", lambda r: r["kept_fraction"] == 1.0),
                        ("random", lambda r: abs(r["kept_fraction"] - (1 - 0.6 * r["mapped_fraction"])) < 0.01)):
        job = make_job(tiny_student, micro_scored, tmp_path / mode, steps=1, loss={"mode": mode})
        run_training(job)
        assert all(check(r) for r in metrics(Path(job.output_dir))), mode


def test_too_many_steps_for_the_data_is_refused_before_training(tiny_student, micro_scored, tmp_path):
    with pytest.raises(ValueError, match=r"train.max_steps 1,000,000 asks for .* at most \d+ steps"):  # before the count
        run_training(make_job(tiny_student, micro_scored, tmp_path / "run", steps=10**6))
    assert not (tmp_path / "run").exists()


def test_final_model_is_saved_in_the_chosen_dtype(tiny_student, micro_scored, tmp_path):
    """``train.save_dtype=bfloat16``: every tensor of ``final/model.safetensors`` is bf16 (read from
    the file's own header), the config says so, and it loads; ``auto`` follows the training
    precision (float32 here on CPU, bf16 when training in bf16)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from pipeline.train_student.run import final_dtype

    job = make_job(tiny_student, micro_scored, tmp_path / "run", steps=1, save_dtype="bfloat16")
    run_training(job)
    final = Path(job.output_dir) / "final"
    with safe_open(final / "model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(final).dtype == torch.bfloat16
    with safe_open(Path(job.output_dir) / "checkpoint-1" / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}, "resume keeps float32 master weights"
    assert final_dtype(TrainConfig(use_cpu=True)) == torch.float32
    assert final_dtype(TrainConfig(precision="bf16")) == torch.bfloat16
    assert final_dtype(TrainConfig(precision="bf16", save_dtype="float32")) == torch.float32


# --------------------------------------------------------------------------------------------
# The stage entry point and its configs


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import stages.train_student  # noqa: F401  (registers the defaults conf/train_student.yaml overrides)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="train_student", overrides=overrides)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")))
def test_paper_experiments_pin_the_recipe(experiment):
    from pipeline.train_student.config import batch_geometry
    from stages.train_student import job_config

    job = job_config(compose([f"experiment={experiment}"]))
    assert job.student.model == "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T" and job.student.seq_len == 2048
    teacher = Path(job.data.folders[0]).parent.name
    assert job.data.folders[0].endswith(f"outputs/scored/open-web-math/{teacher}/v1")
    assert teacher in ("qwen2.5-math-7b-instruct", "deepseekmath-7b", "mistral-proxmath-7b", "llemma-7b")
    assert (job.selection.mode, job.selection.ratio, job.alignment.aggregate, job.selection.unmapped) == (
        "guided", 0.4, "max", "include")
    assert (job.train.learning_rate, job.train.min_learning_rate) == (8e-5, 8e-6)
    assert (job.train.lr_scheduler, job.data.held_out_shards, job.train.eval_every) == ("cosine", 0, None)
    assert batch_geometry(job, world_size=8) == (16, 2**21)  # 8 GPUs x 8 x 2048 x 16 = 2M tokens
    assert (job.train.max_tokens, job.train.max_steps, job.data.epochs) == (None, None, 1)  # one pass over the data
    assert job.output_dir.endswith(f"outputs/students/open-web-math/tinyllama-1.1b-{teacher}-guided")


@pytest.mark.parametrize("student", sorted(p.stem for p in (REPO / "conf" / "student").glob("*.yaml")))
def test_student_configs_compose_and_validate(student):
    from stages.train_student import job_config

    job = job_config(compose([f"student={student}"]))
    assert job.student.name == student and os.path.isabs(job.output_dir)


def test_all_config_problems_are_reported_at_once():
    from stages.common import ConfigError
    from stages.train_student import job_config

    with pytest.raises(ConfigError) as err:
        job_config(compose(["+loss.typo=1", "+train.other_typo=2"]))
    assert "loss.typo" in str(err.value) and "train.other_typo" in str(err.value)
    with pytest.raises(ConfigError) as err:
        job_config(compose(["loss.mode=rho", "loss.ratio=1.5", "train.global_batch_tokens=1000"]))
    message = str(err.value)
    assert "loss.mode" in message and "loss.ratio" in message and "global_batch_tokens" in message


def stage_command(scored: Path, out: Path, steps: int) -> list[str]:
    """The stage with the embedded tiny student, built (once, under a file lock) from a 200-document corpus."""
    return [
        "-m", "stages.train_student", f"artifacts_dir={out}/artifacts", "student.build.corpus_docs=200",
        "student.seq_len=32", f"data.folders=[{scored}]", f"data.cache_dir={out}/lengths", "data.num_workers=1",
        "train.micro_batch_size=2", "train.gradient_accumulation_steps=1", f"train.max_steps={steps}",
        "train.logging_steps=1", "train.save_steps=2", "train.use_cpu=true", "train.report_to=[]", "train.cpu_threads=1",
        f"output_dir={out}/run", f"hydra.run.dir={out}/logs",
    ]


@pytest.mark.slow
def test_make_train_student_entry_point(micro_scored, tmp_path):
    """``python -m stages.train_student`` with overrides: builds the embedded student, trains, prints the
    summary, writes summary.json."""
    result = subprocess.run([sys.executable, *stage_command(micro_scored, tmp_path, 3)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train-student" in result.stdout and "final model" in result.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
    changed = subprocess.run([sys.executable, *stage_command(micro_scored, tmp_path, 4)],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
    assert changed.returncode == 2 and "error: cannot resume" in changed.stderr  # one line, no traceback
    assert "train.max_steps: 3 != 4" in changed.stderr and "Traceback" not in changed.stderr


@pytest.mark.slow
def test_two_processes_on_gloo_with_torchrun(micro_scored, tmp_path):
    """Distributed data parallel on CPU: 2 processes, gloo; each trains its own half of every batch."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29731",
               *stage_command(micro_scored, tmp_path, 4), "train.ddp_backend=gloo"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # Both ranks' samples are counted: 2 processes x 2 sequences per step, consecutive in the order.
    assert [(r["sample_first"], r["sample_last"]) for r in records] == [(0, 3), (4, 7), (8, 11), (12, 15)]
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    # the embedded recipe's held-out evaluation, after the last step: each rank measured every other
    # document, and the sums make the value one process gives on the same model and documents
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.method.bits_per_byte import default_window, summarize, text_losses

    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "eval_bits_per_byte" in r]
    assert [r["step"] for r in evals] == [4]
    held = sorted(micro_scored.glob("shard-*.parquet"))[-1]
    texts = [t for t in pq.read_table(held, columns=["text"]).column("text").to_pylist() if t][:24]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    one = summarize(text_losses(model, AutoTokenizer.from_pretrained(tmp_path / "run" / "final"), texts,
                                window=default_window(model)))
    assert evals[0]["eval_bits_per_byte"] == pytest.approx(one["bits_per_byte"], rel=1e-5)
