"""Stage-1 pipeline overhead: the whole ``score-teacher`` job against a bare forward of its teacher.

The teacher is a random-weight Llama-architecture model of tens of millions of parameters built
from a config, with a real 32k vocabulary (Mistral-7B's SentencePiece, as Mistral-ProXMath) saved
alongside, so :func:`pipeline.score_teacher.job.run_score_job` loads it by path like any checkpoint. The
corpus is the first ``n_docs`` documents of the sample corpus (noise and bad rows included).

Sides, interleaved, compared by wall time (the job runs in other processes):

* ``job``: :func:`run_score_job` into a fresh folder, Ray started and stopped by the job itself,
  one actor with ``num_cpus`` CPUs (torch threads = ``num_cpus``): everything a user waits for;
* ``forward``: in this process, with the same number of torch threads, the same model
  (``load_causal_lm``) over exactly the batches the job's actor forms (per shard: the teacher's
  windows of the shard's documents grouped by ``batches_by_tokens``, right-padded): the backbone
  on the padded batch, then the output head on every real (non-padding) position, in chunks of
  the scorer's ``max_logits_bytes`` (a plain ``model(...)`` would also compute logits of padding
  and hold a ``(B, T, V)`` block of gigabytes, which no scorer does). No log-softmax, no loss:
  the teacher's arithmetic and nothing else. Tokenization and window planning happen before timing.

* ``scorer``: the same batches through :class:`pipeline.score_teacher.backends.hf.TransformersScorer` in this
  process: the backend alone, to split the job's overhead into the scorer's loss arithmetic and
  everything else (Ray, reading, tokenization, windows, Parquet).

Tokens are the stored teacher tokens on both sides (the same documents, the same count). Ratios:

* *steady state* (the figure): the forward's cost for shards 2..K over the job's cost between the
  completion markers of shard 1 and shard K on disk (``mtime``): every per-shard cost of the job
  (reading, tokenizing, windows, the scorer's float32 log-softmax, stitching, Parquet writing,
  fsync, sha256, markers, the driver round trip) and none of the one-off start-up. Cost is CPU
  seconds: of this process for the forward, of the job's whole process tree (driver, raylet, GCS,
  actor: :class:`benchmarks.measure.TreeCpuSampler`) for the job. On a machine shared with
  other work, wall time across processes swings widely between repetitions; CPU seconds do not.
  The wall-time ratio is reported beside it, and the actor's CPU alone;
* *whole job*: forward wall seconds / job wall seconds: includes the start-up (Ray, actor, loading
  the teacher), a constant that a 15B-token run amortises.
"""

from __future__ import annotations

import os
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.inputs import REAL_TOKENIZERS, RandomModelShape
from benchmarks.measure import interleaved, ratio
from benchmarks.results import figure
from pipeline.runtime.config import check_at_least, check_choice


@dataclass(frozen=True)
class Stage1BenchConfig:
    n_docs: int = 24
    rows_per_shard: int = 4
    seed: int = 0
    teacher_tokenizer: str = "mistral"  # Mistral-7B's 32k SentencePiece (as Mistral-ProXMath)
    model: RandomModelShape = field(default_factory=RandomModelShape)
    model_dir: str | None = None  # a model folder to time instead of the random model (a real teacher's,
    # with its own tokenizer: the folder convert-teacher writes of SmolLM2-135M, window=2048 stride=1024)
    window: int = 512
    stride: int = 384
    max_batch_tokens: int = 16384
    num_cpus: int = 2
    repeats: int = 3
    scorer_side: bool = True
    target: float = 0.95

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("n_docs", "rows_per_shard", "window", "stride", "max_batch_tokens", "num_cpus", "repeats"):
            check_at_least(problems, name, getattr(self, name), 1)
        if self.stride > self.window:
            problems.append(f"stride: {self.stride} is more than window {self.window}")
        check_choice(problems, "teacher_tokenizer", self.teacher_tokenizer, REAL_TOKENIZERS)
        return problems


