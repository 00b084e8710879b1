"""The benchmark registry, local JSONL records, few-shot exemplars and prompts.

A task is a prompt template, an answer type (how gold and generated answers are read and compared,
see :mod:`pipeline.evaluation.answers`), a default shot count and, where lm-evaluation-harness ships
standard chain-of-thought exemplars for it, where to take them from.

Records are local JSONL, one object per line: ``{"question": ..., "answer": ...}``. ``answer`` may
be GSM8K's rationale ending in ``#### 42`` (the final answer is taken), a MATH solution with
``\\boxed{}``, or the final answer alone. Multiple-choice records add ``"choices": [...]`` (shown
as ``Answer Choices: (A) ... (B) ...``) and give the answer as a letter, a 0-based index or the
text of a choice; without ``choices`` the question must already list them. Few-shot files have the
same form; their ``answer`` (or an explicit ``target``) becomes the worked answer of the exemplar.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import yaml

from pipeline.runtime.config import ConfigError, MissingPathError, UserError
from pipeline.evaluation import answers as A

LETTERS = "ABCDE"


class DataError(UserError, ValueError):
    """A task file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Template:
    """``question`` is the prompt of one problem (``{question}`` filled in); an exemplar is that plus
    ``target_sep`` and its worked answer; exemplars and the problem are joined by ``shot_sep``.
    Generation stops at the first of ``stop``."""

    name: str
    question: str
    stop: tuple[str, ...]
    target_sep: str = " "
    shot_sep: str = "\n\n"


QA = Template("qa", "Q: {question}\nA:", stop=("Q:", "\n\n"))  # Wei et al.'s chain-of-thought form
PROBLEM = Template("problem", "Problem:\n{question}\n\nSolution:", stop=("Problem:",))  # Minerva's form


@dataclass(frozen=True)
class TaskSpec:
    name: str
    answer_type: str  # numeric | math | choice | mixed
    template: Template
    num_fewshot: int
    lm_eval_exemplars: str | None  # gsm8k_cot | minerva_math | None (no standard CoT exemplars there)
    about: str


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("gsm8k", "numeric", QA, 8, "gsm8k_cot", "grade-school word problems"),
    TaskSpec("math", "math", PROBLEM, 4, "minerva_math", "competition mathematics, \\boxed{} answers"),
    TaskSpec("svamp", "numeric", QA, 8, "gsm8k_cot", "word problems with varied structure"),
    TaskSpec("asdiv", "numeric", QA, 8, "gsm8k_cot", "diverse word problems"),
    TaskSpec("mawps", "numeric", QA, 8, "gsm8k_cot", "elementary word problems"),
    TaskSpec("tabmwp", "mixed", QA, 4, None, "word problems over a table (put the table in the question)"),
    TaskSpec("mathqa", "choice", QA, 4, None, "multiple choice, letters A-E"),
    TaskSpec("mmlu_stem", "choice", QA, 4, None, "multiple choice, letters A-D"),
    TaskSpec("sat", "choice", QA, 4, None, "SAT math, multiple choice"),
)}


@dataclass(frozen=True)
class Record:
    line: int  # 1-based line of the JSONL file
    question: str
    gold: str  # the final answer, canonical for numbers, a letter for multiple choice
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Exemplar:
    question: str
    target: str  # the worked answer, ending with the final answer
    choices: tuple[str, ...] | None = None


# ---- scoring ---------------------------------------------------------------------------------

def score(spec: TaskSpec, generation: str, record: Record) -> tuple[str | None, bool]:
    """``(extracted answer, correct)`` of one generation (already cut at the stop sequence)."""
    kind = spec.answer_type
    if kind == "numeric" or (kind == "mixed" and A.is_only_number(record.gold)):
        got = A.extract_numeric(generation)
        return got, A.numbers_equal(got, record.gold)
    if kind == "mixed":
        got = A.extract_text_answer(generation)
        return got, A.texts_equal(got, record.gold)
    if kind == "math":
        got = A.extract_math(generation)
        return got, A.math_equal(got, record.gold)
    letters = LETTERS[: len(record.choices)] if record.choices else LETTERS
    got = A.extract_choice(generation, letters)
    return got, got is not None and got == record.gold


def _gold(spec: TaskSpec, answer, choices: tuple[str, ...] | None) -> str | None:
    if spec.answer_type == "choice":
        return A.choice_gold(answer, list(choices) if choices else None)
    text = str(answer)
    if spec.answer_type == "numeric":
        return A.numeric_gold(text)
    if spec.answer_type == "math":
        return A.math_gold(text) or None
    # mixed: GSM8K form or a plain answer; a number stays the number as written
    final = text.rsplit("####", 1)[1] if "####" in text else text
    final = final.strip()
    return (A.format_number(A.parse_number(final)) if A.is_only_number(final) else final) or None


# ---- reading files ---------------------------------------------------------------------------

def _objects(path: Path):
    """``(line number, dict)`` for every non-blank line; a bad line is a :class:`DataError`."""
    if not path.is_file():
        raise MissingPathError(f"{path}: task file not found")
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            yield n, obj


def _fields(path: Path, n: int, obj: dict, spec: TaskSpec) -> tuple[str, object, tuple[str, ...] | None]:
    question, answer, choices = obj.get("question"), obj.get("answer", obj.get("target")), obj.get("choices")
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{path}:{n}: 'question' must be a non-empty string")
    if answer is None or isinstance(answer, (dict, list, bool)):
        raise DataError(f"{path}:{n}: 'answer' must be a string or a number")
    if choices is not None:
        if spec.answer_type != "choice":
            raise DataError(f"{path}:{n}: 'choices' given, but {spec.name} is not a multiple-choice task")
        if not (isinstance(choices, list) and 2 <= len(choices) <= len(LETTERS)
                and all(isinstance(c, str) for c in choices)):
            raise DataError(f"{path}:{n}: 'choices' must be a list of 2 to {len(LETTERS)} strings")
        choices = tuple(choices)
    return question, answer, choices


