"""The teacher-guided loss of one (micro-)batch, for any trainer (docs/METHOD.md §2.2, §2.3).

Needs torch only. Give it, per position, what the student predicts and what the teacher thought of
the same target; it returns the loss to back-propagate and the statistics of the selection::

    from pipeline.method.guided_loss import SelectionConfig, guided_loss

    loss, stats = guided_loss(logits, labels, teacher_loss)           # (B, T, V), (B, T), (B, T)
    loss, stats = guided_loss(per_token_ce, labels, teacher_loss)      # or the student's (B, T) losses

* ``logits`` (B, T, V) or the student's per-token cross-entropy ``l_s`` (B, T); position ``t``
  predicts ``labels[:, t]`` (no shift here: shift before calling, as ``logits[:, :-1]`` against
  ``labels[:, 1:]``), ``-100`` where ignored (or give ``valid``, a (B, T) bool mask, instead).
* ``teacher_loss`` (B, T): the teacher's loss ``L_t`` of each target, aligned to the student's tokens
  (``make export-student`` writes it beside the token ids, ``teacher_loss[t]`` being the loss of token
  ``t``: shift it with the labels), NaN where no teacher token maps (such tokens are *unmapped*).
* ``SelectionConfig``: ``mode`` ``guided`` (the top ``ceil(ratio * n_mapped)`` by the excess loss
  ``l_s - L_t``), ``random`` (as many, drawn uniformly with ``generator``), ``cpt`` (every token),
  ``student_loss`` (as many, by ``l_s`` alone, highest first) or ``teacher_loss`` (by ``L_t`` alone,
  lowest first); ``ratio``; ``rank_over`` ``batch`` (one ranking over the micro-batch, as Rho-1) or
  ``sequence``; ``unmapped`` ``include`` (always trained) or ``exclude``; ``byte_fallback``
  ``exclude`` keeps the positions ``byte_pieces`` marks (a (B, T) bool of the targets that are
  byte-fallback pieces) out of the ranking, as unmapped tokens.

The loss is the mean of ``l_s`` over the trained tokens, per call: under gradient accumulation the
selection is per micro-batch, as in ``make train-student``, whose Trainer calls this same function.
The selection needs no host synchronisation (ranks come from a sort, ``k`` stays a tensor), so it
can run every step on an accelerator; :class:`SelectionStats` holds 0-dim tensors to convert when
logging. Recipes for Hugging Face, a plain loop and Megatron: docs/export.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from pipeline.method.selection import SelectionConfig

IGNORE_INDEX = -100
_CEIL_TOLERANCE = 1e-6


@dataclass(frozen=True)
class SelectionStats:
    """Detached 0-dim tensors describing one call; NaN where a mean has no tokens.

    ``n_kept`` counts every trained token (selected mapped plus included unmapped),
    ``n_selected`` only the selected mapped ones. ``teacher_loss_kept``/``teacher_loss_dropped``
    average ``L_t`` over selected / not selected mapped tokens, ``excess_loss`` averages
    ``D = l_s - L_t`` over mapped tokens, ``loss_all`` is the cross-entropy over all valid tokens.
    """

    n_valid: torch.Tensor
    n_mapped: torch.Tensor
    n_selected: torch.Tensor
    n_kept: torch.Tensor
    kept_fraction: torch.Tensor
    teacher_loss_kept: torch.Tensor
    teacher_loss_dropped: torch.Tensor
    excess_loss: torch.Tensor
    loss_all: torch.Tensor

    def to_dict(self) -> dict[str, float]:
        """Python floats for logging (synchronises with the device once per field)."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy in float32, (B, T, V) logits and (B, T) labels -> (B, T).

    Ignored positions (``-100``) get 0. The only extra copy is one float32 view of the logits
    when they are in a lower precision (none when they already are float32).
    """
    batch, length, vocab = logits.shape
    flat = logits.reshape(batch * length, vocab).float()  # (B*T, V)
    ce = F.cross_entropy(flat, labels.reshape(-1), reduction="none", ignore_index=IGNORE_INDEX)
    return ce.view(batch, length)  # (B, T)


def k_for(n: torch.Tensor, ratio: float) -> torch.Tensor:
    """``ceil(ratio * n)`` (with a small tolerance for float error), at least 1 when ``n >= 1``."""
    k = torch.ceil(n.double() * ratio - _CEIL_TOLERANCE).long()
    return torch.where(n > 0, k.clamp(min=1), torch.zeros_like(k))


def top_k_mask(scores: torch.Tensor, candidates: torch.Tensor, ratio: float) -> torch.Tensor:
    """Per row of (R, L) ``scores``, the top ``k_for(#candidates in the row)`` candidates.

    Non-finite scores are clamped so that every candidate outranks every non-candidate; ties go
    to the earlier position (stable sort). Returns a (R, L) bool mask.
    """
    finfo = torch.finfo(scores.dtype)
    ranked = torch.nan_to_num(scores, nan=finfo.max, posinf=finfo.max, neginf=finfo.min)
    ranked = torch.where(candidates, ranked, torch.full_like(ranked, float("-inf")))  # (R, L)
    order = torch.argsort(ranked, dim=1, descending=True, stable=True)  # (R, L)
    positions = torch.arange(scores.shape[1], device=scores.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, positions)  # (R, L) rank of each position
    k = k_for(candidates.sum(dim=1), ratio)  # (R,)
    return candidates & (rank < k.unsqueeze(1))


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask``; NaN (0/0) when the mask is empty. For statistics."""
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum()


def _mean_with_grad(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` with gradient only into the masked entries.

    With an empty mask this is a zero that is still connected to ``values`` (zero gradient), so
    that DDP and gradient accumulation see the same graph on every rank and step.
    """
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1)


# --------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------


def select_tokens(
    token_loss: torch.Tensor,
    valid: torch.Tensor,
    teacher_loss: torch.Tensor | None,
    mapped: torch.Tensor | None,
    config: SelectionConfig,
    generator: torch.Generator | None = None,
    byte_pieces: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) bool masks ``(trained, selected)``: every token the loss averages over, and the
    mapped tokens chosen by their score (module docstring), at random (random), or all of them
    (cpt, which trains every token: none is dropped)."""
    if config.mode == "cpt":
        if teacher_loss is None or mapped is None:
            return valid, torch.zeros_like(valid)
        return valid, mapped & valid & ~torch.isnan(teacher_loss)
    if teacher_loss is None or mapped is None:
        raise ValueError(f"mode {config.mode!r} needs teacher_loss and mapped")
    candidates = mapped & valid & ~torch.isnan(teacher_loss)  # (B, T)
    if config.byte_fallback == "exclude":
        if byte_pieces is None:
            raise ValueError("byte_fallback='exclude' needs byte_pieces, the (B, T) mask of byte-fallback targets")
        candidates = candidates & ~byte_pieces
    if config.mode == "guided":
        scores = token_loss.detach().float() - teacher_loss.float()  # (B, T) excess loss D
    elif config.mode == "student_loss":
        scores = token_loss.detach().float()  # the student's hardest first
    elif config.mode == "teacher_loss":
        scores = -teacher_loss.float()  # the teacher's easiest first
    else:
        scores = torch.rand(
            token_loss.shape, generator=generator, device=_generator_device(generator, token_loss)
        ).to(token_loss.device)
    if config.rank_over == "batch":
        selected = top_k_mask(scores.reshape(1, -1), candidates.reshape(1, -1), config.ratio)
        selected = selected.view_as(candidates)
    else:
        selected = top_k_mask(scores, candidates, config.ratio)
    trained = selected | (valid & ~candidates) if config.unmapped == "include" else selected
    return trained, selected


def _generator_device(generator: torch.Generator | None, like: torch.Tensor) -> torch.device:
    return generator.device if generator is not None else like.device


@dataclass(frozen=True)
class GuidedLoss:
    """What :func:`guided_loss` returns. Reads as the pair ``(loss, stats)`` (unpacking, ``[0]``,
    ``[1]``); the per-token pieces the loss was computed from, (B, T) each, are there for further
    statistics (per-teacher metrics, §2.6)."""

    loss: torch.Tensor  # 0-dim, with gradient into the trained tokens only
    stats: SelectionStats
    token_loss: torch.Tensor  # l_s, detached
    valid: torch.Tensor  # bool: label not ignored
    selected: torch.Tensor  # bool: the mapped tokens chosen (every trained token is selected or unmapped)
    trained: torch.Tensor  # bool: every token the loss averages over

    def __iter__(self):  # as the ``(loss, stats)`` tuple it used to be
        return iter((self.loss, self.stats))

    def __getitem__(self, index):
        return (self.loss, self.stats)[index]

    def __len__(self) -> int:
        return 2


def guided_loss(
    logits_or_token_loss: torch.Tensor,
    labels: torch.Tensor | None,
    teacher_loss: torch.Tensor | None = None,
    mapped: torch.Tensor | None = None,
    config: SelectionConfig = SelectionConfig(),
    generator: torch.Generator | None = None,
    *,
    valid: torch.Tensor | None = None,
    byte_pieces: torch.Tensor | None = None,
) -> GuidedLoss:
    """Selected-token loss of a micro-batch and its statistics (module docstring).

    Args:
        logits_or_token_loss: student logits (B, T, V) or per-token cross-entropy (B, T).
        labels: (B, T) target ids aligned with the logits, ``-100`` where ignored. May be None with
            per-token losses when ``valid`` says which positions count.
        teacher_loss: (B, T) float ``L_t``, NaN where unmapped (unused for ``cpt``).
        mapped: (B, T) bool; None: where ``teacher_loss`` is not NaN. A mapped position whose
            ``L_t`` is NaN is treated as unmapped.
        config: :class:`SelectionConfig`.
        generator: torch.Generator for ``random`` mode (on the device the noise is drawn on).
        valid: (B, T) bool, the positions that count; None: ``labels != -100``.
        byte_pieces: (B, T) bool, the targets that are byte-fallback pieces (needed by
            ``byte_fallback='exclude'`` only).

    Returns:
        :class:`GuidedLoss`, unpacking as ``(loss, stats)``: ``loss`` is the mean of ``l_s`` over the
        trained tokens. When no token is trained (no valid token, or ``exclude`` with nothing
        mapped) it is a zero that still has a ``grad_fn`` connected to the input, so
        ``backward()`` works and gives zero gradients.
    """
    if logits_or_token_loss.dim() == 3:
        if labels is None:
            raise ValueError("logits need labels")
        token_loss = token_cross_entropy(logits_or_token_loss, labels)  # (B, T)
    elif logits_or_token_loss.dim() == 2:
        token_loss = logits_or_token_loss.float()  # (B, T)
    else:
        raise ValueError("expected logits (B, T, V) or per-token losses (B, T)")
    if valid is None:
        if labels is None:
            raise ValueError("give labels (-100 where ignored) or a valid mask")
        if labels.shape != token_loss.shape:
            raise ValueError(f"labels {tuple(labels.shape)} do not match {tuple(token_loss.shape)}")
        valid = labels != IGNORE_INDEX  # (B, T)
    elif valid.shape != token_loss.shape:
        raise ValueError(f"valid {tuple(valid.shape)} does not match {tuple(token_loss.shape)}")
    if teacher_loss is not None and mapped is None:
        mapped = ~torch.isnan(teacher_loss)
    trained, selected = select_tokens(token_loss, valid, teacher_loss, mapped, config, generator, byte_pieces)
    loss = _mean_with_grad(token_loss, trained)
    stats = _stats(token_loss.detach(), valid, trained, selected, teacher_loss, mapped)
    return GuidedLoss(loss, stats, token_loss.detach(), valid, selected, trained)


def _stats(token_loss, valid, trained, selected, teacher_loss, mapped) -> SelectionStats:
    if teacher_loss is None or mapped is None:
        teacher_loss = torch.full_like(token_loss, float("nan"))
        mapped = torch.zeros_like(valid)
    teacher_loss = teacher_loss.float()
    candidates = mapped & valid & ~torch.isnan(teacher_loss)  # (B, T)
    n_valid = valid.sum()
    n_kept = trained.sum()
    return SelectionStats(
        n_valid=n_valid,
        n_mapped=candidates.sum(),
        n_selected=selected.sum(),
        n_kept=n_kept,
        kept_fraction=n_kept / n_valid.clamp(min=1),
        teacher_loss_kept=_masked_mean(teacher_loss, selected),
        teacher_loss_dropped=_masked_mean(teacher_loss, candidates & ~selected),
        excess_loss=_masked_mean(token_loss - teacher_loss, candidates),
        loss_all=_masked_mean(token_loss, valid),
    )