def run(cfg: Stage1BenchConfig, work_dir: str | os.PathLike, tokenizer) -> dict:
    import torch

    from benchmarks.inputs import model_parameters, random_causal_lm, sample_corpus

    work = Path(work_dir) / "stage1"
    if cfg.model_dir:
        model_dir = Path(cfg.model_dir).resolve()
    else:
        model_dir = random_causal_lm(work / f"teacher-{_shape_slug(cfg.model)}-{cfg.teacher_tokenizer}", cfg.model,
                                     tokenizer)
    corpus = sample_corpus(work, cfg.n_docs, cfg.seed)
    forward = _BareForward(cfg, model_dir, corpus)
    out_dir = work / "scored"
    job_info: list[dict] = []

    def job():
        job_info.append(_run_job(cfg, model_dir, corpus, out_dir))

    sides = {"job": job, "forward": forward.run}
    if cfg.scorer_side:
        sides["scorer"] = forward.run_scorer

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_cpus)
    try:
        forward.run()  # warm-up: the job's first shard warms its actor the same way (excluded from steady)
        forward.timings.clear()
        samples = interleaved(sides, cfg.repeats, warmup=0)
    finally:
        torch.set_num_threads(threads)

    tokens = job_info[0]["tokens"]
    if tokens != forward.tokens:
        raise RuntimeError(f"the job stored {tokens} teacher tokens, the bare forward saw {forward.tokens}")
    whole = ratio(samples["forward"].wall, samples["job"].wall)
    steady_forward = {clock: [sum(t[clock][1:]) for t in forward.timings["forward"]] for clock in ("wall", "cpu")}
    steady = None
    if all(info["steady_s"] > 0 for info in job_info):
        steady = {
            "cpu_tree": ratio(steady_forward["cpu"], [info["steady_cpu_tree_s"] for info in job_info]),
            "cpu_actor": ratio(steady_forward["cpu"], [info["steady_cpu_actor_s"] for info in job_info]),
            "wall": ratio(steady_forward["wall"], [info["steady_s"] for info in job_info]),
        }
        if "scorer" in forward.timings:
            steady["scorer_vs_forward_cpu"] = ratio(
                steady_forward["cpu"], [sum(t["cpu"][1:]) for t in forward.timings["scorer"]])
        if "scorer" in forward.timings:  # the job against the backend alone: Ray, I/O, tokenization, windows
            steady["job_vs_scorer_cpu"] = ratio([sum(t["cpu"][1:]) for t in forward.timings["scorer"]],
                                                [info["steady_cpu_tree_s"] for info in job_info])
    startup = [j - s for j, s in zip(samples["job"].wall, _in_job_work(job_info, forward))]
    result = {
        "teacher": {"parameters": model_parameters(model_dir),
                    **({"model_dir": str(model_dir)} if cfg.model_dir else
                       {"spec": asdict(cfg.model), "tokenizer": cfg.teacher_tokenizer}),
                    "window": cfg.window, "stride": cfg.stride},
        "corpus": {"documents": cfg.n_docs, "shards": len(forward.shards), "teacher_tokens": tokens,
                   "windows": forward.n_windows, "padded_tokens": forward.padded_tokens},
        "samples": {k: v.to_dict() for k, v in samples.items()},
        "in_process_shard_timings": forward.timings,
        "jobs": job_info,
        "whole_job": whole,
        "steady_state": steady,
        "tokens_per_s": {
            "forward": tokens / statistics.median(samples["forward"].wall),
            "job_whole": tokens / statistics.median(samples["job"].wall),
        },
        "startup_s_estimate": statistics.median(startup),
    }
    result["figures"] = [_figure(cfg, result)]
    if steady and "job_vs_scorer_cpu" in steady:
        v = steady["job_vs_scorer_cpu"]
        result["figures"].append(figure(
            "stage1_overhead_vs_scorer", "stage-1 job / its scorer alone in-process (Ray, I/O, tokenization, windows)",
            v["median"], cfg.target, ">=",
            note=f"CPU seconds, steady state as above; spread {v['min']:.3f}-{v['max']:.3f}: what the job adds to "
                 f"TransformersScorer.score over the same windows (the scorer's float32 log-softmax counted as teacher "
                 f"work)"))
    return result


