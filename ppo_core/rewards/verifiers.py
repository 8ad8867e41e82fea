"""Answer checking for RL with verifiable rewards: pull the final answer out of a response, compare numbers exactly.

    extract_boxed("so the answer is $\\boxed{\\frac{1}{2}}$")   -> "\\frac{1}{2}"
    extract_gsm8k("3 + 4 = 7 apples.\\n#### 7")                 -> "7"
    extract_last_number("It costs $1,000.50 in total.")        -> "1000.50"
    parse_number("\\dfrac{3}{4}") == parse_number("0.75")      -> True   (both Fraction(3, 4))
    math_reward("... \\boxed{1,000}", "1000")                  -> 1.0

The three extractors follow the formats math RL data uses: GSM8K's reference solutions end in a line
`#### <answer>` (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems"); MATH's end in
`\\boxed{<answer>}` (Hendrycks et al. 2021, "Measuring Mathematical Problem Solving With the MATH Dataset");
and a model that uses neither is often read by its last number, as the usual GSM8K evaluations do.
Numbers are compared as `fractions.Fraction`, exactly: "0.5" = "0.50" = "1/2" = "\\frac{1}{2}", and no
floating-point rounding can make 0.1 + 0.2 differ from 0.3.

All functions are pure, take and return plain strings (or None when there is no answer) and never raise
on any text. Everything here is written for this library; the behaviour of `extract_boxed` matches
`last_boxed_only_string` of the MATH repository (hendrycks/math) on well-formed input, except that
`\\{` and `\\}` (literal braces) do not count as grouping braces and the form without braces
(`\\boxed 5`) is not read.
"""
import re

from ..data.numbers import extract_gsm8k, numbers_equal, parse_number, remove_thousands_commas  # noqa: F401

# ---------------------------------------------------------------------------------------- extraction

# A number as written in text: an optional sign (only where it cannot be a binary minus, i.e. not right
# after a letter, digit or closing bracket), digits with or without thousands separators ("1,000"),
# an optional decimal part, an optional exponent ("1e3"); or a bare decimal part (".5").
_NUMBER_IN_TEXT = re.compile(
    r"(?<![\w.)\]}])[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"  # 1,000.50  -3  1e3
    r"|(?<![\w.)\]}])[-+]?\.\d+(?:[eE][-+]?\d+)?"  # .5  -.5
    r"|(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"  # a number right after a letter: x2 -> 2
)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` or `\\fbox{...}`, stripped; nested braces are kept whole.

    None when there is no `\\boxed{` / `\\fbox{`, or when the last one's braces never close. A backslash
    escapes the character after it, so `\\{` and `\\}` (literal braces in LaTeX) do not open or close a
    group. "Last" means the one that starts last in the text.

    >>> extract_boxed("first \\\\boxed{1}, then \\\\boxed{\\\\frac{1}{2}}")
    '\\\\frac{1}{2}'
    >>> extract_boxed("\\\\fbox{ 42 }")
    '42'
    >>> extract_boxed("\\\\boxed{\\\\{1, 2\\\\}}")
    '\\\\{1, 2\\\\}'
    >>> extract_boxed("\\\\boxed{\\\\frac{1}{2}") is None
    True
    """
    starts = list(_BOXED.finditer(text))
    if not starts:
        return None
    begin = starts[-1].end()  # just after the opening brace
    depth, i = 1, begin
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # a control symbol such as \{ or \\ is one unit
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
        i += 1
    return None


def extract_last_number(text: str) -> str | None:
    """The last number in the text, as written but with thousands commas removed; None if there is none.

    A number has an optional sign, digits (with "," thousands separators or without), an optional
    decimal part and an optional exponent. A "-" or "+" right after a letter, digit or closing bracket is
    read as an operator, not as a sign ("5-3" ends in the number "3"). A trailing "." is punctuation.

    >>> extract_last_number("I had 5 apples, ate -2, and paid $1,000.50.")
    '1000.50'
    >>> extract_last_number("10-3=7, so x is -7")
    '-7'
    >>> extract_last_number("no digits here") is None
    True
    """
    numbers = _NUMBER_IN_TEXT.findall(text)
    return remove_thousands_commas(numbers[-1]) if numbers else None


# ---------------------------------------------------------------------------------------- reward

def extract_answer(response: str) -> str | None:
    """The response's final answer: the last \\boxed{...} if any, else the "####" line, else the last number."""
    for extract in (extract_boxed, extract_gsm8k, extract_last_number):
        answer = extract(response)
        if answer is not None:
            return answer
    return None


def normalize_whitespace(text: str) -> str:
    """Strip and collapse every run of whitespace to one space: " x  =\\n2 " -> "x = 2"."""
    return " ".join(text.split())


def math_reward(response: str, answer) -> float:
    """1.0 if the response's final answer (extract_answer) equals `answer`, else 0.0.

    Equal means numerically equal (numbers_equal, exact) when both parse as numbers, and otherwise equal
    as strings after normalize_whitespace. `answer` is the final answer itself ("72", 72, "\\frac{\\pi}{2}"),
    not a whole reference solution. A response with no answer at all scores 0.0.

    >>> math_reward("so the total is \\\\boxed{1,000}", "1000"), math_reward("#### 0.50", "1/2")
    (1.0, 1.0)
    >>> math_reward("The area is \\\\boxed{\\\\frac{\\\\pi}{2}}", "\\\\frac{\\\\pi}{2}"), math_reward("I give up", "3")
    (1.0, 0.0)
    """
    extracted = extract_answer(response)
    if extracted is None:
        return 0.0
    if parse_number(extracted) is not None and parse_number(answer) is not None:
        return 1.0 if numbers_equal(extracted, answer) else 0.0
    return 1.0 if normalize_whitespace(extracted) == normalize_whitespace(str(answer)) else 0.0


def last_number_reward(prompts: list[str], responses: list[str], answer: list) -> list[float]:
    """A reward function for rows with an "answer" column: 1.0 where the response's last number
    (extract_last_number) equals the answer exactly, else 0.0. The prompts are not read.

    >>> last_number_reward(["What is 59 + 63?"] * 3, ["122", "59 + 63 = 122.", "It is 121"], ["122"] * 3)
    [1.0, 1.0, 0.0]
    """
    return [1.0 if numbers_equal(extract_last_number(r), a) else 0.0 for r, a in zip(responses, answer)]

