"""ppo_core/rewards/verifiers.py against hand-worked examples: every extraction rule, every number form, the edge cases."""
from fractions import Fraction

import pytest

from ppo_core.rewards.verifiers import (
    extract_answer,
    extract_boxed,
    extract_gsm8k,
    extract_last_number,
    last_number_reward,
    math_reward,
    normalize_whitespace,
    numbers_equal,
    parse_number,
    remove_thousands_commas,
)

# ------------------------------------------------------------------------------------------- extract_gsm8k


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48/2 = 24 clips in May.\n48 + 24 = 72\n#### 72", "72"),  # a GSM8K reference solution
    ("#### 72", "72"),
    ("####72", "72"),                       # no space needed
    ("#### 72 \n", "72"),                   # stripped
    ("#### 1,000", "1000"),                 # thousands commas removed
    ("#### 1,234,567.50", "1234567.50"),
    ("#### -5", "-5"),
    ("#### 3\n#### 4", "4"),                # the last one
    ("#### 5\nbecause 2 + 3 = 5", "5"),     # only the rest of its line
    ("#### 12 apples", "12 apples"),        # the text, not only a number
    ("#### (1, 2)", "(1, 2)"),              # a comma that is not a thousands separator stays
    ("##### 9", "9"),                       # the last "####" of five #'s starts at the second
])
def test_extract_gsm8k(text, expected):
    assert extract_gsm8k(text) == expected


@pytest.mark.parametrize("text", ["the answer is 72", "", "### 72", "#### ", "####\n72", "# # # # 72"])
def test_extract_gsm8k_no_answer(text):
    assert extract_gsm8k(text) is None


# ------------------------------------------------------------------------------------------- extract_boxed


