"""The embedded sample corpus: math-flavoured web text in OpenWebMath's schema, built from a seed.

The pipeline's default input must build without a download, so it is a synthetic stand-in for
OpenWebMath with the same Parquet layout (``train-0000i-of-0000N.parquet``; columns ``url``,
``text``, ``date``, ``metadata``, all strings, ``metadata`` a JSON string) and the same awkward
content real math pages hold, because that content is what the tokenizers, the alignment and the
teacher must survive:

* ``kind: "clean"`` (about 83%): pages of worked word problems with *correct* arithmetic
  (``Solution: 7 × 12 = 84``), equations solved step by step, definitions and theorems in LaTeX
  (``$\\frac{a}{b}$``, ``\\[ \\int_0^1 x^2\\,dx = \\frac13 \\]``, ``\\begin{align}``), forum Q&A
  threads, unicode maths (∑ ∫ √ ≤ ≠ π ∈ ℝ →, x², x₁), tab-separated tables, occasional emoji
  (including ZWJ sequences such as 👨‍👩‍👧 and flags such as 🇩🇪), Chinese/Japanese/Korean sentences,
  Windows newlines, tabs and runs of spaces. Numbers, names and topics vary widely, and every result
  is computed, so a tiny teacher trained on the clean part can learn real regularities.
  1% of documents are very long problem collections (20k-60k characters), which exercise windowed
  scoring; 1% quote special-token strings (``<|endoftext|>``, ``<s>``, ``</s>``, ``<|im_start|>``)
  as plain text, which must never become control tokens.
* ``kind: "noise"`` (about 15%): repeated navigation and cookie-banner boilerplate, random
  alphanumeric strings, broken HTML, shuffled-word gibberish: the low-value tokens the method should
  learn to skip.
* ``kind: "empty"`` (6 rows at fixed, spread-out positions): ``""``, whitespace-only texts and nulls,
  the bad rows every real dump contains.

Everything is a pure function of ``(n_docs, seed)``: each document draws from its own
``random.Random`` seeded with ``"<seed>/<index>"`` (string seeds are hashed with SHA-512 by
``random``, never with ``hash()``), so the same parameters give byte-identical Parquet files.
Rare features sit at fixed slots (long pages at ``i % 100 == 41``, special-token pages at
``i % 100 == 67``) so any corpus of a few hundred documents contains each of them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["CORPUS_SCHEMA", "generate_documents", "build_sample_corpus", "clean_texts", "arithmetic_problems"]

CORPUS_SCHEMA = pa.schema(
    [
        pa.field("url", pa.string()),
        pa.field("text", pa.string()),
        pa.field("date", pa.string()),
        pa.field("metadata", pa.string()),
    ]
)

# Bump when the generated content changes: it is part of the cache key in _BUILD.json.
GENERATOR_VERSION = 1
STAMP_NAME = "_BUILD.json"
PARQUET_OPTIONS = dict(compression="zstd", compression_level=3, row_group_size=256)

NOISE_SHARE = 0.15
LONG_SLOT = 41  # i % 100 == LONG_SLOT: a 20k-60k character problem collection
SPECIAL_SLOT = 67  # i % 100 == SPECIAL_SLOT: a page quoting special-token strings
BAD_TEXTS = ("", "   \n\t ", None, "", "\r\n\r\n", None)  # kind "empty", spread over the corpus
SPECIAL_TOKEN_STRINGS = ("<|endoftext|>", "</s>", "<s>", "<|im_start|>")

# --------------------------------------------------------------------------------------------------
# Vocabulary pools
# --------------------------------------------------------------------------------------------------

NAMES = (
    "Alice", "Bob", "Carmen", "Dmitri", "Aisha", "Kenji", "Priya", "Lukas", "Fatima", "Mateo",
    "Ingrid", "Wei", "Olu", "Sofia", "Hiro", "Noor", "Tomás", "Zara", "Ivan", "Leila", "Arjun",
    "Mei", "Jonas", "Amara", "Pablo", "Yuki", "Emeka", "Hannah", "Omar", "Greta", "Sipho", "Chloé",
    "Rahul", "Astrid", "Kwame", "Ines", "Malik", "Freya", "Diego", "Anika",
)
ITEMS = (
    "apples", "pencils", "marbles", "stickers", "books", "tickets", "cookies", "stamps", "seashells",
    "bottles", "tiles", "coins", "cards", "bolts", "eggs", "oranges", "crayons", "beads", "candles",
    "notebooks", "batteries", "tomatoes", "buttons", "postcards", "plums", "rulers", "lemons",
)
CONTAINERS = ("boxes", "bags", "crates", "packs", "jars", "trays", "baskets", "cartons", "tins")
GOODS = (
    "jacket", "bicycle", "laptop", "pair of shoes", "backpack", "lamp", "guitar", "tent", "kettle",
    "camera", "chair", "watch", "printer", "scooter", "telescope",
)
VEHICLES = ("train", "bus", "cyclist", "truck", "ferry", "car", "runner", "drone", "tractor")
COURSES = ("algebra", "geometry", "history", "biology", "chemistry", "physics", "French", "music")
USER_WORDS = ("math", "prime", "euler", "sqrt", "vector", "delta", "sigma", "tau", "lemma", "proof")
COMMENTS = (
    "Thanks, that makes sense now.",
    "Nice, I got the same answer.",
    "Could you explain the second step in more detail?",
    "You can always check the result by plugging it back in.",
    "This is a classic exercise, it shows up in most textbooks.",
    "I was overcomplicating it, thank you.",
    "Careful with the signs in the middle step.",
    "Great explanation, bookmarking this thread.",
)
REACTIONS = ("Thanks!", "Got it", "Nice", "Hope this helps", "Hmm", "Great", "Oops", "Done")
EMOJI = (  # grouped so every kind of grapheme cluster turns up
    ("🙂", "👍", "🤔", "😅", "🎉", "✅", "😀", "🙏"),
    ("👨\u200d👩\u200d👧", "👩\u200d💻", "🧑\u200d🏫"),  # ZWJ sequences
    ("🇩🇪", "🇯🇵", "🇧🇷", "🇫🇷", "🇮🇳"),  # flags: regional-indicator pairs
    ("👍🏽", "✌🏿", "👋🏻"),  # skin-tone modifiers
    ("❤️", "✔️", "☺️"),  # variation selector 16
)

_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")
_SUBSCRIPT = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")

# --------------------------------------------------------------------------------------------------
# Formatting helpers
# --------------------------------------------------------------------------------------------------


def _sup(n: int) -> str:
    return str(n).translate(_SUPERSCRIPT)


def _sub(n: int) -> str:
    return str(n).translate(_SUBSCRIPT)


def _tex_number(value: Fraction | int) -> str:
    """An exact rational in LaTeX: ``7``, ``\\frac{9}{4}`` or ``-\\frac{1}{3}``."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _poly(coeffs: list[int], var: str = "x") -> str:
    """Polynomial from coefficients, highest degree first: ``[1, -5, 6]`` -> ``x^2 - 5x + 6``."""
    terms = []
    degree = len(coeffs) - 1
    for power, c in zip(range(degree, -1, -1), coeffs):
        if c == 0:
            continue
        magnitude = "" if abs(c) == 1 and power > 0 else str(abs(c))
        monomial = "" if power == 0 else var if power == 1 else f"{var}^{power}"
        if not terms:
            terms.append(("-" if c < 0 else "") + magnitude + monomial)
        else:
            terms.append(("- " if c < 0 else "+ ") + magnitude + monomial)
    return " ".join(terms) if terms else "0"


