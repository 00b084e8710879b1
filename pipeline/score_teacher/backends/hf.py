"""The transformers backend: batched forward passes, float32 log-softmax in bounded memory
(docs/METHOD.md §1.2).

Per batch of windows (sorted by length so that each batch holds windows of similar length, then
right-padded, up to ``max_batch_tokens`` padded tokens):

1. the model's backbone gives hidden states ``(B, T, H)`` in the model's dtype (bf16 on GPU), with
   ``use_cache=False``: a scoring pass never decodes, so no layer's keys and values are kept;
2. only the positions whose prediction is needed are gathered: ``(N, H)``;
3. the output head runs on chunks of those positions, small enough that one chunk's float32
   logits ``(C, V)`` stays under ``max_logits_bytes`` (about 440 positions for a 151,936-token
   vocabulary and 256 MiB); each chunk is upcast to float32 before ``logsumexp``, so the losses are
   float32 even when the model runs in bf16, and no ``(B*T, V)`` float32 tensor ever exists.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from pipeline.folders.model_source import resolve_device
from pipeline.score_teacher.backends.base import ScorerConfig

log = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")  # torch names them alike


def load_causal_lm(cfg: ScorerConfig, device: torch.device):
    """Load the teacher straight onto ``device`` (``device_map``: no full copy in host memory first),
    with safetensors weights only (``cfg.allow_bin`` also accepts ``.bin`` weights, which
    transformers reads with ``torch.load(weights_only=True)``) and remote code off unless configured."""
    import torch  # lazy: seconds to import; a config error is refused first
    from transformers import AutoModelForCausalLM  # lazy: seconds to import; a config error is refused first

    if cfg.dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {cfg.dtype!r}; choose one of {sorted(_DTYPES)}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # the actor's GPU, by index
    kwargs = dict(
        revision=cfg.revision,
        dtype=getattr(torch, cfg.dtype),
        trust_remote_code=cfg.trust_remote_code,
        use_safetensors=None if cfg.allow_bin else True,  # None: safetensors when present, else .bin
        device_map={"": device},
    )
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(cfg.model, **kwargs)
    return model.eval()


def batches_by_tokens(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices grouped so that ``len(group) * max(length in group) <= max_batch_tokens``.

    Longest first, so each batch holds windows of similar length (little padding). A window longer
    than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        new_width = max(width, lengths[i])
        if current and new_width * (len(current) + 1) > max_batch_tokens:
            groups.append(current)
            current, new_width = [], lengths[i]
        current.append(i)
        width = new_width
    if current:
        groups.append(current)
    return groups


class TransformersScorer:
    def __init__(self, cfg: ScorerConfig, model=None):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.model = model if model is not None else load_causal_lm(cfg, self.device)
        self.backbone = self.model.base_model
        self.head = self.model.get_output_embeddings()
        self.vocab_size = int(self.head.weight.shape[0])
        self.softcap = getattr(self.model.config, "final_logit_softcapping", None)
        self.chunk_positions = head_chunk_positions(self.vocab_size, cfg.max_logits_bytes)

    def describe(self) -> dict:
        return {
            "backend": "transformers",
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "device": self.device.type,
        }

    def score(self, windows: Sequence[np.ndarray]) -> list[np.ndarray]:
        import torch  # lazy: seconds to import; a config error is refused first
        results: list[np.ndarray | None] = [None] * len(windows)
        lengths = [len(w) for w in windows]
        with torch.inference_mode():
            for group in batches_by_tokens(lengths, self.cfg.max_batch_tokens):
                for i, losses in zip(group, self._score_batch([windows[i] for i in group])):
                    results[i] = losses
        return results  # type: ignore[return-value]

    def _score_batch(self, windows: list[np.ndarray]) -> list[np.ndarray]:
        import torch  # lazy: seconds to import; a config error is refused first
        width = max(len(w) for w in windows)
        ids = torch.zeros((len(windows), width), dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(windows), width), dtype=torch.long)  # (B, T)
        for b, w in enumerate(windows):
            ids[b, : len(w)] = torch.from_numpy(np.asarray(w, dtype=np.int64))
            mask[b, : len(w)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (B, T, H)
        # Position t of the hidden states predicts token t+1.
        predicts = mask[:, 1:].bool()  # (B, T-1)
        h = hidden[:, :-1][predicts]  # (N, H)
        targets = ids[:, 1:][predicts]  # (N,)
        nll = self._nll(h, targets).cpu().numpy()  # (N,)
        out, offset = [], 0
        for w in windows:
            n = len(w) - 1
            losses = np.empty(len(w), dtype=np.float32)
            losses[0] = np.nan
            losses[1:] = nll[offset : offset + n]
            offset += n
            out.append(losses)
        return out

    def _nll(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """-log softmax(head(h))[target] in float32, one bounded chunk of positions at a time."""
        import torch  # lazy: seconds to import; a config error is refused first
        import torch.nn.functional as F  # lazy: seconds to import; a config error is refused first
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        for lo in range(0, h.shape[0], self.chunk_positions):
            hi = min(lo + self.chunk_positions, h.shape[0])
            logits = self.head(h[lo:hi]).float()  # (C, V) float32
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            # one fused log-softmax + gather (faster than logsumexp - gather)
            out[lo:hi] = F.cross_entropy(logits, targets[lo:hi], reduction="none")  # (C,)
        return out


def head_chunk_positions(vocab_size: int, max_logits_bytes: int) -> int:
    """How many positions one output-head chunk holds so its float32 logits fit the budget."""
    return max(1, max_logits_bytes // (4 * vocab_size))
