"""Guided-loss overhead: one training step with :func:`pipeline.method.guided_loss.guided_loss` against
the same step with plain cross-entropy, same model, same batch.

A random-weight Llama student of tens of millions of parameters with the Llama-2 vocabulary size
(32,000), a fixed batch of packed sequences with a realistic teacher side (``L_t`` drawn per
token, ``unmapped_share`` of the positions unmapped). A step is forward, loss, backward, AdamW
step, ``zero_grad``; the two sides alternate on the same model (A B B A ...) and the figure is the
median of the per-repetition ratios of process CPU time, with torch on ``threads`` threads (one by
default: on a shared machine the CPU time of a single-threaded step is what it costs, while its
wall time depends on the neighbours; the wall-time ratio is reported too). The ratio does not
depend on the batch size: everything the guided loss adds is O(B T) or O(B T log B T), against the
O(B T V) of the cross-entropy and the O(B T N) of the model.

Both steps run the same model forward, the same backward through the model (the gradient that
reaches the logits differs in value, not in work) and the same optimizer step; they differ only
in the loss: its forward and its backward down to the logits. On a shared machine one step's CPU
time varies between repetitions by more than the effect being measured, so the figure is
computed from that difference, measured where it is large relative to the noise:

    ratio = 1 + (t_loss(guided) - t_loss(cross-entropy)) / t_step(cross-entropy)

with ``t_loss`` the loss's forward and backward on fixed logits of the step's shape and
``t_step`` a whole cross-entropy step, each the minimum over many interleaved repetitions (the
least disturbed run: interference only ever adds time). The directly measured step ratio (median
of the paired ratios of whole steps) and the median-based estimate are reported beside it.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from benchmarks.inputs import RandomModelShape
from benchmarks.measure import interleaved, ratio
from benchmarks.results import figure
from pipeline.runtime.config import check_at_least


def _student_shape() -> RandomModelShape:
    return RandomModelShape(hidden_size=256, num_layers=4, intermediate_size=688, num_heads=4, context=512)


@dataclass(frozen=True)
class GuidedLossBenchConfig:
    model: RandomModelShape = field(default_factory=_student_shape)
    vocab_size: int = 32000
    batch_size: int = 2
    seq_len: int = 128
    repeats: int = 15  # whole steps per side
    loss_repeats: int = 40  # loss forward+backward on fixed logits, per side
    warmup: int = 2
    threads: int = 1
    unmapped_share: float = 0.2
    seed: int = 0
    target: float = 1.02

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("batch_size", "seq_len", "repeats", "loss_repeats", "threads"):
            check_at_least(problems, name, getattr(self, name), 1)
        check_at_least(problems, "vocab_size", self.vocab_size, 2)
        check_at_least(problems, "warmup", self.warmup, 0)
        if not 0.0 <= self.unmapped_share < 1.0:
            problems.append(f"unmapped_share: {self.unmapped_share} is not in [0, 1)")
        return problems


def run(cfg: GuidedLossBenchConfig) -> dict:
    import torch
    import torch.nn.functional as F

    from benchmarks.inputs import build_model, count_parameters
    from pipeline.method.guided_loss import SelectionConfig, guided_loss

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        model = build_model(cfg.model, cfg.vocab_size).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        g = torch.Generator().manual_seed(cfg.seed)
        shape = (cfg.batch_size, cfg.seq_len)
        tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
        input_ids, labels = tokens[:, :-1], tokens[:, 1:]  # (B, T) each; the data is packed pre-shifted
        teacher_loss = torch.empty(shape).exponential_(generator=g)  # (B, T) L_t
        mapped = torch.rand(shape, generator=g) >= cfg.unmapped_share  # (B, T)
        teacher_loss[~mapped] = float("nan")
        selection = SelectionConfig()

        def step(loss_fn):
            logits = model(input_ids=input_ids).logits  # (B, T, V)
            loss = loss_fn(logits)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def plain_loss(logits):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

        def guided(logits):
            return guided_loss(logits, labels, teacher_loss, mapped, selection)[0]

        samples = interleaved({"cross_entropy": lambda: step(plain_loss), "guided": lambda: step(guided)},
                              cfg.repeats, cfg.warmup)

        logits = torch.randn(*shape, cfg.vocab_size, generator=g, requires_grad=True)

        def loss_only(loss_fn):
            loss_fn(logits).backward()
            logits.grad = None

        loss_samples = interleaved({"cross_entropy": lambda: loss_only(plain_loss), "guided": lambda: loss_only(guided)},
                                   cfg.loss_repeats, cfg.warmup)
        parameters = count_parameters(model)
    finally:
        torch.set_num_threads(threads)

    step_ratio = ratio(samples["guided"].cpu, samples["cross_entropy"].cpu)
    step_ratio_wall = ratio(samples["guided"].wall, samples["cross_entropy"].wall)
    step_ce = samples["cross_entropy"].to_dict()["median_cpu_s"]
    loss_extra = [g - c for g, c in zip(loss_samples["guided"].cpu, loss_samples["cross_entropy"].cpu)]
    result = {
        "student": {"parameters": parameters, "spec": asdict(cfg.model), "vocab_size": cfg.vocab_size,
                    "batch": list(shape), "threads": cfg.threads},
        "samples": {k: v.to_dict() for k, v in samples.items()},
        "loss_only_samples": {k: v.to_dict() for k, v in loss_samples.items()},
        "step_ratio": step_ratio,
        "step_ratio_wall": step_ratio_wall,
        "loss_only_ratio": ratio(loss_samples["guided"].cpu, loss_samples["cross_entropy"].cpu),
        "loss_only_extra_ms": 1e3 * statistics.median(loss_extra),
        "loss_only_extra_ms_quartiles": [1e3 * q for q in statistics.quantiles(loss_extra, n=4)],
    }
    loss_min = {k: min(v.cpu) for k, v in loss_samples.items()}
    step_min = min(samples["cross_entropy"].cpu)
    result["loss_only_min_ms"] = {k: 1e3 * v for k, v in loss_min.items()}
    result["estimated_step_ratio"] = 1 + (loss_min["guided"] - loss_min["cross_entropy"]) / step_min
    result["estimated_step_ratio_medians"] = 1 + statistics.median(loss_extra) / step_ce
    q1, _, q3 = result["loss_only_extra_ms_quartiles"]
    note = (f"CPU time, {parameters['total'] / 1e6:.0f}M-param random Llama student, batch {shape[0]}x{shape[1]}, "
            f"vocab {cfg.vocab_size:,}, {cfg.threads} thread(s): 1 + (guided {loss_min['guided'] * 1e3:.2f} ms - CE "
            f"{loss_min['cross_entropy'] * 1e3:.2f} ms, loss fwd+bwd, min of {cfg.loss_repeats}) / CE step "
            f"{1e3 * step_min:.0f} ms (min of {cfg.repeats}). Median-based: {result['estimated_step_ratio_medians']:.3f} "
            f"(paired loss differences {q1:+.1f}..{q3:+.1f} ms, quartiles); whole steps directly: "
            f"{step_ratio['median']:.3f} (spread {step_ratio['min']:.2f}-{step_ratio['max']:.2f}; ratio of minima "
            f"{step_ratio['of_minima']:.3f}; wall {step_ratio_wall['median']:.3f})")
    result["figures"] = [figure("guided_loss_overhead", "guided-loss overhead (guided step / cross-entropy step)",
                                result["estimated_step_ratio"], cfg.target, "<=", note=note,
                                details={"direct_step_ratio": step_ratio["median"]})]
    return result