def _root_factor(root: int) -> str:
    """``(x - 3)``, ``(x + 4)`` or ``x`` for a root of a monic linear factor."""
    if root == 0:
        return "x"
    return f"(x - {root})" if root > 0 else f"(x + {-root})"


def _paren(n: int) -> str:
    return f"({n})" if n < 0 else str(n)


def _user(rng: random.Random) -> str:
    return f"{rng.choice(USER_WORDS)}_{rng.choice(NAMES).lower()}{rng.randint(1, 999)}"


def _two_names(rng: random.Random) -> tuple[str, str]:
    first, second = rng.sample(NAMES, 2)
    return first, second


# --------------------------------------------------------------------------------------------------
# Problems: every generator returns a question and a worked answer with correct numbers
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # arithmetic answers start with "a op b = c"


def _multiply_problem(rng: random.Random) -> Problem:
    name, item, box = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b = rng.randint(2, 40), rng.randint(2, 48)
    op = rng.choice(("×", "*"))
    return Problem(
        f"{name} buys {a} {box} of {item}. Each of the {box} holds {b} {item}. "
        f"How many {item} does {name} buy in total?",
        f"{a} {op} {b} = {a * b}. {name} buys {a * b} {item}.",
    )


def _add_problem(rng: random.Random) -> Problem:
    (name, other), item = _two_names(rng), rng.choice(ITEMS)
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    return Problem(
        f"{name} has {a} {item}. {other} gives {name} another {b} {item}. How many {item} "
        f"does {name} have now?",
        f"{a} + {b} = {a + b}. {name} now has {a + b} {item}.",
    )


