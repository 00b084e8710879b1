"""Final answers out of chain-of-thought text, normalised, and compared.

Three kinds of answer:

* ``numeric`` (GSM8K, SVAMP, ASDiv, MAWPS, TabMWP): the number after ``####``, ``The answer is``
  or inside ``\\boxed{}``, else the last number of the text. Thousands separators, ``$``, ``%``,
  trailing units and a trailing full stop are dropped; ``1/2``, ``0.5`` and ``\\frac{1}{2}`` are the
  same number (exact rational comparison, no tolerance).
* ``math`` (MATH): the last ``\\boxed{...}`` (balanced braces), else ``The final answer is ...``.
  LaTeX is normalised (``\\dfrac`` -> ``\\frac``, ``\\frac12`` -> ``\\frac{1}{2}``, no ``\\left``,
  ``\\text{units}``, ``^\\circ``, ``$`` or spaces, ``x=`` dropped); two answers are equal when
  their normal forms are, or when both are rational numbers with the same value.
* ``choice`` (MathQA, MMLU-STEM, SAT): a letter, from ``The answer is (B)``, ``Answer: B`` or the
  last parenthesised letter.

Every extractor returns ``None`` when the text holds no answer; a ``None`` is never correct.
"""

from __future__ import annotations

import re
from fractions import Fraction

NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_OR_FRACTION = re.compile(
    rf"(?P<frac>\\[dt]?frac\{{(?P<fn>{NUMBER})\}}\{{(?P<fd>{NUMBER})\}})"
    rf"|(?P<num>{NUMBER})(?:\s*/\s*(?P<den>{NUMBER}))?"
)
_ANSWER_IS = re.compile(r"(?:final\s+)?answer\s+is\s*:?\s*(?P<rest>[^\n]*)", re.IGNORECASE)
_HASHES = re.compile(r"####\s*(?P<rest>[^\n]*)")


# ---- numbers ---------------------------------------------------------------------------------

def parse_number(text: str) -> Fraction | None:
    """The first number in ``text`` as an exact rational: ``1,234.5``, ``-3``, ``.5``, ``3/4``,
    ``\\frac{3}{4}``, ``$12``, ``50%`` (50); ``None`` if there is none."""
    m = _NUMBER_OR_FRACTION.search(text)
    if m is None:
        return None
    if m["frac"]:
        return _ratio(m["fn"], m["fd"])
    if m["den"]:
        return _ratio(m["num"], m["den"])
    return Fraction(m["num"].replace(",", ""))


def _ratio(num: str, den: str) -> Fraction | None:
    d = Fraction(den.replace(",", ""))
    return None if d == 0 else Fraction(num.replace(",", "")) / d


def last_number(text: str) -> Fraction | None:
    matches = list(_NUMBER_OR_FRACTION.finditer(text))
    return parse_number(matches[-1].group(0)) if matches else None


def format_number(x: Fraction | None) -> str | None:
    """Canonical text of a number: ``42``, ``-0.25``, ``1/3`` (a decimal when it is exact)."""
    if x is None:
        return None
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d == 1:  # a terminating decimal
        digits = max(_power(x.denominator, 2), _power(x.denominator, 5))
        return f"{float(x):.{digits}f}".rstrip("0").rstrip(".")
    return f"{x.numerator}/{x.denominator}"


def _power(n: int, p: int) -> int:
    k = 0
    while n % p == 0:
        n //= p
        k += 1
    return k


def extract_numeric(text: str) -> str | None:
    """The final numeric answer of a chain of thought, canonical (see :func:`format_number`)."""
    for span in _marked_answers(text):
        value = parse_number(span)
        if value is not None:
            return format_number(value)
    return format_number(last_number(text))


def _marked_answers(text: str) -> list[str]:
    """Text after the answer markers, most explicit first: the first ``####``, the last ``\\boxed{}``,
    the first ``answer is``."""
    spans = [m["rest"] for m in _HASHES.finditer(text)][:1]
    boxed = last_boxed(text)
    if boxed is not None:
        spans.append(boxed)
    spans += [m["rest"] for m in _ANSWER_IS.finditer(text)][:1]
    return spans


def numeric_gold(answer: str) -> str | None:
    """The gold number of a record: the part after ``####`` (GSM8K's form), else the first number
    (``"9 (apples)"`` -> 9, ``"8.0"`` -> 8)."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    boxed = last_boxed(answer)
    return format_number(parse_number(boxed if boxed is not None else answer))


# ---- LaTeX answers (MATH) --------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces (``\\boxed 5``
    too); ``None`` if there is none or it is unclosed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i) and not text.startswith(" {", i):
        rest = text[i + 1:].split("$")[0].split()
        return rest[0] if rest else None
    i = text.find("{", i)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


_FINAL_ANSWER = re.compile(r"final answer is\s*(?P<ans>.+?)(?:\.\s*I hope|\.?\s*$)", re.IGNORECASE | re.MULTILINE)


def extract_math(text: str) -> str | None:
    """The answer of a MATH solution: the last ``\\boxed{}``, else ``The final answer is $X$``,
    else ``The answer is X``."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_FINAL_ANSWER, _ANSWER_IS):
        found = [m.group(m.lastgroup) for m in pattern.finditer(text)]
        if found and found[-1].strip():
            return found[-1].strip().rstrip(".").strip()
    return None


