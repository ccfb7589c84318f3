"""The answer a completion states, for the ``math`` reward to check.

math-verify, handed a whole completion, parses whatever expression it finds there: a completion that
only restates the question ("To add 86 + 40, we need", "2+2") is equal to the answer, and a model
learns to do nothing else within a few GRPO steps. So only a stated answer is checked, the first
of, in this order:

1. the last ``\\boxed{...}`` (or ``\\fbox{...}``); one left unclosed states nothing;
2. what follows the last "answer is" / "answer:", up to the end of its clause;
3. what follows the last "=", when it runs to the end of the completion ("x = 1/2");
4. a math span (``$...$``, ``\\(...\\)``, ``\\[...\\]``) that ends the completion;
5. the last number, when it stands alone: not an operand ("86 + 40", "x^2", "86/2"; a fraction
   in lowest terms, "1/2", is a number) and not followed by a trailing operator ("63 * 2 =").

A value from 1-4 that is arithmetic still to be done on plain numbers ("86 + 40", "63 \\times 2",
or the operands side by side, "73 10", which math-verify reads as their sum), after its last "="
if it has one, states nothing either; fractions, powers, roots and symbols
("1/2", "2^{10}", "1 + 2\\sqrt{3}") are values.
"""

from __future__ import annotations

import math
import re

_OPERATOR = r"(?:[-+*/^×·÷−]|\\times|\\cdot|\\div)"
_ENDS_WITH_OPERATOR = re.compile(rf"(?:{_OPERATOR}|=)\s*\Z")
_AFTER_TERM = re.compile(rf"(?:{_OPERATOR}|[{{_])\s*\Z")
_BEFORE_TERM = re.compile(rf"\s*(?:{_OPERATOR}|[}}_])")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_MARKER = re.compile(r"\banswer\s*(?:is\b(?!')\s*:?|:|=)", re.IGNORECASE)
_EQUALS = re.compile(r"(?<![<>!=])=(?!=)")
_CLAUSE_END = re.compile(r"\n|[.!;](?=\s|\Z)|,\s+(?=[A-Za-z]{2})")
_CLOSING_MATH = re.compile(
    r"(?:\$\$?([^$]+)\$\$?|\\\(((?:(?!\\\().)+)\\\)|\\\[((?:(?!\\\[).)+)\\\])[\s.,;!]*\Z", re.DOTALL
)
_NUMBER = re.compile(r"(?<![A-Za-z0-9.])\d+(?:,\d{3}(?!\d))*(?:\.\d+)?(?:/\d+(?!\.?\d))?")
_PLAIN = r"\d+(?:\.\d+)?(?![\w.^_{(]|\\(?![,;:! ]))"  # followed by no term, a LaTeX space aside
_SIDE_BY_SIDE = r"(?:\s|\\[,;:! ]|~)+"  # math-verify adds plain numbers set side by side: "73 10" is 83
_ARITHMETIC = re.compile(
    rf"(?<![\w.^_{{}}\\]){_PLAIN}(?:\s*(?:[-+*×·÷−]|\\times|\\cdot|\\div)\s*[-+−]?|{_SIDE_BY_SIDE}){_PLAIN}"
)


def stated_answer(completion: str) -> str | None:
    """The value ``completion`` states as its answer, or None when it states none."""
    completion = completion.replace("**", "")  # markdown bold, not a power: "**Answer:** 126"
    for find in (_boxed, _after_marker, _after_closing_equals, _closing_math):
        value = find(completion)
        if value is not None:
            return value if value and not _unfinished(value) else None
    return _last_number(completion)


def _clean(value: str) -> str:
    """``value`` without surrounding space, sentence punctuation or math delimiters."""
    while True:
        stripped = value.strip().rstrip(".,;!").strip("$").removeprefix("\\(").removeprefix("\\[")
        stripped = stripped.removesuffix("\\)").removesuffix("\\]")
        if stripped == value:
            return value
        value = stripped


def _unfinished(value: str) -> bool:
    """Whether ``value`` (after its last "=") is arithmetic on plain numbers still to be done."""
    return _ARITHMETIC.search(_EQUALS.split(value)[-1]) is not None


def _boxed(text: str) -> str | None:
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    start = boxes[-1].end()
    if text[start : start + 1] != "{":
        return ""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i].strip()
    return ""  # unclosed: cut off before its answer


def _clause(text: str) -> tuple[str, str]:
    """``text`` split at the end of its first clause: (the clause, what follows it)."""
    end = _CLAUSE_END.search(text)
    return (text, "") if end is None else (text[: end.start()], text[end.start() :])


def _after_marker(text: str) -> str | None:
    markers = list(_MARKER.finditer(text))
    if not markers:
        return None
    value = _clean(_clause(text[markers[-1].end() :])[0])
    return value or None  # "The answer is" with nothing after it: look further


def _after_closing_equals(text: str) -> str | None:
    equals = list(_EQUALS.finditer(text))
    if not equals:
        return None
    clause, rest = _clause(text[equals[-1].end() :])
    return _clean(clause) if not _clean(rest) else None


def _closing_math(text: str) -> str | None:
    span = _CLOSING_MATH.search(text)
    return None if span is None else _clean(next(group for group in span.groups() if group is not None))


def _last_number(text: str) -> str | None:
    numbers = list(_NUMBER.finditer(text))
    if not numbers or _ENDS_WITH_OPERATOR.search(text):
        return None
    number = numbers[-1]
    start = number.start()
    before = text[:start]
    if before[-1:] in ("-", "−", "+") and not re.search(r"[\d)}\]]\s*.\Z", before):
        start -= 1  # a sign, not a binary operator: "is -5", "(-5", but not "86 -40"
    if _AFTER_TERM.search(text[:start]) or _BEFORE_TERM.match(text[number.end() :]):
        return None  # a term of a larger expression: an operand, an exponent, a brace's content
    if "/" in number.group() and not _lowest_terms(number.group()):
        return None  # "86/2" is a division still to be done, "1/2" a value
    return text[start : number.end()].replace(",", "").replace("−", "-")


def _lowest_terms(fraction: str) -> bool:
    numerator, denominator = fraction.split("/")
    return numerator.isdigit() and int(denominator) > 1 and math.gcd(int(numerator), int(denominator)) == 1
