"""The bill before a training run (``make train-student ARGS="... plan=true"``): documents, student
tokens, packed samples and optimizer steps, from the configuration and the scored folders' manifests,
without loading the student model or counting every token.

* **Student tokens**: exact where the length cache (``data.cache_dir``) holds every shard's counts
  for this student tokenizer (what the count pass of a run writes); else estimated from a sample of
  documents spread evenly over the shards: their student tokens per teacher token (the teacher's
  count of every document is in the shards) times the teacher tokens every manifest records, with
  the ratio estimator's 95% error over the sampled documents.
* **Samples and steps**: as the run computes them (:mod:`pipeline.student_data.packing`): each document adds
  BOS (when the student's tokenizer adds one) and EOS, ``data.epochs`` passes are concatenated, a
  sample is ``seq_len`` tokens, a step ``micro_batch_size x processes x accumulation`` samples.
* **The first count's time**: the sample's student tokens per CPU-second of counting, spread over
  ``data.length_workers`` processes.

Reads the configuration and the folders only (one teacher's, several teachers': the first group).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig

from pipeline.student_data.held_out_shards import hold_out
from pipeline.student_data.several_teachers import group_folders
from pipeline.student_data.lengths import count_tokens, sample_documents_of
from pipeline.method.tokenization import bos_token_id, fingerprint, load_tokenizer
from pipeline.train_student.config import TrainJobConfig, batch_geometry
from pipeline.train_student.run import _cpu_threads, _on_gpu, _precision, load_student
from storage_schemas import filesystem as sfs
from storage_schemas.reader import ScoredDataset

SAMPLE_DOCUMENTS = 2000


@dataclass
class TrainPlan:
    """What :func:`plan_training` found; ``student_tokens_error`` is a share (0 when counted)."""

    folders: int
    shards: int
    documents: int
    teacher_tokens: int
    student_tokens: int
    counted: bool
    student_tokens_error: float
    sample_documents: int
    stream_tokens: int  # BOS/EOS and epochs included
    samples: int
    samples_per_step: int
    tokens_per_step: int
    steps_available: int
    steps: int | None  # what the run asks for (None: one pass)
    count_seconds: float | None  # estimated wall time of the first count with data.length_workers
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _cached_counts(cache_dir: str | None, tokenizer_sha: str, shards: list) -> list[np.ndarray] | None:
    """Every shard's counts from the length cache, or None when any is missing."""
    if not cache_dir:
        return None
    folder = Path(cache_dir) / tokenizer_sha[:16]
    out = []
    for s in shards:
        path = folder / f"{s.sha256}.npy"
        if not s.sha256 or not path.is_file():
            return None
        out.append(np.load(path))
    return out