def load_records(path: str | Path, spec: TaskSpec, limit: int | None = None) -> list[Record]:
    """The task's records (the first ``limit`` of them); every record must have a readable gold
    answer, or the file and line are named."""
    path = Path(path)
    records = []
    for n, obj in _objects(path):
        if limit is not None and len(records) >= limit:
            break
        question, answer, choices = _fields(path, n, obj, spec)
        gold = _gold(spec, answer, choices)
        if gold is None:
            raise DataError(f"{path}:{n}: no {spec.answer_type} answer in 'answer': {str(answer)[:80]!r}")
        records.append(Record(line=n, question=question, gold=gold, choices=choices))
    if not records:
        raise DataError(f"{path}: no records")
    return records


def load_exemplars(path: str | Path, spec: TaskSpec) -> list[Exemplar]:
    """Few-shot exemplars from a local JSONL file (``question`` and ``answer`` or ``target``)."""
    path = Path(path)
    shots = []
    for n, obj in _objects(path):
        question, answer, choices = _fields(path, n, obj, spec)
        target = obj["target"] if isinstance(obj.get("target"), str) else worked_answer(spec, str(answer), choices)
        shots.append(Exemplar(question=question, target=target.strip(), choices=choices))
    if not shots:
        raise DataError(f"{path}: no exemplars")
    return shots


def worked_answer(spec: TaskSpec, answer: str, choices: tuple[str, ...] | None) -> str:
    """An exemplar's answer in the form the model should imitate: GSM8K's ``rationale #### 42``
    becomes ``rationale The answer is 42.`` (calculator notes ``<<...>>`` removed); a bare final
    answer becomes ``The answer is ...`` (MATH: ``The final answer is $\\boxed{...}$``)."""
    answer = answer.strip()
    if spec.answer_type == "choice":
        letter = A.choice_gold(answer, list(choices) if choices else None)
        return f"The answer is ({letter})." if letter and len(answer) <= 3 else answer
    if spec.answer_type == "math":
        return answer if A.last_boxed(answer) is not None else f"The final answer is $\\boxed{{{answer}}}$."
    if "####" in answer:
        rationale, final = answer.rsplit("####", 1)
        rationale = re.sub(r"<<[^>]*>>", "", rationale).strip()
        return f"{rationale} The answer is {final.strip()}.".strip()
    if A.is_only_number(answer):
        return f"The answer is {answer.rstrip('.')}."
    return answer


# ---- standard exemplars from lm-evaluation-harness --------------------------------------------

def lm_eval_exemplars(which: str) -> list[Exemplar]:
    """The chain-of-thought exemplars lm-evaluation-harness ships: ``gsm8k_cot`` (Wei et al.'s eight
    problems, from its ``gsm8k-cot.yaml``) or ``minerva_math`` (Minerva's four MATH problems).
    Nothing is downloaded."""
    if which == "gsm8k_cot":
        return _gsm8k_cot()
    if which == "minerva_math":
        return _minerva_math()
    raise ConfigError(f"no lm-evaluation-harness exemplars named {which!r}")


def lm_eval_task_file(*parts: str) -> Path:
    """A file of lm-evaluation-harness's task definitions, found without importing the package."""

    spec = find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the standard few-shot exemplars come from lm-evaluation-harness, which is not installed: "
                           "pip install 'vocagno[eval]', or give a few-shot file (fewshot_dir= / fewshot_files.<task>=)")
    path = Path(next(iter(spec.submodule_search_locations)), "tasks", *parts)
    if not path.is_file():
        raise ConfigError(f"this lm-evaluation-harness has no {'/'.join(parts)}: give a few-shot file instead")
    return path


def _gsm8k_cot() -> list[Exemplar]:
    config = yaml.safe_load(lm_eval_task_file("gsm8k", "gsm8k-cot.yaml").read_text(encoding="utf-8"))
    return [Exemplar(question=s["question"], target=s["target"]) for s in config["fewshot_config"]["samples"]]


def _minerva_math() -> list[Exemplar]:
    """Read from the source of ``lm_eval/tasks/minerva_math/utils.py`` (the literal list that
    ``list_fewshot_samples`` returns) rather than importing it: importing needs ``lm_eval[math]``,
    whose antlr4 4.11 breaks Hydra's (4.9)."""

    source = lm_eval_task_file("minerva_math", "utils.py").read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "list_fewshot_samples":
            returned = next(n.value for n in ast.walk(node) if isinstance(n, ast.Return))
            return [Exemplar(question=s["problem"], target=s["solution"]) for s in ast.literal_eval(returned)]
    raise ConfigError("lm_eval/tasks/minerva_math/utils.py has no list_fewshot_samples(): "
                       "give a few-shot file for math (fewshot_files.math=)")


# ---- prompts ---------------------------------------------------------------------------------

def render_question(spec: TaskSpec, question: str, choices: tuple[str, ...] | None) -> str:
    if choices:
        question += "\nAnswer Choices: " + " ".join(f"({LETTERS[i]}) {c}" for i, c in enumerate(choices))
    return spec.template.question.format(question=question)


def fewshot_prefix(spec: TaskSpec, shots: list[Exemplar]) -> str:
    """The exemplars, each followed by the shot separator ('' for zero-shot)."""
    t = spec.template
    return "".join(render_question(spec, s.question, s.choices) + t.target_sep + s.target + t.shot_sep for s in shots)


def build_prompt(spec: TaskSpec, prefix: str, record: Record) -> str:
    return prefix + render_question(spec, record.question, record.choices)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to the first stop sequence."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()