def _figure(cfg: Stage1BenchConfig, r: dict) -> dict:
    steady, whole = r["steady_state"], r["whole_job"]
    p = r["teacher"]["parameters"]
    value = steady["cpu_tree"]["median"] if steady else None
    tokens = r["corpus"]["teacher_tokens"]
    teacher = (f"{p['total'] / 1e6:.0f}M-param teacher {Path(cfg.model_dir).name}" if cfg.model_dir else
               f"{p['total'] / 1e6:.0f}M-param random Llama teacher ({cfg.teacher_tokenizer} 32k vocab, "
               f"{cfg.model.num_layers}x{cfg.model.hidden_size})")
    note = (f"{teacher}, window {cfg.window} stride {cfg.stride}, {r['corpus']['documents']} docs, {tokens:,} teacher "
            f"tokens, {r['corpus']['shards']} shards, 1 Ray actor x {cfg.num_cpus} CPUs vs {cfg.num_cpus} torch "
            f"threads in-process; bare forward {r['tokens_per_s']['forward']:,.0f} tokens/s (wall). ")
    if steady:
        note += (f"Steady state (shards 2..K), CPU seconds of the job's process tree: {value:.3f} (spread "
                 f"{steady['cpu_tree']['min']:.3f}-{steady['cpu_tree']['max']:.3f}, {steady['cpu_tree']['repeats']} reps); "
                 f"actor alone {steady['cpu_actor']['median']:.3f}; wall time {steady['wall']['median']:.3f} (spread "
                 f"{steady['wall']['min']:.2f}-{steady['wall']['max']:.2f})")
        if "scorer_vs_forward_cpu" in steady:
            note += f"; the scorer alone in-process: {steady['scorer_vs_forward_cpu']['median']:.3f} of the bare forward"
        by_process = _median_by_process([info["steady_cpu_by_process"] for info in r["jobs"]])
        note += "; steady CPU s by process: " + ", ".join(f"{k} {v:.1f}" for k, v in by_process.items())
    note += (f". Whole job with start-up, wall: {whole['median']:.3f} (start-up ~{r['startup_s_estimate']:.0f} s: Ray, "
             f"actor, teacher load; under 5% of a job's time beyond ~{_amortised_tokens(r):,.0f} tokens at this speed)")
    return figure("stage1_overhead", "stage-1 pipeline overhead (job tokens/s / bare forward tokens/s)", value,
                  cfg.target, ">=", note=note,
                  details={"whole_job_wall": whole["median"], "steady_wall": steady["wall"]["median"] if steady else None})