def plan_training(job: TrainJobConfig, world_size: int = 1, sample_documents: int = SAMPLE_DOCUMENTS) -> TrainPlan:
    """The bill of the training run ``job`` (module docstring)."""
    t0 = time.perf_counter()
    d, t = job.data, job.train
    groups = group_folders(d.folders)
    opened = [ScoredDataset.open(f) for f in groups[0]]
    if d.held_out_shards:  # the shards the run never trains on, refused as the run refuses them
        firsts = hold_out([opened[0], *(ScoredDataset.open(g[0]) for g in groups[1:])], d.held_out_shards)
        opened[0] = firsts[0]
    shards = [s for o in opened for s in o.shards]
    entries = [e for o in opened for kept in [{sfs.name(s.path) for s in o.shards}]  # each folder's own
               for e in o.entries if sfs.name(e["file"]) in kept]
    documents = sum(int(e.get("rows", 0)) for e in entries)
    teacher_tokens = sum(int(e.get("tokens", 0)) for e in entries)
    tokenizer = load_tokenizer(job.student.tokenizer or job.student.model, revision=job.student.revision,
                               trust_remote_code=job.student.trust_remote_code)
    notes = []
    if len(groups) > 1:
        notes.append(f"{len(groups)} teachers: the first teacher's documents (the others match them)")
    cached = _cached_counts(d.cache_dir, fingerprint(tokenizer), shards)
    texts, teacher_counts = sample_documents_of(shards, sample_documents)
    c0 = time.process_time()
    student_counts = np.asarray(count_tokens(tokenizer, texts), dtype=np.float64)
    count_rate = student_counts.sum() / max(time.process_time() - c0, 1e-9)
    if cached is not None:
        student_tokens, error, counted = int(sum(int(c.sum()) for c in cached)), 0.0, True
        nonempty = int(sum(int((c > 0).sum()) for c in cached))
    else:
        ratio = student_counts.sum() / max(teacher_counts.sum(), 1.0)
        student_tokens, counted = int(round(ratio * teacher_tokens)), False
        residuals = student_counts - ratio * teacher_counts
        n = student_counts.size
        error = 1.96 * math.sqrt(residuals.var(ddof=1) / n) / max(teacher_counts.mean() * ratio, 1e-9) if n > 1 else 0.0
        nonempty = documents
        notes.append(f"student tokens estimated from {n:,} documents of {len(shards):,} shard(s)")
    add_bos = d.add_bos if d.add_bos is not None else bos_token_id(tokenizer) is not None
    stream = (student_tokens + nonempty * (int(add_bos) + int(d.add_eos))) * d.epochs
    samples = max(0, (stream - 1) // job.student.seq_len)
    accumulation, tokens_per_step = batch_geometry(job, world_size)
    per_step = t.micro_batch_size * world_size * accumulation
    available = samples // per_step
    steps = t.max_steps if t.max_steps is not None else (
        math.ceil(t.max_tokens / tokens_per_step) if t.max_tokens is not None else None)
    count_seconds = None if counted else student_tokens / count_rate / max(1, d.length_workers)
    return TrainPlan(folders=len(d.folders), shards=len(shards), documents=documents, teacher_tokens=teacher_tokens,
                     student_tokens=student_tokens, counted=counted, student_tokens_error=error,
                     sample_documents=int(student_counts.size), stream_tokens=stream, samples=samples,
                     samples_per_step=per_step, tokens_per_step=tokens_per_step, steps_available=available,
                     steps=steps, count_seconds=count_seconds, seconds=time.perf_counter() - t0, notes=notes)


MEASURE_STEP_FLOP = {"cpu": 1e12, "cuda": 2e15}  # plan_measure unset: a step up to this many FLOPs is timed


def step_flop(job: TrainJobConfig, world_size: int = 1) -> float | None:
    """About 6 x parameters x tokens per optimizer step of this process (forward and backward),
    the parameters from the student's config (None: it does not say)."""
    try:
        c = AutoConfig.from_pretrained(job.student.model, revision=job.student.revision,
                                       trust_remote_code=job.student.trust_remote_code)
    except Exception:  # noqa: BLE001 - the run's own checks have passed; a config it cannot read is just not sized
        return None
    h, layers = getattr(c, "hidden_size", None), getattr(c, "num_hidden_layers", None)
    if not h or not layers:
        return None
    params = layers * (4 * h * h + 3 * h * (getattr(c, "intermediate_size", None) or 4 * h)) + 2 * (getattr(c, "vocab_size", 0) or 0) * h
    accumulation, _ = batch_geometry(job, world_size)
    return 6.0 * params * job.train.micro_batch_size * job.student.seq_len * accumulation


def measure_decision(job: TrainJobConfig, measure: bool | None, world_size: int = 1) -> tuple[bool, str]:
    """Whether the bill times the student's steps here, and why (``plan_measure``; unset: when one
    step is at most :data:`MEASURE_STEP_FLOP` of this device, a few seconds)."""
    if measure is not None:
        return bool(measure), f"plan_measure={str(bool(measure)).lower()}"
    flop = step_flop(job, world_size)
    if flop is None:
        return False, "the student's config gives no size"
    device = "cuda" if torch.cuda.is_available() and not job.train.use_cpu else "cpu"
    if flop > MEASURE_STEP_FLOP[device]:
        return False, f"one step is about {flop:.2g} FLOPs, too many to time on {device} just to plan"
    return True, f"one step is about {flop:.2g} FLOPs"


def measure_steps(job: TrainJobConfig, steps: int = 3) -> dict:
    """Seconds per optimizer step of the actual student on this machine's device: the model loaded
    as the run loads it, micro-batches of random token ids of ``seq_len``, forward, a cross-entropy
    over every position, backward, and AdamW every ``accumulation`` micro-batches, in the run's
    precision and CPU threads; one untimed step, then ``steps`` timed. Data loading, alignment,
    evaluation and checkpoints are not in it."""
    accumulation, _ = batch_geometry(job, 1)
    device = torch.device("cuda" if _on_gpu(job.train) else "cpu")
    precision = _precision(job.train)
    dtype = torch.bfloat16 if precision["bf16"] else torch.float16 if precision["fp16"] else None
    with _cpu_threads(job.train.cpu_threads):
        t0 = time.perf_counter()
        model = load_student(job.student, 0).to(device)
        load_s = time.perf_counter() - t0
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        vocab = model.get_input_embeddings().weight.shape[0]
        generator = torch.Generator().manual_seed(0)
        shape = (job.train.micro_batch_size, job.student.seq_len)

        def step() -> None:
            for _ in range(accumulation):
                ids = torch.randint(0, vocab, shape, generator=generator).to(device)
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    logits = model(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
                (loss / accumulation).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()

        step()  # warm-up: not timed
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = (time.perf_counter() - t0) / steps
        threads = torch.get_num_threads()
    return {"step_s": seconds, "steps": steps, "load_s": load_s, "device": device.type, "threads": threads,
            "precision": "bf16" if precision["bf16"] else "fp16" if precision["fp16"] else "fp32"}
