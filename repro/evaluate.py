"""How the toy students are judged: held-out bits per byte, and answers to held-out worked problems.

Bits per UTF-8 byte divide the summed next-token loss of a text by its size, so students with
different tokenizers are compared on the same footing; the computation is the library's
(:mod:`pipeline.method.bits_per_byte`: every text token predicted after the student's BOS, or
its EOS where it has none, long texts in blocks carrying the previous block's last token).

Answers use worked problems in the corpus's own format (``Example k. <question>`` then
``Solution: a × b = c. <sentence restating c>``), drawn from held-out seeds, in two kinds:

* ``arithmetic``: the prompt ends with ``a op b =``; the answer is `` c.`` (the model must compute);
* ``restate``: the prompt ends just before the restated ``c``; the answer is `` c <words>`` (the
  model must find ``c`` on the line above and copy it, an in-context step a tiny model can learn).

Greedy exact match is zero for every toy student, so two teacher-forced measures replace it: the
answer's bits per byte given the prompt, and a three-way choice between the answer and the same
text with ``c`` replaced by ``a`` or by ``b`` (correct when the true answer has the strictly
lowest loss; chance is one in three).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from pipeline.embedded.sample_corpus import arithmetic_problems
from pipeline.method.bits_per_byte import first_token, summarize, text_losses

_EQUATION = re.compile(r"^(-?\d+) \S (-?\d+) = (-?\d+)$")


@dataclass(frozen=True)
class Completion:
    kind: str  # arithmetic | restate
    prompt: str
    answer: str  # the number c
    suffix: str = ""  # what follows c in the worked problem ("." or " <words>.")
    distractors: tuple[str, ...] = ()  # the operands a and b where they differ from c

    def continuation(self, number: str) -> str:
        return f" {number}{self.suffix}"


def completion_items(n: int, seed: int) -> list[Completion]:
    """``n`` prompts of each kind from worked arithmetic problems (deterministic in ``seed``)."""
    rng = random.Random(f"repro-completions/{seed}")
    items: list[Completion] = []
    for k, problem in enumerate(arithmetic_problems(n, seed), start=1):
        equation, _, rest = problem.answer.partition(". ")
        left, _, result = equation.rpartition(" = ")
        a, b, _ = _EQUATION.match(equation).groups()
        distractors = tuple(dict.fromkeys(x for x in (a, b) if x != result))
        head = f"Example {rng.randint(1, 9)}. {problem.question}\nSolution: "
        items.append(Completion("arithmetic", f"{head}{left} =", result, ".", distractors))
        cut = rest.find(result)
        if cut > 0:
            items.append(Completion("restate", f"{head}{equation}. {rest[:cut].rstrip()}", result,
                                    rest[cut + len(result):], distractors))
    return items


def bits_per_byte(model, tokenizer, texts: list[str], window: int = 256, batch_size: int = 16) -> dict:
    """Summed next-token loss over ``texts`` in bits per UTF-8 byte, plus nats per token
    (:mod:`pipeline.method.bits_per_byte`, which ``make eval-student`` uses too)."""
    totals = summarize(text_losses(model, tokenizer, texts, window=window, batch_size=batch_size))
    return {"bits_per_byte": totals["bits_per_byte"], "nats_per_token": totals["nats_per_token"],
            "n_bytes": totals["bytes"], "n_tokens": totals["tokens"]}


def continuation_losses(model, tokenizer, pairs: list[tuple[str, str]], batch_size: int = 32) -> list[float]:
    """Summed next-token loss (nats) of each ``continuation`` after its ``prompt``.

    ``prompt + continuation`` is tokenized as one text (as the student reads it), and the tokens
    that end inside the continuation are scored, each predicted from everything before it.
    """
    import torch
    import torch.nn.functional as F

    first = first_token(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else first
    encoded = tokenizer([p + c for p, c in pairs], add_special_tokens=False, split_special_tokens=True,
                        return_offsets_mapping=True)
    rows = []
    for (prompt, _), ids, offsets in zip(pairs, encoded["input_ids"], encoded["offset_mapping"]):
        scored = [end > len(prompt) for _, end in offsets]
        if not any(scored):
            raise ValueError(f"the continuation after {prompt[-40:]!r} has no token of its own")
        rows.append(([first, *ids], scored))
    out: list[float] = []
    model.eval()
    with torch.inference_mode():
        for i in range(0, len(rows), batch_size):
            batch = rows[i : i + batch_size]
            width = max(len(ids) for ids, _ in batch)
            x = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            target = torch.full((len(batch), width - 1), -100, dtype=torch.long)
            for r, (ids, scored) in enumerate(batch):
                x[r, : len(ids)] = torch.tensor(ids)
                mask[r, : len(ids)] = 1
                target[r, : len(ids) - 1] = torch.tensor([t if s else -100 for t, s in zip(ids[1:], scored)])
            logits = model(input_ids=x, attention_mask=mask).logits[:, :-1].float()  # (B, T-1, V)
            loss = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="none")  # (B, T-1)
            out += loss.sum(dim=1).tolist()
    return out


def answer_scores(model, tokenizer, items: list[Completion], batch_size: int = 32) -> dict:
    """Per kind: the true answer's bits per byte given the prompt, and the share of items where it
    has a strictly lower loss than every distractor (items without distractors are not counted)."""
    pairs, owners = [], []
    for k, item in enumerate(items):
        for number in (item.answer, *item.distractors):
            pairs.append((item.prompt, item.continuation(number)))
            owners.append(k)
    losses = continuation_losses(model, tokenizer, pairs, batch_size)
    per_item: dict[int, list[float]] = {}
    for k, loss in zip(owners, losses):
        per_item.setdefault(k, []).append(loss)
    by_kind: dict[str, dict] = {}
    for k, item in enumerate(items):
        true, *others = per_item[k]
        kind = by_kind.setdefault(item.kind, {"n": 0, "nats": 0.0, "bytes": 0, "n_choice": 0, "correct": 0})
        kind["n"] += 1
        kind["nats"] += true
        kind["bytes"] += len(item.continuation(item.answer).encode("utf-8"))
        if others:
            kind["n_choice"] += 1
            kind["correct"] += int(true < min(others))
    return {name: {"n": v["n"], "bits_per_byte": v["nats"] / math.log(2) / v["bytes"], "n_choice": v["n_choice"],
                   "choice_accuracy": v["correct"] / v["n_choice"] if v["n_choice"] else math.nan}
            for name, v in sorted(by_kind.items())}


def evaluate_model(folder: str, held_out: list[str], items: list[Completion], window: int) -> dict:
    """Load a saved student (``save_pretrained`` folder) and run both measures."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True)
    result = bits_per_byte(model, tokenizer, held_out, window=window)
    result["answers"] = answer_scores(model, tokenizer, items)
    return result
