"""References the vLLM tests compare with (a plain transformers forward; windows worked out by
hand), and the engine processes a test leaves."""

from __future__ import annotations

import os

import numpy as np


def reference_losses(model, z: np.ndarray) -> np.ndarray:
    """-log p(z[i] | z[:i]) from one plain transformers forward over ``z`` (NaN at 0), float32."""
    import torch

    with torch.no_grad():
        logits = model(torch.as_tensor(np.asarray(z, dtype=np.int64))[None]).logits[0].float()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    out = np.full(len(z), np.nan, dtype=np.float32)
    if len(z) > 1:
        out[1:] = -logp[:-1].gather(1, torch.as_tensor(np.asarray(z[1:], dtype=np.int64))[:, None])[:, 0].numpy()
    return out


def reference_document(model, z: np.ndarray, window: int, stride: int) -> np.ndarray:
    """Per-position losses of a long sequence ``z``, worked out by hand from the window rule: position
    ``p < window`` is predicted in the window starting at 0; a later ``p`` in window
    ``k = (p - window) // stride + 1``, which starts at ``k * stride``."""
    out = np.full(len(z), np.nan, dtype=np.float32)
    cache: dict[int, np.ndarray] = {}
    for p in range(1, len(z)):
        start = 0 if p < window else ((p - window) // stride + 1) * stride
        if start not in cache:
            cache[start] = reference_losses(model, z[start:start + window])
        out[p] = cache[start][p - start]
    return out


def load_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype="float32").eval()


def vllm_processes() -> list[int]:
    """Pids of the engine processes (VLLM::EngineCore, VLLM::Worker) that are children of this one."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if cmd.startswith(b"VLLM::") and ppid in _own_tree():
            found.append(int(pid))
    return found


def _own_tree() -> set[int]:
    tree, grew = {os.getpid()}, True
    while grew:
        grew = False
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) not in tree:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
                if ppid in tree:
                    tree.add(int(pid))
                    grew = True
    return tree


def remove_named_log(message: str) -> None:
    """The engine's log a start-up failure keeps and names (``...; the engine's log: <path>)``): it
    exists, and is removed."""
    path = message.rsplit("the engine's log: ", 1)[1].rstrip(")")
    assert os.path.isfile(path), path
    os.unlink(path)
