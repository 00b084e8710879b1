"""How the toy students are judged: held-out bits per byte and exact-match answer completions.

Bits per UTF-8 byte divide the summed next-token loss of a text by its size, so students with
different tokenizers are compared on the same footing. Every text token is predicted: the text
follows the student's BOS (or, for a tokenizer without one, its EOS, the separator it saw between
documents in training), and texts longer than the model's window are cut into blocks that each
carry the previous block's last token as their first input.

Exact match uses worked problems in the corpus's own format (``Example k. <question>`` then
``Solution: a × b = c. <sentence restating c>``), drawn from held-out seeds:

* ``arithmetic``: the prompt ends with ``a op b = ``; the answer is ``c`` (the model must compute);
* ``restate``: the prompt ends just before the restated ``c``; the answer is ``c`` again (the model
  must find and copy it from the line above, the kind of in-context step a tiny model can learn).

The continuation is decoded greedily; it is correct when its leading digits equal ``c``.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from pipeline.lab.embedded.sample_corpus import arithmetic_problems

_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")


@dataclass(frozen=True)
class Completion:
    kind: str  # arithmetic | restate
    prompt: str
    answer: str


def completion_items(n: int, seed: int) -> list[Completion]:
    """``n`` prompts of each kind from worked arithmetic problems (deterministic in ``seed``)."""
    rng = random.Random(f"repro-completions/{seed}")
    items: list[Completion] = []
    for k, problem in enumerate(arithmetic_problems(n, seed), start=1):
        equation, _, rest = problem.answer.partition(". ")
        left, _, result = equation.rpartition(" = ")
        head = f"Example {rng.randint(1, 9)}. {problem.question}\nSolution: "
        items.append(Completion("arithmetic", f"{head}{left} =", result))
        cut = rest.find(result)
        if cut > 0:
            items.append(Completion("restate", f"{head}{equation}. {rest[:cut].rstrip()}", result))
    return items


def extract_number(continuation: str) -> str | None:
    """The integer a continuation starts with (after optional spaces), else None."""
    m = _LEADING_NUMBER.match(continuation)
    return m.group(1) if m else None


def _first_token(tokenizer) -> int:
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if first is None:
        raise ValueError("the student tokenizer has neither a BOS nor an EOS token to start a text with")
    return first


def bits_per_byte(model, tokenizer, texts: list[str], window: int = 256, batch_size: int = 16) -> dict:
    """Summed next-token loss over ``texts`` in bits per UTF-8 byte, plus nats per token."""
    import torch
    import torch.nn.functional as F

    first = _first_token(tokenizer)
    blocks: list[list[int]] = []
    n_tokens = 0
    for ids in tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]:
        seq = [first, *ids]
        n_tokens += len(ids)
        for start in range(0, len(seq) - 1, window):
            blocks.append(seq[start : start + window + 1])
    total = 0.0
    model.eval()
    with torch.inference_mode():
        blocks.sort(key=len)
        for i in range(0, len(blocks), batch_size):
            batch = blocks[i : i + batch_size]
            width = max(map(len, batch))
            x = torch.zeros(len(batch), width, dtype=torch.long)
            target = torch.full((len(batch), width - 1), -100, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, b in enumerate(batch):
                x[r, : len(b)] = torch.tensor(b)
                target[r, : len(b) - 1] = torch.tensor(b[1:])
                mask[r, : len(b)] = 1
            logits = model(input_ids=x, attention_mask=mask).logits[:, :-1].float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                     ignore_index=-100, reduction="sum").item()
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return {"bits_per_byte": total / math.log(2) / n_bytes, "nats_per_token": total / max(n_tokens, 1),
            "n_bytes": n_bytes, "n_tokens": n_tokens}


def exact_match(model, tokenizer, items: list[Completion], max_new_tokens: int = 8, batch_size: int = 32) -> dict:
    """Greedy completions of ``items``; accuracy per kind and the records."""
    import torch

    first = _first_token(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    records = []
    model.eval()
    with torch.inference_mode():
        for i in range(0, len(items), batch_size):
            batch = items[i : i + batch_size]
            encoded = [[first, *ids] for ids in tokenizer([b.prompt for b in batch], add_special_tokens=False,
                                                          split_special_tokens=True)["input_ids"]]
            width = max(map(len, encoded))
            x = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, ids in enumerate(encoded):  # left padding
                x[r, width - len(ids):] = torch.tensor(ids)
                mask[r, width - len(ids):] = 1
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=None)
            for item, row in zip(batch, out[:, width:].tolist()):
                text = tokenizer.decode(row, skip_special_tokens=True)
                got = extract_number(text)
                records.append({"kind": item.kind, "answer": item.answer, "continuation": text, "extracted": got,
                                "correct": got == item.answer})
    by_kind: dict[str, dict] = {}
    for r in records:
        k = by_kind.setdefault(r["kind"], {"n": 0, "correct": 0})
        k["n"] += 1
        k["correct"] += int(r["correct"])
    for k in by_kind.values():
        k["accuracy"] = k["correct"] / k["n"]
    return {"by_kind": by_kind, "records": records}


def evaluate_model(folder: str, held_out: list[str], items: list[Completion], window: int) -> dict:
    """Load a saved student (``save_pretrained`` folder) and run both measures."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True)
    result = bits_per_byte(model, tokenizer, held_out, window=window)
    em = exact_match(model, tokenizer, items)
    result["exact_match"] = em["by_kind"]
    result["completions"] = em["records"]
    return result
