"""Numbers read out of text, exactly: what the built-in tasks (ppo_core.data.tasks) and the reward verifiers
(ppo_core.rewards.verifiers, which exports these under its own name too) both parse.

    extract_gsm8k("3 + 4 = 7 apples.\\n#### 7")                 -> "7"
    parse_number("\\dfrac{3}{4}") == parse_number("0.75")      -> True   (both Fraction(3, 4))
    numbers_equal("1,000", 1000.0)                             -> True

Numbers are compared as `fractions.Fraction`: "0.5" = "0.50" = "1/2" = "\\frac{1}{2}", with no floating-point rounding.
All functions are pure and never raise on any text.
"""
import re
from fractions import Fraction

# A comma between a digit and a group of exactly three digits: a thousands separator.
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def remove_thousands_commas(text: str) -> str:
    """Drop the commas that separate groups of three digits; other commas stay.

    >>> remove_thousands_commas("1,234,567 and 1,5 and (1, 2)")
    '1234567 and 1,5 and (1, 2)'
    """
    return _THOUSANDS_COMMA.sub("", text)


def extract_gsm8k(text: str) -> str | None:
    """The answer after the last "####" (GSM8K's format): the rest of that line, stripped, with thousands
    commas removed. None when there is no "####" or nothing follows it on its line.

    Only the line of the last "####" is read, so an explanation on the following lines is ignored.

    >>> extract_gsm8k("Natalia sold 48 + 24 = 72 clips.\\n#### 72")
    '72'
    >>> extract_gsm8k("#### 1,000\\nbecause 10 * 100 = 1000")
    '1000'
    >>> extract_gsm8k("#### 3\\n#### 4 ")
    '4'
    >>> extract_gsm8k("the answer is 72") is None
    True
    """
    at = text.rfind("####")
    if at < 0:
        return None
    answer = text[at + 4 :].split("\n", 1)[0].strip()
    return remove_thousands_commas(answer) if answer else None



# A plain number: sign, digits (thousands commas allowed, but then in groups of three), decimals, exponent.
_PLAIN_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
# \frac{a}{b}, \dfrac{a}{b}, \tfrac{a}{b}, and the one-digit shorthand \frac34 of LaTeX.
_LATEX_FRAC = re.compile(r"([-+]?)\\[dt]?frac\s*(?:\{([^{}]*)\}|(\d))\s*(?:\{([^{}]*)\}|(\d))")


def parse_number(s) -> Fraction | None:
    """The exact value of a number written as text, or None when `s` is not (only) a number.

    Accepted, after stripping whitespace:
      - integers and decimals with an optional sign and thousands commas: "1000" = "+1000" = "1,000" =
        "1000.0" = "1,000.00"; ".5"; "5." (a trailing point);
      - an exponent: "1e3" = 1000, "2.5E-1" = 1/4;
      - fractions: "3/4", "-3 / 4", "\\frac{3}{4}", "\\dfrac{3}{4}", "\\tfrac{3}{4}", "\\frac34", "-\\frac{3}{4}",
        "\\frac{-3}{4}" (numerator and denominator are plain numbers; a zero denominator gives None);
      - around the number: a leading "$" or "\\$" (currency, or opening inline math) and a trailing "$"
        (closing inline math) are dropped; a trailing "%" or "\\%" is dropped WITHOUT dividing by 100, so
        "50%" = 50, matching datasets whose answer to "what percent" is the bare number; LaTeX's "{,}"
        thousands separator reads as ","; a Unicode minus "−" reads as "-".
    Not accepted: words, units, several numbers ("1 1/2", "3, 4"), "inf", "nan", malformed commas
    ("1,00"). Python ints, floats and Fractions are accepted too (a float by its shortest repr, so 0.1 is
    1/10); bools and None give None.

    >>> parse_number("$1,000.00") == 1000
    True
    >>> parse_number("\\\\dfrac{3}{4}")
    Fraction(3, 4)
    >>> parse_number("12 apples") is None
    True
    """
    if s is None or isinstance(s, bool):
        return None
    if isinstance(s, (int, Fraction)):
        return Fraction(s)
    if isinstance(s, float):
        return Fraction(repr(s)) if s == s and abs(s) != float("inf") else None
    if not isinstance(s, str):
        return None
    s = s.strip().replace("\u2212", "-").replace("{,}", ",")
    if s.startswith("\\$"):
        s = s[2:]
    elif s.startswith("$"):
        s = s[1:]
    if s.endswith("$") and not s.endswith("\\$"):
        s = s[:-1]
    if s.endswith("\\%"):
        s = s[:-2]
    elif s.endswith("%"):
        s = s[:-1]
    s = s.strip()
    if _PLAIN_NUMBER.fullmatch(s):
        return Fraction(s.replace(",", ""))
    frac = _LATEX_FRAC.fullmatch(s)
    if frac:
        sign, num_braced, num_digit, den_braced, den_digit = frac.groups()
        value = _divide(num_digit if num_braced is None else num_braced, den_digit if den_braced is None else den_braced)
        return -value if value is not None and sign == "-" else value
    numerator, slash, denominator = s.partition("/")
    if slash and "/" not in denominator:
        return _divide(numerator.strip(), denominator)
    return None


def _divide(numerator: str, denominator: str) -> Fraction | None:
    """numerator / denominator when both are plain numbers and the denominator is not 0, else None."""
    numerator, denominator = numerator.strip(), denominator.strip()
    if not (_PLAIN_NUMBER.fullmatch(numerator) and _PLAIN_NUMBER.fullmatch(denominator)):
        return None
    den = Fraction(denominator.replace(",", ""))
    return Fraction(numerator.replace(",", "")) / den if den != 0 else None


def numbers_equal(a, b, rel_tol=0) -> bool:
    """True when `a` and `b` both parse as numbers (parse_number) and are equal: exactly by default, or
    within |a - b| <= rel_tol * max(|a|, |b|) when rel_tol > 0 (rel_tol is read as a decimal, 1e-6 = 1/10**6).

    >>> numbers_equal("0.50", "1/2"), numbers_equal("1,000", 1000.0), numbers_equal("3", "x")
    (True, True, False)
    >>> numbers_equal("3.14159", "3.1416"), numbers_equal("3.14159", "3.1416", rel_tol=1e-4)
    (False, True)
    """
    x, y = parse_number(a), parse_number(b)
    if x is None or y is None:
        return False
    if not rel_tol:
        return x == y
    return abs(x - y) <= Fraction(str(rel_tol)) * max(abs(x), abs(y))
