"""Stage 2's data: the scored folders, a mixture of corpora or an export opened and planned as packed
samples (:func:`prepare_data`, docs/METHOD.md §2.4), the held-out documents of the evaluation while
training (:func:`held_out_texts`), and the token budget: a length the scored data cannot hold is
refused before the token count (:func:`check_token_budget`), and the number of optimizer steps
checked against the packed data after it (:func:`number_of_steps`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from pipeline.folders.rehearsal import refuse_rehearsal, warn_rehearsal
from pipeline.method.bits_per_byte import shard_documents, text_file_documents
from pipeline.runtime.config import ConfigError
from pipeline.student_data.held_out_shards import held_out_entries, hold_out
from pipeline.student_data.several_teachers import open_teachers
from pipeline.student_data.build import StudentData, build_student_data
from pipeline.student_data.lengths import student_per_teacher_token
from pipeline.student_data.settings import PackingConfig
from pipeline.train_student.config import TrainJobConfig
from pipeline.train_student.from_export import ExportData, open_export_data
from pipeline.train_student.mixture import CorpusData, MixtureData, build_mixture
from storage_schemas.reader import ScoredDataset, ScoredFolder

log = logging.getLogger(__name__)


def prepare_data(job: TrainJobConfig, tokenizer, check=None) -> StudentData | MixtureData | ExportData:
    """Open the scored folders, run ``check(scored)`` (before the token count), count and plan; or
    mix the corpora of ``data.mixture`` (:func:`prepare_mixture`), or read ``data.export``
    (:mod:`pipeline.train_student.from_export`)."""
    d = job.data
    if d.mixture:
        return prepare_mixture(job, tokenizer)
    if d.export:  # the rows are read as they were exported: nothing is counted, tokenized or aligned
        return open_export_data(d.export, tokenizer, job.student.seq_len, d, job.alignment)
    scored = open_teachers(d.folders, on_bad_shard=d.on_bad_shard, verify=d.verify, allow_partial=d.allow_partial)
    warn_rehearsal(refuse_rehearsal(scored, d.allow_rehearsal))
    scored = hold_out(scored, d.held_out_shards)
    if check is not None:
        check(scored)
    return build_student_data(scored, tokenizer, packing_config(job), job.alignment, cache_dir=d.cache_dir,
                              num_proc=d.length_workers, on_bad_shard=d.on_bad_shard,
                              missing_documents=d.missing_documents)


def prepare_mixture(job: TrainJobConfig, tokenizer) -> MixtureData:
    """Each corpus of ``data.mixture`` packed as a single-corpus run of its folders would be, with
    its own passes (``epochs``, else ``data.epochs``), then mixed (:mod:`pipeline.train_student.mixture`).
    ``data.held_out_shards`` holds shards of the first corpus out."""
    corpora = []
    for i, corpus in enumerate(job.data.mixture):
        epochs = corpus.epochs or job.data.epochs
        one = replace(job.data, folders=list(corpus.folders), epochs=epochs, mixture=None, export=corpus.export,
                      held_out_shards=job.data.held_out_shards if i == 0 else 0)
        log.info("corpus %s of the mixture (weight %g, at most %d pass(es))", corpus.name, corpus.weight, epochs)
        corpora.append(CorpusData(corpus.name, corpus.weight, epochs, prepare_data(replace(job, data=one), tokenizer)))
    return build_mixture(corpora, job.data.seed, job.student.seq_len)


def held_out_texts(job: TrainJobConfig, data: StudentData) -> list[str] | None:
    """The documents ``train.eval_every`` measures bits per byte on (None: no evaluation): those of
    ``train.eval_texts``, else of the shards ``data.held_out_shards`` holds out, at most
    ``train.eval_max_documents``, empty ones left out."""
    t = job.train
    if t.eval_every is None:
        return None
    if t.eval_texts:
        texts = [text for path in t.eval_texts for text in text_file_documents(path) if text]
        where = f"train.eval_texts ({', '.join(t.eval_texts)})"
    else:
        folder = held_out_folder(job, data)
        files = [e["file"] for e in held_out_entries(folder, job.data.held_out_shards)]
        texts = shard_documents(ScoredDataset.open(folder.path), files, t.eval_max_documents)
        where = f"the held-out shards of {folder.path} ({', '.join(files)})"
    if not texts:
        raise ConfigError(f"train.eval_every: {where} hold no document to evaluate on")
    return texts[: t.eval_max_documents]


def held_out_folder(job: TrainJobConfig, data) -> ScoredFolder:
    """The scored folder whose last ``data.held_out_shards`` shards are held out: the first the run
    reads, or for an export (which holds them out too, and records them) the first of
    ``data.folders`` (of the first corpus of a mixture), whose held-out shards it must equal."""
    if data.scored is not None:
        return data.scored.folders[0]
    folders = job.data.mixture[0].folders if job.data.mixture else job.data.folders
    if not folders:
        raise ConfigError("train.eval_every: the held-out text of an export is read from its scored folders; give "
                          "them (data.folders=[...], as the export's), evaluate on text files (train.eval_texts=[...]) "
                          "or not at all (train.eval_every=null)")
    return ScoredDataset.open(folders[0]).folders[0]


def packing_config(job: TrainJobConfig) -> PackingConfig:
    d = job.data
    return PackingConfig(seq_len=job.student.seq_len, seed=d.seed, shuffle=d.shuffle, epochs=d.epochs,
                         add_bos=d.add_bos, add_eos=d.add_eos)


# The bound's margin over the student-per-teacher-token ratio of a sample of documents
SAMPLED_RATIO_MARGIN = 1.25


def check_token_budget(job: TrainJobConfig, scored, world_size: int, accumulation: int, tokenizer=None) -> None:
    """Refuse, before the token count, a run asking for more optimizer steps than the scored data
    can possibly give.

    The student's token count is not known before the count pass, so it is bounded from the
    teacher's, which every manifest records per shard: at most ``data.token_ratio_bound``
    student tokens per teacher token, or, with the student's ``tokenizer``, 1.25 times the ratio
    on a sample of documents where that is more (a small student vocabulary against a large
    teacher's: stories260K's 512 tokens give 1.9 per SmolLM2 token on real mathematics), plus BOS
    and EOS per document, times ``data.epochs``. A run that passes may still be refused after the
    count (:func:`number_of_steps`), with the exact numbers. Shards whose manifest entry records
    no token count leave the check out.
    """
    t, d = job.train, job.data
    samples_per_step = t.micro_batch_size * world_size * accumulation
    tokens_per_step = samples_per_step * job.student.seq_len
    if t.max_steps is not None:
        asked, what = t.max_steps, f"train.max_steps {t.max_steps:,}"
    elif t.max_tokens is not None:
        asked, what = math.ceil(t.max_tokens / tokens_per_step), f"train.max_tokens {t.max_tokens:,}"
    else:
        return  # one pass over whatever the data holds
    # Several teachers: with missing_documents=refuse every teacher holds the same documents, so the
    # largest teacher count bounds the stream; with unmapped the stream is at most their union (the sum).
    teachers = scored if isinstance(scored, list) else [scored]
    counts = [_recorded_tokens(one) for one in teachers]
    if any(c is None for c in counts):
        log.warning("a manifest records no token count for some shard: the length is checked after the token count")
        return
    pick = max if d.missing_documents == "refuse" else lambda cs: tuple(map(sum, zip(*cs)))
    teacher_tokens, documents = pick(counts)
    n_shards = sum(len(one.shards) for one in teachers)
    ratio, why = d.token_ratio_bound, "data.token_ratio_bound"

    def steps_at_most(ratio: float) -> tuple[int, int]:
        per_pass = math.floor(teacher_tokens * ratio) + 2 * documents  # stream tokens, at most
        return per_pass, max(0, (per_pass * d.epochs - 1) // job.student.seq_len) // samples_per_step

    per_pass, bound = steps_at_most(ratio)
    if asked <= bound:
        return
    # Only a run the fixed bound would refuse reads a sample (the sampled ratio can only raise it):
    # the usual run reads nothing before its token count.
    sampled = student_per_teacher_token(teachers[0].shards, tokenizer) if tokenizer is not None else None
    if sampled is not None and SAMPLED_RATIO_MARGIN * sampled > ratio:
        ratio, why = SAMPLED_RATIO_MARGIN * sampled, f"{SAMPLED_RATIO_MARGIN} x {sampled:.2f} on a sample of documents"
        per_pass, bound = steps_at_most(ratio)
        if asked <= bound:
            return
    epochs = math.ceil((asked * samples_per_step * job.student.seq_len + 1) / per_pass)
    fewer = (f"train.max_tokens={bound * tokens_per_step} or less (or train.max_steps={bound}, or neither: one pass)"
             if bound else "a smaller global batch")
    raise ConfigError(
        f"{what} asks for {asked:,} optimizer steps of {tokens_per_step:,} tokens ({asked * tokens_per_step:,} "
        f"tokens); the scored data holds {teacher_tokens:,} teacher tokens in {n_shards} shard(s), at most "
        f"{per_pass:,} student tokens per pass (<= {ratio:.3g} per teacher token, {why}, "
        f"plus BOS/EOS per document) x {d.epochs} pass(es): at most {bound:,} steps. Ask for {fewer}, or for "
        f"data.epochs={epochs} or more, or score more data."
    )


def _recorded_tokens(scored) -> tuple[int, int] | None:
    """(teacher tokens, documents) of one teacher's opened folders from their manifests; None when
    some shard's entry records no token count."""
    entries = {(i, e.get("file")): e for i, f in enumerate(scored.folders) for e in f.manifest.get("shards", [])}
    recorded = [entries.get((s.folder, str(s.path).replace("\\", "/").rsplit("/", 1)[-1]), {}).get("tokens")
                for s in scored.shards]
    if any(not isinstance(n, int) for n in recorded):
        return None
    return sum(recorded), sum(s.rows for s in scored.shards)


def number_of_steps(job: TrainJobConfig, data: StudentData, world_size: int, accumulation: int,
                     tokens_per_step: int) -> int:
    samples_per_step = job.train.micro_batch_size * world_size * accumulation
    available = data.plan.n_samples // samples_per_step
    log.info("the packed data (%d pass(es)): %d samples, %d optimizer steps of %d tokens", job.data.epochs,
             data.plan.n_samples, available, tokens_per_step)
    if job.train.max_steps is not None:
        steps = job.train.max_steps
    elif job.train.max_tokens is not None:
        steps = math.ceil(job.train.max_tokens / tokens_per_step)
    else:
        steps = available
    if isinstance(data, MixtureData):  # names the corpus that runs out
        data.check_length(steps * samples_per_step, samples_per_step)
    if steps < 1 or steps > available:
        raise ConfigError(
            f"{steps} optimizer steps asked for, the data gives {available}: {data.plan.n_samples} packed samples "
            f"of {job.student.seq_len} tokens, {samples_per_step} samples per step ({tokens_per_step} tokens). "
            f"Ask for fewer steps (train.max_tokens={available * tokens_per_step} or train.max_steps={available}), "
            "a smaller batch, or more passes (data.epochs)."
        )
    return steps
