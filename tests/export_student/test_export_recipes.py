"""The recipes of docs/export.md, run as written there (each code block marked ``# recipe: <name>``):
the Hugging Face Trainer on the exported Parquet against ``make train-student``, a plain PyTorch loop
against a float64 brute force, and Megatron-core's own GPTDataset and the ``loss_func`` recipe."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from export_helpers import exported_rows, make_export, manifest
from pipeline.export_student.job import run_export

DOCS = Path(__file__).resolve().parents[2] / "docs" / "export.md"


def recipe(name: str) -> dict:
    """The namespace the recipe ``name`` of docs/export.md defines, executed as written."""
    blocks = re.findall(r"```python\n(# recipe: ([\w-]+)\n.*?)```", DOCS.read_text(), flags=re.S)
    code = {n: text for text, n in blocks}
    assert name in code, f"docs/export.md has no '# recipe: {name}' block (has {sorted(code)})"
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code[name], f"docs/export.md#{name}", "exec"), namespace)
    return namespace


def stage2_job(student, scored, out, steps):
    from pipeline.train_student.config import DataConfig, StudentConfig, TrainConfig, TrainJobConfig

    return TrainJobConfig(
        student=StudentConfig(name="t", model=str(student), seq_len=32),
        data=DataConfig(folders=[str(scored)], cache_dir=str(out.parent / "lengths"), num_workers=0),
        train=TrainConfig(micro_batch_size=4, gradient_accumulation_steps=2, max_steps=steps, learning_rate=3e-3,
                          min_learning_rate=3e-4, warmup_steps=1, logging_steps=1, save_steps=100, report_to=[],
                          progress=False, use_cpu=True, cpu_threads=1),
        output_dir=str(out))


def test_hf_trainer_on_the_export_logs_the_losses_of_make_train_student(tiny_student, micro_scored, tmp_path):
    """Same student, seed, order and settings: the per-step loss, gradient norm, learning rate and
    selection fractions of the recipe's Trainer equal stage 2's, to the last bit."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, TrainingArguments

    from pipeline.train_student.run import run_training

    steps = 4
    run_training(stage2_job(tiny_student, micro_scored, tmp_path / "stage2", steps))
    stage2 = [json.loads(line) for line in (tmp_path / "stage2" / "metrics.jsonl").read_text().splitlines()]
    stage2 = [r for r in stage2 if "kept_fraction" in r]

    run_export(make_export(tiny_student, micro_scored, tmp_path / "export", rows_per_shard=64))
    ns = recipe("hf-trainer")
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=steps,
        learning_rate=3e-3, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 3e-4},
        warmup_steps=1, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
        seed=0, data_seed=0, use_cpu=True, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_drop_last=True, remove_unused_columns=False, train_sampling_strategy="sequential")
    model = AutoModelForCausalLM.from_pretrained(tiny_student, dtype=torch.float32, use_safetensors=True)
    model.config.use_cache = False
    trainer = ns["GuidedLossTrainer"](model=model, args=args, data_collator=ns["collate"],
                                      train_dataset=load_dataset(str(tmp_path / "export"), split="train"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as stage 2's train.cpu_threads=1
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    hf = [r for r in trainer.state.log_history if "kept_fraction" in r]

    keys = ("loss", "grad_norm", "learning_rate", "kept_fraction", "mapped_fraction")
    assert [r["step"] for r in hf] == [r["step"] for r in stage2] == list(range(1, steps + 1))
    differences = {k: max(abs(a[k] - b[k]) for a, b in zip(hf, stage2)) for k in keys}
    assert differences == {k: 0.0 for k in keys}, (differences, hf, stage2)


def test_pytorch_loop_recipe_against_a_float64_brute_force(tiny_student, micro_scored, tmp_path):
    from transformers import AutoModelForCausalLM

    run_export(make_export(tiny_student, micro_scored, tmp_path / "export", rows_per_shard=64))
    rows = exported_rows(tmp_path / "export")[:8]
    hf = recipe("hf-trainer")
    batches = [hf["collate"](rows[:4]), hf["collate"](rows[4:])]
    model = AutoModelForCausalLM.from_pretrained(tiny_student, dtype=torch.float32)
    with torch.no_grad():
        first_logits = model(input_ids=batches[0]["input_ids"]).logits.double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (first_loss, stats), _ = list(recipe("pytorch-loop")["train"](model, batches, optimizer))

    b = batches[0]
    ce = torch.logsumexp(first_logits, -1) - first_logits.gather(-1, b["labels"].unsqueeze(-1)).squeeze(-1)  # (B, L)
    teacher = b["teacher_loss"].double()
    mapped = [(i, t) for i in range(ce.shape[0]) for t in range(ce.shape[1]) if not math.isnan(teacher[i, t])]
    ranked = sorted(mapped, key=lambda p: (-(float(ce[p]) - float(teacher[p])), p))
    kept = set(ranked[:math.ceil(0.4 * len(mapped))]) | {(i, t) for i in range(ce.shape[0]) for t in range(ce.shape[1])
                                                         if math.isnan(teacher[i, t])}
    assert stats["n_kept"] == len(kept) and stats["n_mapped"] == len(mapped)
    assert first_loss == pytest.approx(sum(float(ce[p]) for p in kept) / len(kept), rel=1e-5)


def test_megatron_gpt_dataset_and_loss_func_recipe(tiny_student, micro_scored, tmp_path):
    """The recipe's Megatron training dataset, built as written (Megatron's own tokenizer,
    GPTDatasetConfig and BlendedMegatronDatasetBuilder over the export's two shards): every sample's
    labels are the next tokens of the documents Megatron packed, each with its Parquet teacher loss;
    the recipe's loss_func sums the trained tokens' losses and counts them as a brute force does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ns = recipe("megatron")
    out = tmp_path / "export"
    run_export(make_export(tiny_student, micro_scored, out, layout="documents", rows_per_shard=80,
                           formats=["parquet", "megatron"]))
    shards = manifest(out)["shards"]
    assert len(shards) == 2
    parquet = [pq.read_table(out / s["file"]).to_pylist() for s in shards]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = ns["megatron_train_dataset"](str(out), str(tiny_student), sequence_length=24, train_samples=60)
    assert len(train) == 60 and sorted(set(train.dataset_index.tolist())) == [0, 1], "both shards blended"

    batch = []
    for k in range(len(train)):
        sample = train[k]
        shard = int(sample["dataset_id"])
        part, rows = train.datasets[shard], parquet[shard]
        # The stream Megatron packs from this shard: its documents in its document_index order, from the Parquet rows.
        stream_ids = np.concatenate([np.asarray(rows[d]["input_ids"], np.int64) for d in part.document_index])
        stream_loss = np.concatenate([np.asarray(rows[d]["teacher_loss"], np.float32) for d in part.document_index])
        starts = np.cumsum([0, *[len(rows[d]["input_ids"]) for d in part.document_index]])
        doc, offset = part.sample_index[part.shuffle_index[int(train.dataset_sample_index[k])]]
        p = int(starts[doc] + offset)
        assert sample["labels"].tolist() == stream_ids[p + 1:p + 25].tolist()
        want, got = stream_loss[p + 1:p + 25], sample["teacher_loss"].numpy()
        assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
        batch.append(sample)

    samples = batch[:4]
    loss_mask = torch.stack([s["loss_mask"] for s in samples])
    loss_mask[0, :3] = 0  # as eod_mask_loss would
    teacher = torch.stack([s["teacher_loss"] for s in samples])
    per_token = torch.rand(loss_mask.shape, generator=torch.Generator().manual_seed(0)) * 6
    total, num_tokens, report = ns["loss_func"](loss_mask, teacher, per_token.clone().requires_grad_())
    valid = [(i, t) for i in range(4) for t in range(24) if loss_mask[i, t] > 0]
    mapped = [p for p in valid if not math.isnan(teacher[p])]
    ranked = sorted(mapped, key=lambda p: (-(float(per_token[p]) - float(teacher[p])), p))
    kept = set(ranked[:math.ceil(0.4 * len(mapped))]) | (set(valid) - set(mapped))
    assert int(num_tokens) == len(kept)
    assert total.item() == pytest.approx(sum(float(per_token[p]) for p in kept), rel=1e-5)
    assert report["lm loss"][1].item() == len(kept)
