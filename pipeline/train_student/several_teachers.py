"""Per-teacher metrics of a several-teacher training run (docs/METHOD.md §2.6, step 4): which teacher
decided the selected tokens, how much each maps, and how far their own selections agree.

The data side of several teachers (grouping folders, matching documents, combining losses) is
shared with the export: :mod:`pipeline.student_data.several_teachers`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from pipeline.method.guided_loss import select_tokens


def decision_credit(losses, combined, how: str, weights: Sequence[float] | None = None):
    """(..., T) share of each token's combined loss that each teacher decided (torch tensors):
    for ``min``/``max`` the teachers whose loss is the combined value (split evenly on a tie), for
    ``mean``/``weighted`` the teachers that map the token in proportion to their weight (evenly
    for ``mean``). Rows sum to 1 where any teacher maps the token, else to 0."""

    mapped = ~torch.isnan(losses)  # (..., T)
    if how in ("min", "max"):
        share = (mapped & (losses == combined.unsqueeze(-1))).double()
    else:
        w = torch.ones(losses.shape[-1], dtype=torch.float64, device=losses.device) if how == "mean" else \
            torch.as_tensor(list(weights), dtype=torch.float64, device=losses.device)
        share = mapped.double() * w
    return share / share.sum(dim=-1, keepdim=True).clamp(min=1e-300)


@dataclass(frozen=True)
class TeacherMetrics:
    """Per-teacher statistics of the selection, as sums over micro-batches (docs/METHOD.md §2.6).

    For every teacher ``t``: ``decided_t<t>``, its share of the selected tokens (credit of
    :func:`decision_credit` summed over them, over their number) and ``mapped_fraction_t<t>``, the
    share of valid tokens it maps. For every pair: ``selection_jaccard_t<a>_t<b>``, the Jaccard index
    of the two teachers' own top-k selections (each ranked by ``l_s - L_t`` of that teacher alone,
    with the run's ratio, ranking pool and unmapped rule), intersection over union summed over
    the micro-batches since the last log.
    """

    names: tuple[str, ...]
    combine: str
    weights: tuple[float, ...] | None
    selection: object  # guided_loss.SelectionConfig

    @property
    def n_sums(self) -> int:
        return 2 + 2 * len(self.names) + 2 * len(self.pairs)

    @property
    def pairs(self) -> list[tuple[int, int]]:
        n = len(self.names)
        return [(a, b) for a in range(n) for b in range(a + 1, n)]

    def sums(self, token_loss, valid, selected, teacher_losses, combined):
        """(K,) float64 sums for one micro-batch: n_selected, n_valid, then per teacher credit and
        mapped count, then per pair intersection and union. ``teacher_losses`` is (B, L, T)."""

        credit = decision_credit(teacher_losses.float(), combined.float(), self.combine, self.weights)  # (B, L, T)
        decided = (credit * selected.unsqueeze(-1)).sum(dim=(0, 1))  # (T,)
        mapped = (~torch.isnan(teacher_losses) & valid.unsqueeze(-1)).sum(dim=(0, 1)).double()  # (T,)
        own = replace(self.selection, mode="guided")
        picks = [select_tokens(token_loss, valid, teacher_losses[..., t], ~torch.isnan(teacher_losses[..., t]), own)[1]
                 for t in range(len(self.names))]
        pair_sums = [torch.stack([(picks[a] & picks[b]).sum(), (picks[a] | picks[b]).sum()]).double()
                     for a, b in self.pairs]
        head = torch.stack([selected.sum(), valid.sum()]).double()
        return torch.cat([head, decided, mapped, *pair_sums])

    def metrics(self, sums: Sequence[float]) -> dict[str, float]:
        n = len(self.names)
        n_selected, n_valid = sums[0], sums[1]
        out = {}
        for t in range(n):
            out[f"decided_t{t}"] = sums[2 + t] / n_selected if n_selected else float("nan")
            out[f"mapped_fraction_t{t}"] = sums[2 + n + t] / n_valid if n_valid else float("nan")
        for p, (a, b) in enumerate(self.pairs):
            inter, union = sums[2 + 2 * n + 2 * p], sums[3 + 2 * n + 2 * p]
            out[f"selection_jaccard_t{a}_t{b}"] = inter / union if union else float("nan")
        return out
