"""The embedded tiny teacher: a byte-level BPE tokenizer and a small Qwen2-architecture model,
both trained on the clean part of the sample corpus, so its per-token losses mean something.

Built deterministically (fixed seeds, fixed data order, single-process CPU training) and cached:
a ``_BUILD.json`` stamp holds the build parameters and what was measured (held-out loss per token
on clean and on noise documents, before and after training); a second call with the same
parameters returns the cached folder. The folder is an ordinary Hugging Face checkpoint
(``config.json``, ``model.safetensors``, ``tokenizer.json``), loaded by the same
``from_pretrained`` code as a hub teacher.

The tokenizer mirrors what Qwen2-style byte-level BPE does: NFC normalisation, a regex
pre-split (letters, single digits, punctuation runs, whitespace), byte-level mapping, offsets that
keep the leading space (``trim_offsets=False``), one special token ``<|endoftext|>`` and no BOS.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from pipeline.runtime.cpu_threads import torch_threads, usable_cores
from pipeline.embedded.model_shape import ModelShape

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
TRAIN_THREADS = 1  # torch threads while the tiny models train (fit_blocks)
# Letters with an optional leading space, one digit at a time, punctuation runs, newlines, spaces.
PRE_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


@dataclass(frozen=True, kw_only=True)
class TinyTeacherSpec(ModelShape):
    """The tiny teacher's tokenizer, sizes and training recipe."""

    vocab_size: int = 4096
    intermediate_size: int = 384
    block: int = 256  # training sequence length; longer pages are scored in windows of ``context``
    batch_size: int = 8
    steps: int = 250
    learning_rate: float = 3e-3
    seed: int = 0
    max_train_docs: int | None = None


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts``."""
    from transformers import PreTrainedTokenizerFast  # lazy: seconds to import; a config error is refused first

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=10**9)


def pack_blocks(tokenizer, texts: Sequence[str], block: int) -> list[list[int]]:
    """Documents as stage 2 packs them (BOS if the tokenizer has one, the text, EOS), concatenated
    and cut into blocks of ``block`` tokens (the last partial block dropped)."""
    head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids: list[int] = []
    for enc in tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True)["input_ids"]:
        ids += [*head, *enc, tokenizer.eos_token_id]
    return [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]


def build_folder(out_dir: str | os.PathLike, write) -> Path:
    """Run ``write(work)`` in an empty sibling folder, then swap it in for ``out_dir``, so a build
    is whole or absent (a killed build leaves only the sibling, removed by the next one)."""
    out_dir = Path(out_dir)
    work = out_dir.with_name(out_dir.name + ".building")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    write(work)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(work, out_dir)
    return out_dir


def _mean_loss(model, blocks: list[list[int]]) -> float:
    import torch  # lazy: seconds to import; a config error is refused first
    if not blocks:
        return float("nan")
    model.eval()
    with torch.inference_mode():
        x = torch.tensor(blocks)
        loss = model(input_ids=x, labels=x).loss.item()
    model.train()
    return loss


def build_tiny_teacher(
    train_texts: Sequence[str], out_dir: str | os.PathLike, spec: TinyTeacherSpec = TinyTeacherSpec(),
    eval_texts: dict[str, Sequence[str]] | None = None,
) -> Path:
    """Train (or return the cached) tiny teacher in ``out_dir``; see the module docstring."""
    import torch  # lazy: seconds to import; a config error is refused first
    from transformers import Qwen2Config, Qwen2ForCausalLM  # lazy: seconds to import; a config error is refused first

    out_dir = Path(out_dir)
    stamp_path = out_dir / "_BUILD.json"
    params = {"spec": asdict(spec), "n_train_texts": len(train_texts)}
    if stamp_path.is_file() and json.loads(stamp_path.read_text()).get("params") == params:
        return out_dir

    t0 = time.perf_counter()
    texts = list(train_texts)[: spec.max_train_docs] if spec.max_train_docs else list(train_texts)
    random.Random(spec.seed).shuffle(texts)
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    blocks = pack_blocks(tokenizer, texts, spec.block)
    if len(blocks) < 2:
        raise ValueError(f"too little training text for the tiny teacher: {len(blocks)} blocks of {spec.block} tokens")

    torch.manual_seed(spec.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **spec.hf_config_args(),
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    log.info("building the tiny teacher (once: later runs reuse it): a %.1fM-parameter Qwen2 model trained "
             "for %d steps on %d documents of the sample corpus, %s; the time left is logged as it trains; into %s",
             sum(p.numel() for p in model.parameters()) / 1e6, spec.steps, len(texts), machine_note(), out_dir)
    eval_blocks = {k: pack_blocks(tokenizer, v, spec.block)[:32] for k, v in (eval_texts or {}).items()}
    before = {k: _mean_loss(model, b) for k, b in eval_blocks.items()}

    stamp = {"params": params}

    def write(work: Path) -> None:
        train_out = fit_blocks(model, blocks, work / "trainer", steps=spec.steps, batch_size=spec.batch_size,
                               learning_rate=spec.learning_rate, seed=spec.seed, what="tiny teacher")
        after = {k: _mean_loss(model, b) for k, b in eval_blocks.items()}
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        shutil.rmtree(work / "trainer", ignore_errors=True)
        stamp.update({
            "n_params": sum(p.numel() for p in model.parameters()),
            "train_tokens": spec.steps * spec.batch_size * spec.block,
            "final_train_loss": train_out.training_loss,
            "eval_loss_before": before,
            "eval_loss_after": after,
            "uniform_loss": math.log(len(tokenizer)),
            "seconds": round(time.perf_counter() - t0, 1),
            "threads": TRAIN_THREADS,
            "load_average": round(os.getloadavg()[0], 2),
        })
        (work / "_BUILD.json").write_text(json.dumps(stamp, indent=1) + "\n")

    build_folder(out_dir, write)
    log.info("tiny teacher built in %.0fs: %s", stamp["seconds"], stamp["eval_loss_after"])
    return out_dir


def machine_note() -> str:
    """How busy the machine is, for the build's first log line."""
    cores, load = usable_cores(), os.getloadavg()[0]
    note = f"in one torch thread (load average {load:.1f} on {cores} usable cores"
    return note + ("; the machine is busy, so this takes longer than on an idle core)" if load >= cores else ")")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class ProgressLog:
    """One log line per Trainer log in place of the Trainer's printed dicts: the step, the loss,
    the time so far and the time left at the pace measured so far (the Trainer's callback with
    ``TrainerCallback`` beside it, :func:`fit_blocks`)."""

    def __init__(self, what: str, clock=time.perf_counter):
        self.what = what
        self.clock = clock
        self.t0 = clock()

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = self.clock()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            spent = self.clock() - self.t0
            left = spent / max(state.global_step, 1) * (state.max_steps - state.global_step)
            log.info("%s: step %d of %d, training loss %.3f (%s so far, about %s left at this pace)", self.what,
                     state.global_step, state.max_steps, float(logs["loss"]), _duration(spent), _duration(left))


def fit_blocks(model, blocks: list[list[int]], work_dir: str | os.PathLike, *, steps: int, batch_size: int,
               learning_rate: float, seed: int, what: str = "training"):
    """Train a causal LM on fixed-length token blocks with the HF Trainer on the CPU, deterministically
    (cosine schedule, 5% warmup, no checkpoints); returns the Trainer's ``TrainOutput``. Progress is
    logged as ``<what>: step k of n`` lines, with the time left.

    One torch thread: the same weights whatever the machine's cores (thread counts change the
    rounding), and on a shared machine several times faster for a model this small than threads
    that wait on each other for cores other processes hold."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments, default_data_collator  # lazy: seconds to import; a config error is refused first

    class Progress(ProgressLog, TrainerCallback):  # the Trainer's other events do nothing
        pass

    dataset = [{"input_ids": b, "labels": b} for b in blocks]
    args = TrainingArguments(
        output_dir=str(work_dir),
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        weight_decay=0.01,
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to=[],
        seed=seed,
        data_seed=seed,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
                      callbacks=[Progress(what)])
    trainer.remove_callback(PrinterCallback)
    with torch_threads(TRAIN_THREADS):
        return trainer.train()