def _median_by_process(records: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({k for r in records for k in r}, key=lambda k: -max(r.get(k, 0.0) for r in records))
    return {k: statistics.median([r.get(k, 0.0) for r in records])
            for k in names if max(r.get(k, 0.0) for r in records) >= 0.05}


def _amortised_tokens(r: dict) -> float:
    """Tokens after which the start-up is 5% of the job's time (steady-state speed)."""
    steady = r["steady_state"]["wall"]["median"] if r["steady_state"] else r["whole_job"]["median"]
    job_tokens_per_s = r["tokens_per_s"]["forward"] * steady
    return 19 * r["startup_s_estimate"] * job_tokens_per_s  # S / (S + T) = 0.05


def _in_job_work(job_info: list[dict], forward: "_BareForward") -> list[float]:
    """Seconds of per-shard work inside each job: steady time plus shard 1 at the steady rate."""
    out = []
    for info in job_info:
        steady_tokens = sum(forward.shard_tokens[1:])
        rate = steady_tokens / info["steady_s"] if info["steady_s"] > 0 and steady_tokens else None
        out.append(info["steady_s"] + (forward.shard_tokens[0] / rate if rate else 0.0))
    return out


def _shape_slug(shape: RandomModelShape) -> str:
    return (f"h{shape.hidden_size}-l{shape.num_layers}-i{shape.intermediate_size}-a{shape.num_heads}"
            f"-c{shape.context}-s{shape.seed}")


def _run_job(cfg: Stage1BenchConfig, model_dir: Path, corpus: list[Path], out_dir: Path) -> dict:
    from benchmarks.measure import TreeCpuSampler
    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.corpus import CorpusConfig
    from pipeline.score_teacher.pool import PoolConfig
    from pipeline.score_teacher.ray_cluster import RayConfig
    from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
    from pipeline.score_teacher.job import run_score_job
    from pipeline.score_teacher.writer import finished_shards

    shutil.rmtree(out_dir, ignore_errors=True)
    with TreeCpuSampler(os.getpid(), interval=0.25) as cpu:
        summary = run_score_job(ScoreJobConfig(
        teacher=TeacherConfig(name="bench", model=str(model_dir), window=cfg.window, stride=cfg.stride),
        corpus=CorpusConfig(name="bench", files=[str(f) for f in corpus], rows_per_shard=cfg.rows_per_shard),
        scorer=ScorerConfig(dtype="float32", device="cpu", max_batch_tokens=cfg.max_batch_tokens),
            output_dir=str(out_dir),
            ray=RayConfig(num_cpus=cfg.num_cpus),
            pool=PoolConfig(num_actors=1, num_cpus=cfg.num_cpus, num_gpus=0),
            progress=False,
        ))
    done = finished_shards(out_dir)
    completion = sorted(os.stat(out_dir / f"shard-{i:06d}.done.json").st_mtime_ns / 1e9 for i in sorted(done))
    t0, t1 = completion[0], completion[-1]
    actor, actor_cmd = cpu.busiest(t0, t1)
    return {"tokens": summary.tokens_this_run, "documents": summary.documents_this_run, "seconds": summary.seconds,
            "shards": summary.shards_scored, "complete": summary.complete, "steady_s": t1 - t0,
            "steady_cpu_tree_s": cpu.cpu_between(t0, t1), "steady_cpu_actor_s": cpu.cpu_between(t0, t1, actor),
            "actor": actor_cmd, "job_cpu_tree_s": cpu.cpu_between(cpu.times[0], cpu.times[-1]),
            "steady_cpu_by_process": _by_process(cpu, t0, t1),
            "processes": len(cpu.series), "bytes": sum(e["bytes"] for e in done.values())}


def _by_process(cpu, t0: float, t1: float) -> dict[str, float]:
    """Steady-window CPU seconds per kind of process (the bench's own process is the driver)."""
    out: dict[str, float] = {}
    for pid in cpu.series:
        name = "driver (this process)" if pid == os.getpid() else _process_kind(cpu.names.get(pid, "?"))
        out[name] = out.get(name, 0.0) + cpu.cpu_between(t0, t1, pid)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _process_kind(cmd: str) -> str:
    for key in ("ShardScorer", "raylet", "gcs_server", "DashboardAgent", "dashboard", "log_monitor", "monitor",
                "runtime_env", "IDLE"):
        if key in cmd:
            return key
    return cmd.split("/")[-1][:30]


class _BareForward:
    """The teacher's forward passes over exactly the batches the job's actor forms, per shard."""

    def __init__(self, cfg: Stage1BenchConfig, model_dir: Path, corpus: list[Path]):
        from pipeline.score_teacher.backends.base import ScorerConfig
        from pipeline.score_teacher.backends.hf import (
            batches_by_tokens,
            head_chunk_positions,
            load_causal_lm,
            resolve_device,
        )
        from pipeline.score_teacher.corpus import CorpusConfig
        from pipeline.score_teacher.shards import plan_shards, read_shard
        from pipeline.score_teacher.corpus_sources import resolve_sources
        from pipeline.score_teacher.teacher import classify
        from pipeline.method.tokenization import bos_token_id, encode_batch, load_tokenizer
        from pipeline.method.windows import plan_windows
        from storage_schemas import SKIP_REASONS, ZERO_TOKEN_REASONS

        self.cfg = cfg
        corpus_cfg = CorpusConfig(name="bench", files=[str(f) for f in corpus], rows_per_shard=cfg.rows_per_shard)
        self.shards = plan_shards(resolve_sources(corpus_cfg), cfg.rows_per_shard)
        tokenizer = load_tokenizer(str(model_dir))
        bos = bos_token_id(tokenizer)
        scorer_cfg = ScorerConfig(model=str(model_dir), dtype="float32", device="cpu", window=cfg.window,
                                  max_batch_tokens=cfg.max_batch_tokens)
        self.model = load_causal_lm(scorer_cfg, resolve_device("cpu"))
        self.backbone = self.model.base_model
        self.head = self.model.get_output_embeddings()
        self.chunk = head_chunk_positions(int(self.head.weight.shape[0]), scorer_cfg.max_logits_bytes)
        self.batches: list[list[tuple[np.ndarray, np.ndarray]]] = []  # per shard: (ids, mask) per batch
        self.windows: list[list[np.ndarray]] = []  # per shard: the windows, for the scorer side
        self.shard_tokens: list[int] = []
        self.n_windows = self.padded_tokens = 0
        for spec in self.shards:
            docs = [d for d in read_shard(spec) if classify(d) not in SKIP_REASONS + ZERO_TOKEN_REASONS]
            encodings = encode_batch(tokenizer, [d.text for d in docs])
            self.shard_tokens.append(sum(len(e) for e in encodings))
            prefix = np.asarray([bos] if bos is not None else [], dtype=np.int64)
            windows = []
            for enc in encodings:
                z = np.concatenate([prefix, enc.ids.astype(np.int64)])
                windows += [z[w.start : w.stop] for w in plan_windows(len(z), cfg.window, cfg.stride)]
            shard_batches = []
            for group in batches_by_tokens([len(w) for w in windows], cfg.max_batch_tokens):
                width = max(len(windows[i]) for i in group)
                ids = np.zeros((len(group), width), dtype=np.int64)  # (B, T)
                mask = np.zeros((len(group), width), dtype=np.int64)  # (B, T)
                for b, i in enumerate(group):
                    ids[b, : len(windows[i])] = windows[i]
                    mask[b, : len(windows[i])] = 1
                shard_batches.append((ids, mask))
                self.padded_tokens += ids.size
            self.n_windows += len(windows)
            self.batches.append(shard_batches)
            self.windows.append(windows)
        self.tokens = sum(self.shard_tokens)
        self.scorer_cfg = scorer_cfg
        # side -> one {"wall": [per shard], "cpu": [per shard]} per repetition
        self.timings: dict[str, list[dict[str, list[float]]]] = {}

    def _timed_shards(self, side: str, fn) -> None:
        import time

        record = {"wall": [], "cpu": []}
        for k in range(len(self.batches)):
            w0, c0 = time.perf_counter(), time.process_time()
            fn(k)
            record["wall"].append(time.perf_counter() - w0)
            record["cpu"].append(time.process_time() - c0)
        self.timings.setdefault(side, []).append(record)

    def run_scorer(self) -> None:
        from pipeline.score_teacher.backends.hf import TransformersScorer

        scorer = TransformersScorer(self.scorer_cfg, model=self.model)
        self._timed_shards("scorer", lambda k: scorer.score(self.windows[k]))

    def run(self) -> None:
        import torch

        @torch.inference_mode()
        def shard(k: int) -> None:
            for ids, mask in self.batches[k]:
                ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
                hidden = self.backbone(input_ids=ids_t, attention_mask=mask_t).last_hidden_state  # (B, T, H)
                h = hidden[mask_t.bool()]  # (N, H) real positions
                for lo in range(0, h.shape[0], self.chunk):
                    self.head(h[lo : lo + self.chunk])  # (C, V)

        self._timed_shards("forward", shard)
