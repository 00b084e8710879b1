"""Answer extraction, normalisation and equivalence for the evaluation stage (each form and negatives)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from pipeline.evaluation import answers as A
from pipeline.evaluation.tasks import TASKS, Record, score


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),  # GSM8K's gold form
    ("#### 1,234", "1234"),
    ("3 + 4 = 7. The answer is 42.", "42"),  # the marker wins over the last number
    ("The answer is 42. Then 7 more.", "42"),
    ("The final answer is 9", "9"),
    ("THE ANSWER IS 11", "11"),
    ("So the total is \\boxed{42}.", "42"),
    ("The answer is $1,234.50.", "1234.5"),  # dollars and thousands separators
    ("The answer is 1,000,000 people.", "1000000"),
    ("The answer is 18 apples.", "18"),  # trailing units
    ("The answer is 5 km/h.", "5"),
    ("The answer is -5 dollars.", "-5"),
    ("The answer is 50%.", "50"),
    ("The answer is 3/4.", "0.75"),  # fractions, as exact values
    ("The answer is \\frac{2}{3}.", "2/3"),
    ("The answer is .5", "0.5"),
    ("The answer is 7.0.", "7"),
    ("She has 20 - 12 = 8 left.", "8"),  # no marker: the last number
    ("First 3, then 2.5 more", "2.5"),
])
def test_numeric_extraction(text, expected):
    assert A.extract_numeric(text) == expected


@pytest.mark.parametrize("text", ["", "I do not know.", "The answer is unknown", "\\boxed{}"])
def test_numeric_extraction_without_a_number_is_none(text):
    assert A.extract_numeric(text) is None


@pytest.mark.parametrize("a, b, equal", [
    ("0.5", "1/2", True), ("0.75", "3/4", True), ("1234", "1234.0", True), ("2/3", "0.6666666667", False),
    ("42", "43", False), ("-5", "5", False), (None, "1", False),
])
def test_numbers_are_compared_exactly(a, b, equal):
    assert A.numbers_equal(a, b) is equal


def test_format_number_is_canonical():
    assert [A.format_number(Fraction(x)) for x in ("42", "-0.25", "1/3", "1/8", "1e3")] == ["42", "-0.25", "1/3", "0.125", "1000"]


@pytest.mark.parametrize("answer, gold", [
    ("He sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72"), ("9 (apples)", "9"), ("8.0", "8"), ("1,234", "1234"), ("-3", "-3"),
])
def test_numeric_gold(answer, gold):
    assert A.numeric_gold(answer) == gold


@pytest.mark.parametrize("text, expected", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # the last box, nested braces
    ("\\boxed{\\sqrt{x^{2}}}", "\\sqrt{x^{2}}"),
    ("\\fbox{7}", "7"),
    ("$\\boxed 5$", "5"),
    ("Final Answer: The final answer is $[2,5)$. I hope it is correct.", "$[2,5)$"),
    ("The answer is 12.", "12"),
])
def test_math_extraction(text, expected):
    assert A.extract_math(text) == expected


@pytest.mark.parametrize("text", ["no answer here", "\\boxed{\\frac{1}{2}", ""])
def test_math_extraction_negatives(text):
    assert A.extract_math(text) is None


@pytest.mark.parametrize("a, b", [
    ("\\frac{1}{2}", "0.5"), ("\\dfrac12", "\\frac{1}{2}"), ("\\tfrac{1}{2}", "1/2"), ("-\\frac{2}{3}", "-2/3"),
    ("\\frac{1}2", "\\frac{1}{2}"), ("x = 5", "5"), ("5 \\text{ cm}", "5"), ("90^\\circ", "90"), ("10\\%", "10"),
    ("\\left( 1, 2 \\right)", "(1,2)"), ("\\sqrt2", "\\sqrt{2}"), ("1,000", "1000"), (".5", "0.5"), ("5.0", "5"),
    ("$\\$12$", "12"), ("\\text{(A)}", "(A)"),
])
def test_math_equivalent_forms(a, b):
    assert A.math_equal(a, b)


@pytest.mark.parametrize("a, b", [
    ("\\frac{1}{3}", "0.33"), ("(1,2)", "(2,1)"), ("\\sqrt{2}", "\\sqrt{3}"), ("x^2", "x^3"), ("1,2", "12"), (None, "1"),
])
def test_math_different_answers(a, b):
    assert not A.math_equal(a, b)


@pytest.mark.parametrize("text, expected", [
    ("The answer is (B).", "B"), ("so the answer is c", "C"), ("Answer: D", "D"), ("(A) is wrong, (C) is right", "C"),
    ("B", "B"), ("(d).", "D"),
])
def test_choice_extraction(text, expected):
    assert A.extract_choice(text, "ABCDE") == expected


@pytest.mark.parametrize("text", ["The answer is (F).", "The answer is E", "I am not sure", "Because of this"])
def test_choice_extraction_negatives(text):
    assert A.extract_choice(text, "ABCD") is None


def test_choice_gold_forms():
    choices = ["12", "15", "18"]
    assert [A.choice_gold(a, choices) for a in ("b", "(C)", 0, "18")] == ["B", "C", "A", "C"]
    assert A.choice_gold(3, choices) is None and A.choice_gold("21", choices) is None and A.choice_gold(True, choices) is None


def test_mixed_answers_compare_numbers_or_phrases():
    spec = TASKS["tabmwp"]
    assert score(spec, "The answer is 1,200 dollars.", Record(1, "q", "1200")) == ("1200", True)
    assert score(spec, "The answer is Yes.", Record(1, "q", "yes")) == ("Yes", True)
    assert score(spec, "The answer is no.", Record(1, "q", "yes")) == ("no", False)
    assert score(spec, "I cannot tell.", Record(1, "q", "yes")) == (None, False)


def test_score_per_answer_type():
    assert score(TASKS["gsm8k"], "2 + 3 = 5. The answer is 5.", Record(1, "q", "5")) == ("5", True)
    assert score(TASKS["gsm8k"], "The answer is 6.", Record(1, "q", "5")) == ("6", False)
    assert score(TASKS["math"], "so $\\boxed{\\dfrac{1}{2}}$", Record(1, "q", "0.5")) == ("\\dfrac{1}{2}", True)
    assert score(TASKS["mathqa"], "The answer is (C).", Record(1, "q", "C", ("1", "2", "3"))) == ("C", True)
    # a letter beyond the record's choices is not an answer
    assert score(TASKS["mathqa"], "The answer is (D).", Record(1, "q", "C", ("1", "2", "3"))) == (None, False)
