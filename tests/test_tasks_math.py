"""Math answer extraction and equivalence."""

import threading
import time

import pytest

from sagc_jax.tasks import extract_answer, math_equal, normalize_answer, parse_number, score_math

EQUIVALENT = [
    ("17", "17"),
    ("1,000", "1000"),
    ("$1{,}000$", "1000"),
    ("3/4", "0.75"),
    ("\\dfrac{3}{4}", "0.75"),
    ("-\\frac{1}{2}", "-0.5"),
    ("10.0", "10"),
    ("\u22123", "-3"),
    ("0.3333", "1/3"),
    ("50\\%", "50"),
    ("50%", "50"),
    ("5 cm", "5"),
    ("18 dollars.", "18"),
    ("5\\text{ cm}", "5"),
    ("\\$18", "18"),
    ("90^\\circ", "90"),
    ("x = 3", "3"),
    ("(B)", "b"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
]
SYMBOLIC = [
    ("\\frac{1}{2}", "0.5"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("x+1", "1+x"),
    ("\\{1,2\\}", "\\{2,1\\}"),
]
DIFFERENT = [
    ("2", "3"),
    ("3x", "3"),  # a variable is not a unit
    ("2 pi", "2"),
    ("0.33", "1/3"),  # too few places to stand for 1/3
    ("1000000.5", "1000001"),
    ("50%", "0.5"),
    ("x+1", "x-1"),
    ("\\sqrt{2}", "1.414"),
    ("hello", "helol"),  # text: no symbolic comparison (sympy would call it h*e*l*l*o)
    ("(1,2)", "(2,1)"),
    ("1/0", "0"),
    ("", "0"),
    ("17", ""),
]


@pytest.mark.parametrize("pred, ref", EQUIVALENT)
def test_equivalent_without_symbolic(pred, ref):
    assert math_equal(pred, ref) and math_equal(ref, pred)


@pytest.mark.parametrize("pred, ref", SYMBOLIC)
def test_equivalent_symbolically(pred, ref):
    pytest.importorskip("math_verify")
    assert math_equal(pred, ref)


@pytest.mark.parametrize("pred, ref", DIFFERENT)
def test_not_equivalent(pred, ref):
    assert not math_equal(pred, ref)


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so \\boxed{1} and at last \\boxed{\\frac{3}{\\sqrt{4}}}.", "\\frac{3}{\\sqrt{4}}"),
        ("\\boxed{\\{1, \\{2\\}\\}} then \\boxed{2", "\\{1, \\{2\\}\\}"),  # unclosed one skipped
        ("the answer is 3 ... \\fbox{4}", "4"),  # boxed beats 'answer is'
        ("work\n#### 1,234\nThe answer is 5", "1,234"),  # '####' beats 'answer is'
        ("The answer is: $5$.\nbye", "$5$"),
        ("so the final answer is 3.5.", "3.5"),
        ("We get 3, then -4/5 done", "-4/5"),
        ("Let me answer this: 7 then 8", "8"),  # 'answer this' is not 'answer is'
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer_order(text, answer):
    assert extract_answer(text) == answer


def test_normalize_and_parse_number():
    assert normalize_answer("  $\\left(1,\\!2\\right)$ ") == "(1,2)"
    assert parse_number("0.750") == (parse_number("3/4")[0], 3)
    assert parse_number("\\frac{-6}{4}")[0] == parse_number("-1.5")[0]
    assert parse_number("abc") is None and parse_number("1" * 70) is None


def test_score_math_reduces_worked_references():
    assert score_math("so \\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert score_math("... #### 72", "Natalia sold 48/2 = 24 clips.\n#### 72") == 1.0
    assert score_math("The answer is 71.", "72") == 0.0
    assert score_math("nothing", "72") == 0.0


@pytest.mark.parametrize(
    "garbage",
    [None, 3, "\\boxed{", "}}}{{{", "\\frac{", "9^{9^{9^{9}}}", "10^{100000}", "1000!", "\x00\xff"],
)
def test_garbage_never_raises_and_is_fast(garbage):
    start = time.perf_counter()
    assert math_equal(garbage, "1") is False
    assert score_math(garbage, "1") == 0.0
    assert time.perf_counter() - start < 1.0  # size guards, not the 2 s timeout


def test_symbolic_comparison_works_off_the_main_thread():
    pytest.importorskip("math_verify")
    results = []
    worker = threading.Thread(target=lambda: results.append(math_equal("2\\sqrt{2}", "\\sqrt{8}")))
    worker.start()
    worker.join(timeout=20)
    assert results == [True]