def math_gold(answer: str) -> str:
    """A MATH record's answer: the last boxed expression of a full solution, or the answer itself."""
    boxed = last_boxed(answer)
    return (boxed if boxed is not None else answer).strip()


_TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\{\s*[a-zA-Z ]*\}\s*(?:\^\{?\d\}?)?$")
_REMOVE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\%", "%", "\\$", "$",
           "\\displaystyle")


def normalize_math(answer: str) -> str:
    """A normal form of a LaTeX answer, for string comparison."""
    s = answer.strip().replace("\n", "")
    s = _TEXT_UNIT.sub("", s).strip()  # trailing units: "5 \text{ cm}"
    for token in _REMOVE:
        s = s.replace(token, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:text|mbox|mathrm)\{(.*?)\}", r"\1", s)
    s = s.replace(" ", "").rstrip(".")
    s = re.sub(r"^[a-zA-Z]\w*=(?!=)", "", s)  # "x=5" -> "5" (one assignment)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\frac\{([^{}]+)\}(\d)", r"\\frac{\1}{\2}", s)  # \frac{1}2
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)  # \frac1{2}
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)  # \sqrt2
    if re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+)(?:\.\d+)?", s):
        s = s.replace(",", "")  # 1,000 (not the tuple "1,2")
    s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", s)  # .5 -> 0.5
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)  # 5.0 -> 5
    return s


def _as_rational(normal: str) -> Fraction | None:
    """The value of a normal form that is only a number, ``a/b`` or ``\\frac{a}{b}`` (signed)."""
    m = _NUMBER_OR_FRACTION.fullmatch(normal)
    if m is None:
        neg = re.fullmatch(r"-\\frac\{(\d+)\}\{(\d+)\}", normal)
        return -_ratio(neg[1], neg[2]) if neg and int(neg[2]) else None
    return parse_number(normal)


def math_equal(predicted: str | None, gold: str) -> bool:
    if predicted is None:
        return False
    a, b = normalize_math(predicted), normalize_math(gold)
    if a == b:
        return True
    x, y = _as_rational(a), _as_rational(b)
    return x is not None and x == y


# ---- letters (multiple choice) ---------------------------------------------------------------

def extract_choice(text: str, letters: str = "ABCDE") -> str | None:
    """The chosen letter: ``The answer is (B)``, ``answer: b``, else the last ``(B)``, else a text
    that is one letter."""
    cls = f"[{letters}{letters.lower()}]"
    for m in reversed(list(re.finditer(rf"answer\s*(?:is|:)\s*\(?({cls})\b\)?", text, re.IGNORECASE))):
        return m[1].upper()
    found = re.findall(rf"\(({cls})\)", text)
    if found:
        return found[-1].upper()
    lone = re.fullmatch(rf"\s*\(?({cls})\)?[.:]?\s*", text)
    return lone[1].upper() if lone else None


def choice_gold(answer: str | int, choices: list[str] | None, letters: str = "ABCDE") -> str | None:
    """A record's gold letter: a letter (``"b"``, ``"(B)"``), a 0-based index, or the text of one of
    ``choices``; ``None`` if it is none of these."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return letters[answer] if 0 <= answer < len(letters) and (choices is None or answer < len(choices)) else None
    text = str(answer).strip()
    if choices:
        letters = letters[: len(choices)]
    m = re.fullmatch(rf"\(?([{letters}{letters.lower()}])\)?", text)
    if m:
        return m[1].upper()
    if choices and text in choices:
        return letters[choices.index(text)]
    return None


# ---- short text or number (TabMWP) -----------------------------------------------------------

_ONLY_NUMBER = re.compile(rf"\s*\$?\s*(?:{NUMBER})(?:\s*/\s*(?:{NUMBER}))?\s*%?\s*\.?\s*")


def extract_text_answer(text: str) -> str | None:
    """The phrase after ``####`` or the first ``The answer is``, without the closing full stop."""
    for pattern in (_HASHES, _ANSWER_IS):
        m = pattern.search(text)
        if m and m["rest"].strip():
            return m["rest"].strip().rstrip(".").strip()
    return None


def normalize_text(answer: str) -> str:
    return " ".join(re.sub(r"[^\w\s./-]", " ", answer.lower()).split()).rstrip(".")


def is_only_number(answer: str) -> bool:
    return _ONLY_NUMBER.fullmatch(answer) is not None


def numbers_equal(predicted: str | None, gold: str | None) -> bool:
    """Exact rational equality of two canonical numbers (``None`` is never equal)."""
    if predicted is None or gold is None:
        return False
    return parse_number(predicted) == parse_number(gold)


def texts_equal(predicted: str | None, gold: str) -> bool:
    """Lower case, punctuation dropped, spaces collapsed."""
    return predicted is not None and normalize_text(predicted) == normalize_text(gold)