def _subtract_problem(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(20, 2000)
    b = rng.randint(1, a - 1)
    return Problem(
        f"A shop had {a} {item} in stock. {name} bought {b} of them. How many {item} are left?",
        f"{a} - {b} = {a - b}. There are {a - b} {item} left.",
    )


def _divide_problem(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    share, people = rng.randint(2, 30), rng.randint(2, 12)
    total = share * people
    op = rng.choice(("÷", "/"))
    return Problem(
        f"{name} shares {total} {item} equally among {people} friends. How many {item} does "
        "each friend get?",
        f"{total} {op} {people} = {share}. Each friend gets {share} {item}.",
    )


def _discount_problem(rng: random.Random) -> Problem:
    good, currency = rng.choice(GOODS), rng.choice(("€", "£", "USD "))
    price, pct = 20 * rng.randint(1, 40), 5 * rng.randint(1, 15)
    discount = price * pct // 100
    return Problem(
        f"A {good} costs {currency}{price}. During a sale it is {pct}% off. What is the sale price?",
        f"{price} - {discount} = {price - discount}, because {pct}% of {price} is {discount}. "
        f"The sale price is {currency}{price - discount}.",
    )


def _distance_problem(rng: random.Random) -> Problem:
    vehicle = rng.choice(VEHICLES)
    speed, hours = 5 * rng.randint(2, 30), rng.randint(2, 9)
    return Problem(
        f"A {vehicle} moves at a constant {speed} km/h for {hours} hours. How far does it travel?",
        f"{speed} × {hours} = {speed * hours}, so the {vehicle} covers {speed * hours} km.",
    )


def _mean_problem(rng: random.Random) -> Problem:
    name, course = rng.choice(NAMES), rng.choice(COURSES)
    count, mean = rng.randint(3, 6), rng.randint(55, 90)
    deviations = [0] * (count % 2)
    for _ in range(count // 2):  # pairs +d, -d keep the mean exact and every score <= 99
        d = rng.randint(1, 9)
        deviations += [d, -d]
    rng.shuffle(deviations)
    scores = [mean + d for d in deviations]
    listed = ", ".join(map(str, scores[:-1])) + f" and {scores[-1]}"
    return Problem(
        f"{name}'s {course} test scores are {listed}. What is the mean score?",
        f"The scores add up to {sum(scores)} and there are {count} of them, so the mean is "
        f"{sum(scores)} ÷ {count} = {mean}.",
    )


def _linear_problem(rng: random.Random) -> Problem:
    a, b, x = rng.randint(2, 12), rng.randint(1, 60), rng.randint(-15, 25)
    c = a * x + b
    return Problem(
        f"Solve ${a}x + {b} = {c}$ for $x$.",
        f"Subtract {b} from both sides: ${a}x = {c - b}$. Divide by {a}: $x = {x}$. "
        f"Check: ${a} \\cdot {_paren(x)} + {b} = {c}$.",
    )


def _quadratic_problem(rng: random.Random) -> Problem:
    r1, r2 = rng.randint(-12, 12), rng.randint(-12, 12)
    equation = _poly([1, -(r1 + r2), r1 * r2])
    if r1 == r2:
        solution = f"${_root_factor(r1)}^2 = 0$, a double root $x = {r1}$."
    else:
        solution = f"${_root_factor(r1)}{_root_factor(r2)} = 0$, so $x = {r1}$ or $x = {r2}$."
    return Problem(
        f"Find all real solutions of ${equation} = 0$.",
        f"We need two numbers with sum {r1 + r2} and product {r1 * r2}: {r1} and {r2}. "
        f"Hence {solution}",
    )


def _system_problem(rng: random.Random) -> Problem:
    x, y = rng.randint(-10, 10), rng.randint(-10, 10)
    while True:
        a, b, c, d = (rng.randint(1, 9) for _ in range(4))
        det = a * d - b * c
        if det != 0:
            break
    e, f = a * x + b * y, c * x + d * y
    return Problem(
        "Solve the system\n\\begin{align}\n"
        f"{_poly([a, 0])} + {_poly([b, 0], 'y')} &= {e} \\\\\n"
        f"{_poly([c, 0])} + {_poly([d, 0], 'y')} &= {f}\n\\end{{align}}",
        f"By Cramer's rule the determinant is $D = {a} \\cdot {d} - {b} \\cdot {c} = {det}$, so "
        f"$x = \\frac{{{e * d - b * f}}}{{{det}}} = {x}$ and "
        f"$y = \\frac{{{a * f - e * c}}}{{{det}}} = {y}$.",
    )


def _expand_problem(rng: random.Random) -> Problem:
    a = rng.randint(2, 15)
    return Problem(
        f"Expand $(x + {a})^2$.",
        "\\begin{align}\n"
        f"(x + {a})^2 &= x^2 + 2 \\cdot {a}x + {a}^2 \\\\\n"
        f"&= x^2 + {2 * a}x + {a * a}\n\\end{{align}}",
    )


def _integral_problem(rng: random.Random) -> Problem:
    upper, power = rng.randint(1, 6), rng.randint(1, 5)
    value = Fraction(upper ** (power + 1), power + 1)
    return Problem(
        f"Compute $\\int_0^{{{upper}}} x^{{{power}}}\\,dx$.",
        f"By the power rule,\n\\[ \\int_0^{{{upper}}} x^{{{power}}}\\,dx = "
        f"\\frac{{{upper}^{{{power + 1}}}}}{{{power + 1}}} = {_tex_number(value)}. \\]",
    )


def _derivative_problem(rng: random.Random) -> Problem:
    degree = rng.randint(2, 4)
    coeffs = [rng.randint(1, 9)] + [rng.randint(-9, 9) for _ in range(degree)]
    derivative = [c * (degree - k) for k, c in enumerate(coeffs[:-1])]
    x0 = rng.randint(-3, 4)
    value = sum(c * x0 ** (degree - 1 - k) for k, c in enumerate(derivative))
    return Problem(
        f"Let $f(x) = {_poly(coeffs)}$. Find $f'(x)$ and $f'({x0})$.",
        f"Differentiate term by term: $f'(x) = {_poly(derivative)}$, so $f'({x0}) = {value}$.",
    )


def _limit_problem(rng: random.Random) -> Problem:
    a = rng.randint(1, 12)
    return Problem(
        f"Evaluate $\\lim_{{x \\to {a}}} \\frac{{x^2 - {a * a}}}{{x - {a}}}$.",
        f"Factor the numerator: $\\frac{{(x - {a})(x + {a})}}{{x - {a}}} = x + {a}$ for "
        f"$x \\neq {a}$, so the limit is ${2 * a}$.",
    )


def _euclid_steps(a: int, b: int) -> list[str]:
    steps = []
    while b:
        steps.append(f"{a} = {a // b} \\cdot {b} + {a % b}")
        a, b = b, a % b
    return steps


def _gcd_problem(rng: random.Random) -> Problem:
    g = rng.randint(2, 30)
    a, b = g * rng.randint(2, 40), g * rng.randint(2, 40)
    a, b = max(a, b), min(a, b)
    if a == b:
        a += g
    steps = "\n".join(f"$${step}$$" for step in _euclid_steps(a, b))
    gcd = math.gcd(a, b)
    return Problem(
        f"Find $\\gcd({a}, {b})$ and $\\operatorname{{lcm}}({a}, {b})$.",
        f"Euclid's algorithm:\n{steps}\nThe last non-zero remainder is {gcd}, so "
        f"$\\gcd({a}, {b}) = {gcd}$ and $\\operatorname{{lcm}}({a}, {b}) = "
        f"\\frac{{{a} \\cdot {b}}}{{{gcd}}} = {a * b // gcd}$.",
    )


def _factorization_problem(rng: random.Random) -> Problem:
    primes = sorted(rng.choice((2, 2, 3, 3, 5, 7, 11, 13, 17)) for _ in range(rng.randint(2, 6)))
    n = math.prod(primes)
    powers = sorted({p: primes.count(p) for p in primes}.items())
    tex = " \\cdot ".join(f"{p}^{e}" if e > 1 else str(p) for p, e in powers)
    plain = " · ".join(f"{p}{_sup(e)}" if e > 1 else str(p) for p, e in powers)
    return Problem(
        f"Write {n} as a product of primes.",
        f"Dividing by the smallest prime factor again and again gives ${n} = {tex}$, "
        f"i.e. {n} = {plain}.",
    )


def _modpow_problem(rng: random.Random) -> Problem:
    base, exponent, modulus = rng.randint(2, 20), rng.randint(5, 60), rng.randint(5, 40)
    return Problem(
        f"Compute ${base}^{{{exponent}}} \\bmod {modulus}$.",
        f"By repeated squaring, ${base}^{{{exponent}}} \\equiv {pow(base, exponent, modulus)} "
        f"\\pmod{{{modulus}}}$.",
    )


def _binomial_problem(rng: random.Random) -> Problem:
    n = rng.randint(5, 20)
    k = rng.randint(2, n - 2)
    return Problem(
        f"In how many ways can a committee of {k} be chosen from {n} people?",
        f"Order does not matter, so the count is $\\binom{{{n}}}{{{k}}} = "
        f"\\frac{{{n}!}}{{{k}!\\,{n - k}!}} = {math.comb(n, k)}$.",
    )


def _dice_problem(rng: random.Random) -> Problem:
    target = rng.randint(2, 12)
    ways = sum(1 for a in range(1, 7) for b in range(1, 7) if a + b == target)
    return Problem(
        f"Two fair dice are rolled. What is the probability that the sum is {target}?",
        f"{ways} of the 36 equally likely outcomes give {target}, so the probability is "
        f"$\\frac{{{ways}}}{{36}} = {_tex_number(Fraction(ways, 36))}$.",
    )


def _arrangement_problem(rng: random.Random) -> Problem:
    n = rng.randint(3, 9)
    return Problem(
        f"How many different orders are there for {n} books on a shelf?",
        f"There are $n! = {n}! = {math.factorial(n)}$ orders.",
    )


def _pythagoras_problem(rng: random.Random) -> Problem:
    m = rng.randint(2, 7)
    n, k = rng.randint(1, m - 1), rng.randint(1, 4)
    a, b, c = k * (m * m - n * n), k * 2 * m * n, k * (m * m + n * n)
    return Problem(
        f"A ladder reaches {b} m up a wall and its foot stands {a} m from the wall. How long is it?",
        f"By Pythagoras, $c = \\sqrt{{{a}^2 + {b}^2}} = \\sqrt{{{a * a} + {b * b}}} = "
        f"\\sqrt{{{c * c}}} = {c}$, so the ladder is {c} m long.",
    )


def _circle_problem(rng: random.Random) -> Problem:
    r = rng.randint(1, 25)
    return Problem(
        f"What is the area of a circle of radius {r} cm?",
        f"$A = \\pi r^2 = {r * r}\\pi \\approx {r * r * math.pi:.2f}$ cm².",
    )


def _triangle_problem(rng: random.Random) -> Problem:
    alpha, beta = rng.randint(20, 100), rng.randint(20, 59)
    return Problem(
        f"Two angles of a triangle measure {alpha}° and {beta}°. Find the third angle.",
        f"The angles sum to 180°, so the third one is 180° − {alpha}° − {beta}° = "
        f"{180 - alpha - beta}°.",
    )


def _rectangle_problem(rng: random.Random) -> Problem:
    w, h = rng.randint(2, 60), rng.randint(2, 60)
    return Problem(
        f"A rectangular garden is {w} m wide and {h} m long. Find its area and perimeter.",
        f"{w} × {h} = {w * h}, so the area is {w * h} m²; the perimeter is "
        f"2 · ({w} + {h}) = {2 * (w + h)} m.",
    )


def _geometric_problem(rng: random.Random) -> Problem:
    first, ratio, n = rng.randint(1, 9), rng.randint(2, 5), rng.randint(3, 9)
    total = first * (ratio**n - 1) // (ratio - 1)
    return Problem(
        f"Find the sum of the first {n} terms of the geometric sequence with first term {first} "
        f"and ratio {ratio}.",
        f"$S_{{{n}}} = {first} \\cdot \\frac{{{ratio}^{{{n}}} - 1}}{{{ratio} - 1}} = {total}$.",
    )


def _arithmetic_series_problem(rng: random.Random) -> Problem:
    first, step, n = rng.randint(1, 30), rng.randint(1, 12), rng.randint(5, 60)
    last = first + (n - 1) * step
    return Problem(
        f"Add up the arithmetic sequence {first}, {first + step}, {first + 2 * step}, …, {last}.",
        f"It has {n} terms, so the sum is $\\frac{{{n}({first} + {last})}}{{2}} = "
        f"{n * (first + last) // 2}$.",
    )


# --------------------------------------------------------------------------------------------------
# Expository blocks: definitions, theorems, notes in unicode, tables
# --------------------------------------------------------------------------------------------------


def _gauss_theorem(rng: random.Random) -> str:
    n = rng.randint(5, 200)
    return (
        "Theorem (Gauss). For every positive integer $n$,\n"
        "\\[ \\sum_{k=1}^n k = \\frac{n(n+1)}{2}. \\]\n"
        f"For example, with $n = {n}$ we get $\\frac{{{n} \\cdot {n + 1}}}{{2}} = {n * (n + 1) // 2}$."
    )


def _squares_theorem(rng: random.Random) -> str:
    n = rng.randint(3, 50)
    return (
        "Proposition. The sum of the first $n$ squares is\n"
        "\\[ \\sum_{k=1}^{n} k^2 = \\frac{n(n+1)(2n+1)}{6}. \\]\n"
        f"Proof sketch: induction on $n$. Check: for $n = {n}$ both sides equal "
        f"${n * (n + 1) * (2 * n + 1) // 6}$."
    )


def _ftc_theorem(rng: random.Random) -> str:
    b = rng.randint(2, 9)
    return (
        "Theorem (fundamental theorem of calculus). If $F$ is differentiable on $[a, b]$ and "
        "$F' = f$ is continuous, then\n\\[ \\int_a^b f(x)\\,dx = F(b) - F(a). \\]\n"
        "A first example: \\[ \\int_0^1 x^2\\,dx = \\frac13 \\] and, with $F(x) = \\frac{x^3}{3}$, "
        f"$\\int_0^{{{b}}} x^2\\,dx = {_tex_number(Fraction(b**3, 3))}$."
    )


def _pythagoras_theorem(rng: random.Random) -> str:
    a, b, c = rng.choice(((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29)))
    return (
        "Theorem (Pythagoras). In a right triangle with legs $a, b$ and hypotenuse $c$,\n"
        "\\[ a^2 + b^2 = c^2. \\]\n"
        f"Example: ${a}^2 + {b}^2 = {a * a} + {b * b} = {c * c} = {c}^2$."
    )


def _binomial_theorem(rng: random.Random) -> str:
    a = rng.randint(2, 9)
    return (
        "The binomial theorem states $(x + y)^n = \\sum_{k=0}^{n} \\binom{n}{k} x^k y^{n-k}$. "
        "For $n = 3$:\n\\begin{align}\n"
        f"(x + {a})^3 &= x^3 + 3 \\cdot {a} x^2 + 3 \\cdot {a}^2 x + {a}^3 \\\\\n"
        f"&= x^3 + {3 * a}x^2 + {3 * a * a}x + {a**3}\n\\end{{align}}"
    )


def _prime_definition(rng: random.Random) -> str:
    bound = rng.randint(20, 80)
    primes = [p for p in range(2, bound) if all(p % d for d in range(2, math.isqrt(p) + 1))]
    return (
        "Definition. A natural number $p > 1$ is prime if its only positive divisors are $1$ and "
        f"$p$. The primes below {bound} are {', '.join(map(str, primes))}; there are {len(primes)} "
        "of them."
    )


def _fraction_rule(rng: random.Random) -> str:
    a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
    total = Fraction(a, b) + Fraction(c, d)
    unreduced = f"\\frac{{{a * d + b * c}}}{{{b * d}}}"
    reduced = "" if total.denominator == b * d else f" = {_tex_number(total)}"
    return (
        "Rule. $\\frac{a}{b} + \\frac{c}{d} = \\frac{ad + bc}{bd}$ for $b, d \\neq 0$. "
        f"So $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}} = {unreduced}{reduced}$."
    )


def _limit_definition(rng: random.Random) -> str:
    return (
        "Definition. lim_{x→a} f(x) = L means: ∀ε > 0 ∃δ > 0 such that 0 < |x − a| < δ ⇒ "
        "|f(x) − L| < ε. For example lim_{n→∞} 1/n = 0, and 1/n ≤ ε as soon as n ≥ 1/ε."
    )


def _unicode_notes(rng: random.Random) -> str:
    r, n, upper = rng.randint(2, 30), rng.randint(3, 40), rng.randint(1, 6)
    r1, r2 = rng.randint(-9, 9), rng.randint(-9, 9)
    k = rng.choice((2, 3, 4, 6))
    sines = {2: "1", 3: "√3/2", 4: "√2/2", 6: "1/2"}
    integral = Fraction(upper**3, 3)
    sentences = [
        "For every x ∈ ℝ we have x² ≥ 0, with equality only for x = 0.",
        f"√{r * r} = {r}, since {r}² = {r * r}.",
        f"∑_{{k=1}}^{{{n}}} k = {n * (n + 1) // 2} and ∑_{{k=1}}^{{{n}}} (2k − 1) = {n}² = {n * n}.",
        f"∫₀{_sup(upper)} x² dx = {integral.numerator}"
        + (f"/{integral.denominator}" if integral.denominator > 1 else "") + ".",
        f"If θ = π/{k} then sin θ = {sines[k]}.",
        f"The roots x₁ = {r1} and x₂ = {r2} satisfy x₁ + x₂ = {r1 + r2} and x₁·x₂ = {r1 * r2}.",
        "π ≈ 3.14159, e ≈ 2.71828, and a ≠ b ⇒ (a − b)² > 0.",
        f"As n → ∞, 1/n → 0, while 2ⁿ → ∞; already 2{_sup(n)} = {2**n}.",
        f"x{_sub(0)} = {r} and x{_sub(n)} = x{_sub(0)} + {n} = {r + n}.",
    ]
    return "Notes: " + " ".join(rng.sample(sentences, rng.randint(3, 5)))


def _value_table(rng: random.Random) -> str:
    start = rng.randint(1, 30)
    rows = [f"{n}\t{n * n}\t{n**3}\t{2**n}" for n in range(start, start + rng.randint(4, 8))]
    return "Table of powers:\nn\tn²\tn³\t2ⁿ\n" + "\n".join(rows)


# --------------------------------------------------------------------------------------------------
# Non-latin sentences (computed, so they are correct too)
# --------------------------------------------------------------------------------------------------


def _cjk_sentence(rng: random.Random) -> str:
    a, b, x = rng.randint(2, 9), rng.randint(1, 30), rng.randint(1, 20)
    c = a * x + b
    g = rng.randint(2, 12)
    p, q = g * rng.randint(2, 9), g * rng.randint(2, 9)
    share, people = rng.randint(2, 12), rng.randint(2, 9)
    options = (
        f"设 x 为实数，且 {a}x + {b} = {c}，求 x。解：x = {x}。",
        f"例题：求 {p} 与 {q} 的最大公约数。答案：{math.gcd(p, q)}。",
        f"已知直角三角形的两条直角边分别为 {3 * g} 和 {4 * g}，则斜边长为 {5 * g}。",
        f"x を実数とする。{a}x + {b} = {c} のとき、x = {x} である。",
        f"{share * people} 個のりんごを {people} 人で等分すると、1 人あたり {share} 個になります。",
        f"{a} 더하기 {b}는 {a + b}입니다. 따라서 답은 {a + b}입니다.",
    )
    return rng.choice(options)


# --------------------------------------------------------------------------------------------------
# Topics and page assembly
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Topic:
    label: str
    problems: tuple[Callable[[random.Random], Problem], ...]
    notes: tuple[Callable[[random.Random], str], ...]
    weight: int


TOPICS = (
    Topic(
        "arithmetic",
        (_multiply_problem, _add_problem, _subtract_problem, _divide_problem, _discount_problem,
         _distance_problem, _mean_problem),
        (_unicode_notes, _value_table, _fraction_rule),
        4,
    ),
    Topic(
        "algebra",
        (_linear_problem, _quadratic_problem, _system_problem, _expand_problem),
        (_binomial_theorem, _unicode_notes, _fraction_rule),
        3,
    ),
    Topic(
        "calculus",
        (_integral_problem, _derivative_problem, _limit_problem),
        (_ftc_theorem, _limit_definition, _unicode_notes),
        2,
    ),
    Topic(
        "number-theory",
        (_gcd_problem, _factorization_problem, _modpow_problem),
        (_prime_definition, _value_table, _unicode_notes),
        2,
    ),
    Topic(
        "combinatorics",
        (_binomial_problem, _dice_problem, _arrangement_problem),
        (_binomial_theorem, _fraction_rule),
        1,
    ),
    Topic(
        "geometry",
        (_pythagoras_problem, _circle_problem, _triangle_problem, _rectangle_problem),
        (_pythagoras_theorem, _unicode_notes),
        2,
    ),
    Topic(
        "series",
        (_geometric_problem, _arithmetic_series_problem),
        (_gauss_theorem, _squares_theorem, _value_table),
        1,
    ),
)
ALL_PROBLEMS = tuple(p for topic in TOPICS for p in topic.problems)

PAGE_TITLES = (
    "{Topic}: worked examples",
    "Lecture notes on {topic}, part {k}",
    "Worksheet #{k}: {topic} practice",
    "Help with {topic} homework",
    "{Topic} review problems with solutions",
    "Stuck on this {topic} question",
    "Daily {topic} puzzle #{k}",
)
INTROS = (
    "These notes collect a few worked examples on {topic}.",
    "Below are practice problems on {topic} with full solutions.",
    "Try each problem yourself before reading the solution.",
    "This thread is about {topic}; feel free to post your own solutions.",
    "Here is what we covered in class this week.",
    "A short review before the exam. Solutions are at the end of each problem.",
    "I have a test on {topic} next week and would like someone to check my work.",
)


@dataclass
class Page:
    text: str
    kind: str  # "clean" | "noise" | "empty"
    topic: str
    title: str = ""
    features: set[str] = field(default_factory=set)


def _title(rng: random.Random, topic: str) -> str:
    template = rng.choice(PAGE_TITLES)
    return template.format(topic=topic, Topic=topic.capitalize(), k=rng.randint(1, 99))


def _render_problem(problem: Problem, style: str, k: int, rng: random.Random) -> str:
    if style == "forum":
        reply = f"\n{_user(rng)}: {rng.choice(COMMENTS)}" if rng.random() < 0.5 else ""
        return f"Q: {problem.question}\nA: {problem.answer}{reply}"
    if style == "worksheet":
        return f"{k}. {problem.question}\n    Answer: {problem.answer}"
    return f"Example {k}. {problem.question}\nSolution: {problem.answer}"


def _page_blocks(rng: random.Random, topic: Topic, style: str, target_chars: int,
                 problems: tuple[Callable[[random.Random], Problem], ...]) -> list[str]:
    """Problems and notes of one page, until the page holds about ``target_chars`` characters."""
    blocks: list[str] = []
    size, k = 0, 0
    while size < target_chars:
        if topic.notes and rng.random() < 0.25:
            block = rng.choice(topic.notes)(rng)
        else:
            k += 1
            block = _render_problem(rng.choice(problems)(rng), style, k, rng)
        blocks.append(block)
        size += len(block) + 2
    return blocks


def _pick_topic(rng: random.Random) -> Topic:
    return rng.choices(TOPICS, weights=[t.weight for t in TOPICS])[0]


def _page_header(rng: random.Random, title: str, style: str, topic: str) -> str:
    intro = rng.choice(INTROS).format(topic=topic)
    if style == "forum":
        return f"{title}\nPosted by {_user(rng)}\n{intro}"
    return f"{title}\n\n{intro}"


def _clean_page(rng: random.Random) -> Page:
    topic = _pick_topic(rng)
    style = rng.choice(("textbook", "forum", "worksheet"))
    title = _title(rng, topic.label)
    blocks = _page_blocks(rng, topic, style, rng.randint(500, 2200), topic.problems)
    text = "\n\n".join([_page_header(rng, title, style, topic.label), *blocks])
    page = Page(text, "clean", topic.label, title)
    _decorate(page, rng)
    return page


def _long_page(rng: random.Random) -> Page:
    """A problem collection of 20k-60k characters drawn from every topic."""
    collection = Topic("collection", ALL_PROBLEMS, (_unicode_notes, _gauss_theorem), 0)
    title = f"Problem collection #{rng.randint(1, 500)}: exercises with solutions"
    blocks = _page_blocks(rng, collection, "worksheet", rng.randint(20_000, 60_000), ALL_PROBLEMS)
    page = Page("\n\n".join([title, *blocks]), "clean", "collection", title, {"long"})
    _decorate(page, rng)
    return page


def _special_token_page(rng: random.Random) -> Page:
    """A forum thread that quotes special-token strings; they must stay plain text."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    problem = rng.choice(ALL_PROBLEMS)(rng)
    title = "Why does my model print <|endoftext|> after the answer?"
    text = "\n\n".join(
        [
            title,
            f"Q: I fine-tuned a small model on math problems and its output ends with "
            f"<|endoftext|> followed by a new problem. Example prompt:\n{problem.question}",
            "A: GPT-2 style tokenizers use the literal string <|endoftext|> as document separator. "
            "Llama-style tokenizers use <s> to begin and </s> to end a sequence, and ChatML chat "
            "templates wrap each turn in <|im_start|> and <|im_end|>. When these strings occur in "
            "ordinary text they should be tokenized as text, not as control tokens.",
            f"A chat transcript looks like this:\n<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n"
            f"<|im_start|>assistant\n{a} + {b} = {a + b}<|im_end|>",
            f"And a Llama-2 prompt: <s>[INST] What is {a} × {b}? [/INST] {a} × {b} = {a * b} </s>",
            f"{_user(rng)}: {rng.choice(COMMENTS)}",
        ]
    )
    page = Page(text, "clean", "tokenizers", title, {"special_tokens"})
    _decorate(page, rng)
    return page


# --------------------------------------------------------------------------------------------------
# Decorations: the messy details of real pages, applied to clean pages
# --------------------------------------------------------------------------------------------------


def _insert_paragraph(text: str, paragraph: str, rng: random.Random) -> str:
    paragraphs = text.split("\n\n")
    paragraphs.insert(rng.randint(1, len(paragraphs)), paragraph)
    return "\n\n".join(paragraphs)


def _add_emoji(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    filled = [at for at, line in enumerate(lines) if line.strip()]
    for _ in range(rng.randint(1, 3)):
        emoji = rng.choice(rng.choice(EMOJI))
        at = rng.choice(filled)
        lines[at] = f"{lines[at]} {rng.choice(REACTIONS)} {emoji}"
    return "\n".join(lines)


def _add_cjk(text: str, rng: random.Random) -> str:
    sentences = " ".join(_cjk_sentence(rng) for _ in range(rng.randint(1, 3)))
    return _insert_paragraph(text, sentences, rng)


def _add_spacing_quirks(text: str, rng: random.Random) -> str:
    """Tab indents, trailing spaces and runs of spaces, as copy-pasted pages have."""
    lines = text.split("\n")
    for at in rng.sample(range(len(lines)), k=min(len(lines), rng.randint(1, 4))):
        quirk = rng.randrange(3)
        if quirk == 0:
            lines[at] = "\t" + lines[at]
        elif quirk == 1:
            lines[at] = lines[at] + " " * rng.randint(2, 6)
        else:
            lines[at] = lines[at].replace(" ", " " * rng.randint(2, 5), 2)
    return "\n".join(lines)


DECORATIONS = (  # (feature, probability for a clean page, function)
    ("emoji", 0.10, _add_emoji),
    ("cjk", 0.06, _add_cjk),
    ("spacing", 0.10, _add_spacing_quirks),
)
CRLF_SHARE = 0.05


def _decorate(page: Page, rng: random.Random) -> None:
    for feature, probability, apply in DECORATIONS:
        if rng.random() < probability:
            page.text = apply(page.text, rng)
            page.features.add(feature)
    if rng.random() < CRLF_SHARE:  # last, so inserted lines get Windows newlines too
        page.text = page.text.replace("\n", "\r\n")
        page.features.add("crlf")
    if "\t" in page.text:
        page.features.add("tabs")


# --------------------------------------------------------------------------------------------------
# Noise pages
# --------------------------------------------------------------------------------------------------

BOILERPLATE_LINES = (
    "Home | Forums | Tags | Users | Log in | Sign up",
    "We use cookies to personalise content and ads and to analyse our traffic. By continuing to "
    "browse you agree to our use of cookies. [Accept all] [Reject] [Manage preferences]",
    "© 2009–2023 Example Network. All rights reserved. Privacy policy · Terms of use",
    "Skip to main content",
    "Share on Twitter  Share on Facebook  Share via e-mail",
    "« Previous post | Next post »",
    "Subscribe to our newsletter! Enter your e-mail address:",
    "Page 1 of 37  « First ‹ Prev 1 2 3 … Next › Last »",
    "Related posts: Related posts: Related posts:",
    "Advertisement",
    "Loading…",
    "Menu ☰  Search 🔍",
)
HTML_FRAGMENTS = (
    '<div class="post-body"><p>Click <a href="/t/{n}">here</a',
    '<script type="text/javascript">var _q = _q || []; _q.push(["_track", "{n}"]);',
    "&nbsp;&nbsp;&amp;lt;br&amp;gt;&nbsp;",
    '</td></tr><tr><td class="cell-{n}">',
    "{{{{ comment.author }}}} wrote:",
    "<!-- ad slot {n} -->",
    '<img src="data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAA{n}" alt=""',
    "]]></style><style>.x{{color:#{n}}}",
    "<li><a href=\"?page={n}&amp;sort=new\">{n}</a></li></ul",
    "<br/><br/><br/></span></span>",
)
ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def _boilerplate_noise(rng: random.Random) -> str:
    lines = [rng.choice(BOILERPLATE_LINES) for _ in range(rng.randint(4, 10))]
    return "\n".join(lines * rng.randint(2, 6))


def _random_string_noise(rng: random.Random) -> str:
    words = ["".join(rng.choices(ALNUM, k=rng.randint(4, 40))) for _ in range(rng.randint(20, 120))]
    return rng.choice((" ", "\n", "&", "/")).join(words)


def _broken_html_noise(rng: random.Random) -> str:
    fragments = [rng.choice(HTML_FRAGMENTS) for _ in range(rng.randint(15, 60))]
    return "".join(f.format(n=rng.randint(1, 99999)) for f in fragments)


def _shuffled_word_noise(rng: random.Random) -> str:
    words = _clean_page(rng).text.split()
    rng.shuffle(words)
    return " ".join(words)


NOISE_MAKERS = (
    ("boilerplate", _boilerplate_noise),
    ("random-strings", _random_string_noise),
    ("broken-html", _broken_html_noise),
    ("shuffled-words", _shuffled_word_noise),
)


def _noise_page(rng: random.Random) -> Page:
    label, make = rng.choice(NOISE_MAKERS)
    return Page(make(rng), "noise", label, label)


# --------------------------------------------------------------------------------------------------
# Documents: url, date, metadata
# --------------------------------------------------------------------------------------------------

SITES = ("math", "forum.math", "notes", "www", "blog", "qa", "wiki", "homework", "lectures")


def _slug(title: str) -> str:
    words = re.findall(r"[a-z0-9]+", title.lower())
    return "-".join(words[:6]) or "page"


def _url(index: int, page: Page, rng: random.Random) -> str:
    host = f"{rng.choice(SITES)}.example.{rng.choice(('org', 'com', 'net'))}"
    return f"https://{host}/{page.topic}/{index}/{_slug(page.title)}"


def _date(rng: random.Random) -> str:
    return (
        f"{rng.randint(2008, 2023):04d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        f"T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"
    )


_MATH_MARKERS = re.compile(r"[$\\∑∫√≤≥≠π∞∈ℝ→²³]")


def _metadata(page: Page, rng: random.Random) -> str:
    text = page.text or ""
    clean = page.kind == "clean"
    info = {
        "found_math": bool(clean and _MATH_MARKERS.search(text)),
        "mathjax_inline_tex": text.count("$") // 2,
        "mathjax_display_tex": text.count("\\["),
        "align": text.count("\\begin{align}"),
        "math_score": round(rng.uniform(0.55, 1.0) if clean else rng.uniform(0.0, 0.35), 4),
        "perplexity": round(rng.uniform(3.0, 40.0) if clean else rng.uniform(200.0, 5000.0), 2),
    }
    meta = {"extraction_info": info, "kind": page.kind, "topic": page.topic,
            "features": sorted(page.features)}
    return json.dumps(meta, ensure_ascii=False)


def _bad_rows(n_docs: int) -> dict[int, str | None]:
    """Positions ``(2k+1)/12`` of the way through the corpus hold the empty/whitespace/null rows.

    A corpus of fewer than 12 documents has none, so tiny corpora stay usable.
    """
    if n_docs < 2 * len(BAD_TEXTS):
        return {}
    return {(2 * k + 1) * n_docs // 12: text for k, text in enumerate(BAD_TEXTS)}


def _page(index: int, rng: random.Random, bad_rows: dict[int, str | None], noise_share: float = NOISE_SHARE) -> Page:
    if index in bad_rows:
        return Page(bad_rows[index], "empty", "empty", "empty")
    if index % 100 == LONG_SLOT:
        return _long_page(rng)
    if index % 100 == SPECIAL_SLOT:
        return _special_token_page(rng)
    if rng.random() < noise_share:
        return _noise_page(rng)
    return _clean_page(rng)


def generate_documents(n_docs: int, seed: int = 0, noise_share: float = NOISE_SHARE) -> list[dict]:
    """``n_docs`` documents as dicts with keys url, text, date, metadata (a JSON string).

    ``noise_share`` is the chance that an ordinary slot holds a noise page (the long-page,
    special-token and empty slots are fixed); the default gives the embedded sample corpus.
    """
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    if not 0.0 <= noise_share <= 1.0:
        raise ValueError(f"noise_share must be in [0, 1], got {noise_share}")
    bad_rows = _bad_rows(n_docs)
    documents = []
    for index in range(n_docs):
        rng = random.Random(f"{seed}/{index}")
        page = _page(index, rng, bad_rows, noise_share)
        documents.append(
            {"url": _url(index, page, rng), "text": page.text, "date": _date(rng),
             "metadata": _metadata(page, rng)}
        )
    return documents


def arithmetic_problems(n: int, seed: int) -> list[Problem]:
    """``n`` worked problems (multiplication, addition, subtraction) whose answers start with
    ``a op b = c`` and then restate ``c``; deterministic in ``seed`` (for evaluation prompts)."""
    makers = (_multiply_problem, _add_problem, _subtract_problem)
    out = []
    for index in range(n):
        rng = random.Random(f"arithmetic/{seed}/{index}")
        out.append(makers[index % len(makers)](rng))
    return out


# --------------------------------------------------------------------------------------------------
# Parquet files, build stamp and cache
# --------------------------------------------------------------------------------------------------


def _file_names(n_files: int) -> list[str]:
    return [f"train-{i:05d}-of-{n_files:05d}.parquet" for i in range(n_files)]


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomically(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """Write under a temporary name in the same folder, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_parquet(path: pathlib.Path, documents: list[dict]) -> None:
    table = pa.Table.from_pylist(documents, schema=CORPUS_SCHEMA)
    _write_atomically(path, lambda tmp: pq.write_table(table, tmp, **PARQUET_OPTIONS))


def _read_stamp(out_dir: pathlib.Path) -> dict | None:
    try:
        return json.loads((out_dir / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _cached_paths(out_dir: pathlib.Path, params: dict) -> list[pathlib.Path] | None:
    """The files of a finished build with these parameters, if they are intact."""
    stamp = _read_stamp(out_dir)
    if not stamp or stamp.get("params") != params:
        return None
    paths = []
    for name, checksum in stamp.get("files", {}).items():
        path = out_dir / name
        if not path.is_file() or _sha256(path) != checksum:
            return None
        paths.append(path)
    return paths if [p.name for p in paths] == _file_names(params["n_files"]) else None


def _remove_previous_build(out_dir: pathlib.Path) -> None:
    """Drop the stamp and the files it lists, so no stale shard is read with the new ones."""
    stamp = _read_stamp(out_dir)
    (out_dir / STAMP_NAME).unlink(missing_ok=True)
    for name in (stamp or {}).get("files", {}):
        if re.fullmatch(r"train-\d{5}-of-\d{5}\.parquet", name):
            (out_dir / name).unlink(missing_ok=True)


def _split(documents: list[dict], parts: int) -> list[list[dict]]:
    """Contiguous chunks whose sizes differ by at most one, the larger ones first."""
    size, extra = divmod(len(documents), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(documents[start:end])
        start = end
    return chunks


def build_sample_corpus(
    out_dir: str | os.PathLike, n_docs: int = 3000, n_files: int = 4, seed: int = 0,
    noise_share: float = NOISE_SHARE,
) -> list[pathlib.Path]:
    """Write the corpus as ``n_files`` Parquet shards under ``out_dir`` and return their paths.

    A ``_BUILD.json`` stamp (parameters and each file's sha256) is written last; when it matches
    the parameters and the files on disk, the existing files are returned untouched.
    """
    if n_files < 1:
        raise ValueError(f"n_files must be >= 1, got {n_files}")
    out_dir = pathlib.Path(out_dir)
    params = {"n_docs": n_docs, "n_files": n_files, "seed": seed, "version": GENERATOR_VERSION}
    if noise_share != NOISE_SHARE:  # absent for the default, so existing builds stay valid
        params["noise_share"] = noise_share
    cached = _cached_paths(out_dir, params)
    if cached is not None:
        return cached

    documents = generate_documents(n_docs, seed, noise_share)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_previous_build(out_dir)
    paths = [out_dir / name for name in _file_names(n_files)]
    for path, chunk in zip(paths, _split(documents, n_files)):
        _write_parquet(path, chunk)

    stamp = {"params": params, "files": {p.name: _sha256(p) for p in paths}}
    body = json.dumps(stamp, indent=2, sort_keys=True) + "\n"
    _write_atomically(out_dir / STAMP_NAME, lambda tmp: tmp.write_text(body, encoding="utf-8"))
    return paths


def clean_texts(paths: Iterable[str | os.PathLike] | str | os.PathLike) -> list[str]:
    """Texts of the documents whose metadata says ``"kind": "clean"``, in file order.

    ``paths`` is a list of Parquet files, one file, or a folder holding ``train-*.parquet``.
    """
    if isinstance(paths, (str, os.PathLike)):
        path = pathlib.Path(paths)
        paths = sorted(path.glob("train-*.parquet")) if path.is_dir() else [path]
    texts = []
    for path in paths:
        table = pq.read_table(path, columns=["text", "metadata"])
        for text, metadata in zip(table.column("text").to_pylist(),
                                  table.column("metadata").to_pylist()):
            if text is not None and metadata and json.loads(metadata).get("kind") == "clean":
                texts.append(text)
    return texts