@pytest.mark.parametrize("text, expected", [
    (r"The answer is $\boxed{42}$.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),                       # nested braces
    (r"\boxed{\frac{\sqrt{3}}{2}} is it", r"\frac{\sqrt{3}}{2}"),   # nested two deep
    (r"first \boxed{1}, then \boxed{2}", "2"),                     # several: the last
    (r"\boxed{1} and \fbox{3}", "3"),                              # \fbox counts too
    (r"\fbox{3} and \boxed{1}", "1"),
    (r"\boxed { 7 }", "7"),                                         # space before the brace, content stripped
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),                              # escaped braces are not grouping braces
    (r"\boxed{a \\ b}", r"a \\ b"),                                  # \\ (a line break) is one unit
    (r"\boxed{}", ""),                                               # empty content is still an answer
    (r"\boxed{1,000}", "1,000"),                                     # content as written
    (r"\boxed{\boxed{5}}", "5"),                                     # the one that starts last
    (r"\boxed{2} then \boxed{\frac{1}{2}", None),                    # the last is unbalanced: None, no fallback
    (r"\boxed{\frac{1}{2}", None),                                   # unbalanced
    ("no box here", None),
    (r"\boxed 5", None),                                             # the brace-less form is not read
    (r"\boxedx{5}", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# ------------------------------------------------------------------------------------------- extract_last_number


@pytest.mark.parametrize("text, expected", [
    ("I had 5 apples and ate 2", "2"),
    ("The total is -7.", "-7"),             # a sign; the final "." is punctuation
    ("x = -7 and y = +3", "+3"),            # a sign is kept as written
    ("10-3=7", "7"),
    ("5-3", "3"),                           # "-" after a digit is a minus, not a sign
    ("x-3", "3"),                           # ... and after a letter
    ("(2)-3", "3"),                         # ... and after a closing bracket
    ("It costs $1,000.50.", "1000.50"),     # thousands separator and decimals
    ("1,000,000 people", "1000000"),
    ("1,0000", "0000"),                     # not a thousands separator: two numbers
    ("the list 1,2,3", "3"),
    ("a half is .5", ".5"),
    ("about -.25 of it", "-.25"),
    ("0.50", "0.50"),
    ("1e3 grams", "1e3"),
    ("2.5E-1", "2.5E-1"),
    ("3 equations", "3"),                   # "e" without digits is not an exponent
    ("x2", "2"),                            # a number right after a letter
    ("answer:-4", "-4"),
    ("no digits", None),
    ("", None),
])
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


def test_remove_thousands_commas():
    assert remove_thousands_commas("1,234,567 and 1,5 and (1, 2) and 12,3456") == "1234567 and 1,5 and (1, 2) and 12,3456"


# ------------------------------------------------------------------------------------------- parse_number


@pytest.mark.parametrize("text, expected", [
    ("1000", Fraction(1000)),
    ("1,000", Fraction(1000)),
    ("1000.0", Fraction(1000)),
    ("+1000", Fraction(1000)),
    ("1,000.00", Fraction(1000)),
    (" 1000 ", Fraction(1000)),
    ("1e3", Fraction(1000)),
    ("2.5E-1", Fraction(1, 4)),
    ("-42", Fraction(-42)),
    ("0.50", Fraction(1, 2)),
    ("0.5", Fraction(1, 2)),
    (".5", Fraction(1, 2)),
    ("5.", Fraction(5)),
    ("0.1", Fraction(1, 10)),                 # exact: not the float 0.1000000000000000055...
    ("3/4", Fraction(3, 4)),
    ("-3 / 4", Fraction(-3, 4)),
    ("1.5/3", Fraction(1, 2)),
    (r"\frac{3}{4}", Fraction(3, 4)),
    (r"\dfrac{3}{4}", Fraction(3, 4)),
    (r"\tfrac{3}{4}", Fraction(3, 4)),
    (r"\frac34", Fraction(3, 4)),             # LaTeX's one-digit shorthand
    (r"\frac{ 6 }{ 8 }", Fraction(3, 4)),
    (r"-\frac{3}{4}", Fraction(-3, 4)),
    (r"\frac{-3}{4}", Fraction(-3, 4)),
    (r"-\frac{-3}{4}", Fraction(3, 4)),
    ("$1,000", Fraction(1000)),               # currency
    (r"\$18.90", Fraction(189, 10)),          # MATH's escaped dollar
    (r"$\frac{1}{2}$", Fraction(1, 2)),       # inline math
    ("50%", Fraction(50)),                    # the percent sign is dropped, not divided by 100
    (r"50\%", Fraction(50)),
    ("1{,}000", Fraction(1000)),              # LaTeX thousands separator
    ("\u22125", Fraction(-5)),                # Unicode minus
    (7, Fraction(7)),
    (0.1, Fraction(1, 10)),                   # a float by its shortest repr
    (Fraction(2, 3), Fraction(2, 3)),
])
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("text", [
    None, True, "", "abc", "12 apples", "1 1/2", "3, 4", "1,00", "1,0000", "inf", "nan", "1/0", r"\frac{1}{0}",
    "$", "%", "1/2/3", r"\frac{x}{2}", "--5", "1_000", float("nan"), float("inf"), [1],
])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


# ------------------------------------------------------------------------------------------- numbers_equal


@pytest.mark.parametrize("a, b, expected", [
    ("1,000", "1000", True),
    ("1000.0", "+1000", True),
    ("0.50", "0.5", True),
    ("3/4", r"\dfrac{3}{4}", True),
    ("0.75", r"\frac{3}{4}", True),
    ("1,000.00", 1000, True),
    ("1e3", "1000", True),
    ("0.333", "1/3", False),               # exact by default
    ("-5", "5", False),
    ("x", "x", False),                     # not numbers
    (None, "1", False),
])
def test_numbers_equal(a, b, expected):
    assert numbers_equal(a, b) is expected


def test_numbers_equal_rel_tol():
    # |3.14159 - 3.1416| = 0.00001; max(|a|, |b|) = 3.1416; 1e-5 * 3.1416 = 0.000031416 >= 0.00001
    assert numbers_equal("3.14159", "3.1416", rel_tol=1e-5)
    assert not numbers_equal("3.14159", "3.1416", rel_tol=1e-6)  # 0.0000031416 < 0.00001
    # exactly at the bound: |100 - 99| = 1 = 0.01 * 100
    assert numbers_equal("100", "99", rel_tol=0.01)
    assert not numbers_equal("100", "98.99", rel_tol=0.01)


# ------------------------------------------------------------------------------------------- math_reward


@pytest.mark.parametrize("response, answer, expected", [
    (r"so the total is \boxed{1,000}", "1000", 1.0),
    (r"\boxed{0.50}", "1/2", 1.0),
    (r"\boxed{\frac{1}{2}}", 0.5, 1.0),
    (r"The answer is \boxed{7}. #### 8", "7", 1.0),                        # boxed wins over ####
    (r"The answer is \boxed{7}. #### 8", "8", 0.0),
    ("48 + 24 = 72\n#### 72", "72", 1.0),
    ("#### 72\nthough 71 is close", "72", 1.0),                            # #### wins over the last number
    ("She has 3 apples, then 5 more, so 8 apples.", "8", 1.0),             # the last number
    ("She has 3 apples, then 5 more, so 8 apples.", "3", 0.0),
    ("It's -12.", -12, 1.0),
    ("It costs $1,000.00 in total", "1000", 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\frac{\pi}{2}", 1.0),                     # not numbers: string equality
    (r"\boxed{\frac{\pi}{2} }", r" \frac{\pi}{2}", 1.0),                   # ... after stripping whitespace
    ("\\boxed{x  =\n2}", "x = 2", 1.0),                                     # ... and collapsing runs of it
    (r"\boxed{\frac{\pi}{2}}", r"\frac{\pi}{3}", 0.0),
    (r"\boxed{x}", "5", 0.0),                                               # one is a number, the other not
    ("I don't know", "3", 0.0),                                             # no answer at all
    (r"\boxed{5", "5", 1.0),                                                # unbalanced box: falls back to the last number
    ("", "0", 0.0),
])
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_extract_answer_order_and_whitespace():
    assert extract_answer(r"#### 3 \boxed{4}") == "4"
    assert extract_answer("#### 3\n then 4") == "3"
    assert extract_answer("then 4") == "4"
    assert extract_answer("none") is None
    assert normalize_whitespace(" x  =\n2 ") == "x = 2"


def test_docstring_examples():
    """The examples in the docstrings are right (they are what a reader copies): the verifiers' and those of the
    number reading they share with the built-in tasks (ppo_core.data.numbers)."""
    import doctest

    import ppo_core.data.numbers
    import ppo_core.rewards.verifiers

    results = [doctest.testmod(m) for m in (ppo_core.rewards.verifiers, ppo_core.data.numbers)]
    assert sum(r.failed for r in results) == 0 and min(r.attempted for r in results) >= 5
    assert sum(r.attempted for r in results) >= 19


@pytest.mark.parametrize("response, answer, expected", [
    ("122", "122", 1.0),
    ("59 + 63 = 122.", "122", 1.0),  # the last number, a full stop after it
    ("The answer is 122, not 121", "122", 0.0),  # the last number is what counts
    ("1,22", "122", 0.0),  # not a thousands comma: "22" is the last number
    ("I think it is one hundred twenty-two", "122", 0.0),
    ("122.0", "122", 1.0),  # exact as numbers
    ("", "122", 0.0),
])
def test_last_number_reward(response, answer, expected):
    assert last_number_reward(["What is 59 + 63?"], [response], [answer]) == [expected]


def test_addition_prompts_hold_out_their_pairs():
    """scripts/make_addition_prompts.py: n training rows then eval_size held-out rows, every answer the sum, the
    held-out pairs distinct and never among the training pairs; the same seed gives the same rows."""
    import os
    import re
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
    from make_addition_prompts import addition_rows

    rows = addition_rows(500, 64, seed=3)
    assert len(rows) == 564 and rows == addition_rows(500, 64, seed=3) and rows != addition_rows(500, 64, seed=4)
    pairs = []
    for row in rows:
        a, b = map(int, re.fullmatch(r"What is (\d\d) \+ (\d\d)\? Reply with just the number\.", row["prompt"]).groups())
        assert row["answer"] == str(a + b)
        pairs.append((a, b))
    train, held_out = pairs[:500], pairs[500:]
    assert len(set(held_out)) == 64 and not set(held_out) & set(train)
