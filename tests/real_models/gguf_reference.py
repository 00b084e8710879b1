"""An independent forward of a Llama GGUF checkpoint, for checking what transformers and the project
make of it: the tensors are read and dequantized by the ``gguf`` package's own NumPy code, and the
forward follows llama.cpp's definition of the architecture, written out here in float64: RMSNorm,
rotary embedding on adjacent pairs (llama.cpp's "normal" rope, the layout GGUF stores Q and K in:
no un-permuting), grouped-query causal attention, SwiGLU, a tied output head when the file has no
``output.weight``. Nothing of transformers is used."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch


class GGUFLlama:
    def __init__(self, path: str | Path):
        from gguf import GGUFReader
        from gguf.quants import dequantize

        reader = GGUFReader(str(path))
        meta = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("llama.")}
        self.layers = int(meta["llama.block_count"])
        self.heads = int(meta["llama.attention.head_count"])
        self.kv_heads = int(meta["llama.attention.head_count_kv"])
        self.width = int(meta["llama.embedding_length"])
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        self.theta = float(meta["llama.rope.freq_base"])
        self.w = {t.name: torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64))
                  for t in reader.tensors}
        self.head = self.w.get("output.weight", self.w["token_embd.weight"])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * weight

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H, D): pairs (0, 1), (2, 3), ... rotated by position * theta^(-2i/D)."""
        t, _, d = x.shape
        angle = torch.arange(t, dtype=torch.float64)[:, None] * self.theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]  # (T, 1, D/2)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    @torch.no_grad()
    def log_probs(self, ids: list[int]) -> torch.Tensor:
        """(T, V) float64 log-probabilities of the next token after each position."""
        t, d = len(ids), self.width // self.heads
        x = self.w["token_embd.weight"][torch.tensor(ids)]  # (T, W)
        causal = torch.full((t, t), -math.inf, dtype=torch.float64).triu(1)
        for i in range(self.layers):
            b = f"blk.{i}."
            h = self._norm(x, self.w[b + "attn_norm.weight"])
            q = self._rope((h @ self.w[b + "attn_q.weight"].T).view(t, self.heads, d))
            k = self._rope((h @ self.w[b + "attn_k.weight"].T).view(t, self.kv_heads, d))
            v = (h @ self.w[b + "attn_v.weight"].T).view(t, self.kv_heads, d)
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (T, H, D)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d) + causal
            attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).reshape(t, self.width)
            x = x + attn @ self.w[b + "attn_output.weight"].T
            h = self._norm(x, self.w[b + "ffn_norm.weight"])
            gate, up = h @ self.w[b + "ffn_gate.weight"].T, h @ self.w[b + "ffn_up.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ self.w[b + "ffn_down.weight"].T
        return torch.log_softmax(self._norm(x, self.w["output_norm.weight"]) @ self.head.T, dim=-1)

    def token_losses(self, ids: list[int]) -> np.ndarray:
        """-log p(ids[p] | ids[:p]), NaN at position 0."""
        logp = self.log_probs(ids)
        out = np.full(len(ids), np.nan)
        out[1:] = -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
        return out
