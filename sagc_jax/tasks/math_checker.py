"""Math answer checking: extract a completion's final answer and compare it with a reference.

:func:`extract_answer` looks, in this order, for
  1. the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces close, nested braces included;
  2. the last ``#### X`` (GSM8K style; X runs to the end of its line);
  3. the last ``answer is X`` / ``answer: X`` (case-insensitive; X runs to the end of its line,
     a final period dropped);
  4. the last number (integer, decimal, ``a/b`` fraction, thousands separators allowed).

:func:`math_equal` then compares, stopping at the first that decides:
  1. exact string equality after :func:`normalize_answer` (``$``, spacing, ``\\left``/``\\right``,
     ``\\dfrac``, thousands separators, degrees, ``%``, trailing unit words such as ``cm``,
     ``x =`` removed);
  2. numeric equality when both sides are numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``):
     exact as fractions, or, for a decimal written with ``n >= 4`` places, within half a unit of
     its last place (``0.3333`` matches ``1/3``; ``0.33`` does not);
  3. symbolic equality with math-verify (``\\frac{1}{2}`` vs ``0.5``, ``2\\sqrt{2}`` vs
     ``\\sqrt{8}``), skipped when math-verify is not installed, for plain-text answers (a run of
     three or more letters outside a LaTeX command), and for inputs that could make sympy hang
     (longer than ``max_symbolic_chars``, power towers, huge exponents or factorials). In the
     main thread each math-verify stage also runs under a ``timeout_seconds`` alarm; in other
     threads (where signals are unavailable) only the size guards apply.

Nothing here raises on a string input: garbage compares as False.
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

__all__ = ["extract_answer", "math_equal", "normalize_answer", "parse_number", "score_math"]

_log = logging.getLogger(__name__)

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_ANSWER_IS = re.compile(r"answer\s*(?:is\s*:?|:)\s*([^\n]+)", re.IGNORECASE)
_MATH_WORDS = "pi|sqrt|ln|log|exp|sin|cos|tan|sec|csc|cot|deg|mod|inf|infty"
_HASHES = re.compile(r"####\s*([^\n]*)")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` whose braces close."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion (see the module docstring for the order), or None."""
    if not isinstance(text, str):
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASHES, _ANSWER_IS):
        matches = pattern.findall(text)
        if matches and matches[-1].strip():
            found = matches[-1].strip()
            return found[:-1].strip() if found.endswith(".") else found
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def _strip_wrappers(s: str) -> str:
    s = s.strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        while len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def normalize_answer(s: str) -> str:
    """A canonical form for exact comparison (whitespace kept as single spaces)."""
    s = _strip_wrappers(s.replace("\u2212", "-"))
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left\b|\\right\b|\\!", "", s)
    s = re.sub(r"\\[,;: ]|~", " ", s)
    s = s.replace("\\$", "").replace("{,}", ",")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", "", s)  # degrees
    s = re.sub(r"\\?%\s*$", "", s.strip())  # percent sign
    s = re.sub(r"\\(?:text|mbox|mathrm)\s*\{\s*([^{}]*)\}", r" \1 ", s)
    s = re.sub(r"^\s*[a-zA-Z]\s*=\s*(?=\S)", "", s)  # "x = 5" -> "5"
    s = re.sub(r"\s+", " ", s).strip().rstrip(".").strip()
    # a number followed by a word (2+ letters, not a math name) is a quantity with units
    m = re.fullmatch(rf"({_NUMBER})\s*(?!(?:{_MATH_WORDS})\b)[a-zA-Z]{{2,}}[a-zA-Z .]*", s)
    if m:
        s = m.group(1)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    m = re.fullmatch(r"\(?([A-Ea-e])\)?", s)  # multiple choice "(b)" -> "B"
    return m.group(1).upper() if m else s


_DECIMAL = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_SIMPLE_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:/[+-]?\d+(?:\.\d*)?)?")
_FRAC = re.compile(r"([+-]?)\\frac\s*\{\s*([+-]?\d+)\s*\}\s*\{\s*([+-]?\d+)\s*\}")


def parse_number(s: str) -> tuple[Fraction, int] | None:
    """``(value, places)`` of a normalized number, or None; ``places`` is the count of digits
    after the decimal point (0 for integers and fractions)."""
    s = s.replace(" ", "")
    if len(s) > 60:  # keeps Fraction arithmetic cheap
        return None
    try:
        m = _FRAC.fullmatch(s)
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return (-value if m.group(1) == "-" else value), 0
        if _SIMPLE_NUMBER.fullmatch(s):
            num, _, den = s.partition("/")
            value = Fraction(num) / Fraction(den) if den else Fraction(num)
            places = len(num.split(".")[1]) if _DECIMAL.fullmatch(num) and not den else 0
            return value, places
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _numbers_equal(a: tuple[Fraction, int], b: tuple[Fraction, int]) -> bool:
    if a[0] == b[0]:
        return True
    places = max(a[1], b[1])
    return places >= 4 and abs(a[0] - b[0]) <= Fraction(1, 2 * 10**places)


_TEXT_WORD = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{3,}")
_RISKY = re.compile(
    r"\^\s*\{[^{}]*\^"  # power tower 9^{9^{9}}
    r"|\^\s*\(?[\d.]+\)?\s*\^"  # 2^3^4
    r"|\^\s*\{?\s*\d{3,}"  # huge exponent
    r"|\d{3,}\s*!|\d{40,}"  # factorial of a big number, huge literal
)


def _symbolic_equal(pred: str, ref: str, timeout_seconds: int, max_chars: int) -> bool:
    if len(pred) > max_chars or len(ref) > max_chars:
        return False
    if any(_TEXT_WORD.search(x) or _RISKY.search(x) for x in (pred, ref)):
        return False
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    # signal.alarm only works in the main thread: elsewhere rely on the size guards above
    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(f"\\boxed{{{ref}}}", parsing_timeout=timeout)
        target = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
        if not gold or not target:
            return False
        return bool(verify(gold, target, timeout_seconds=timeout))
    except Exception:  # math-verify should not raise, but a reward must never crash a step
        _log.debug("symbolic comparison failed", exc_info=True)
        return False


def math_equal(
    pred: str, ref: str, *, timeout_seconds: int = 2, max_symbolic_chars: int = 200
) -> bool:
    """Whether answer ``pred`` equals reference ``ref`` (both already extracted answers)."""
    if not isinstance(pred, str) or not isinstance(ref, str):
        return False
    try:
        a, b = normalize_answer(pred), normalize_answer(ref)
        if not a or not b:
            return False
        if a.replace(" ", "") == b.replace(" ", ""):
            return True
        na, nb = parse_number(a), parse_number(b)
        if na is not None and nb is not None:
            return _numbers_equal(na, nb)
        return _symbolic_equal(a, b, timeout_seconds, max_symbolic_chars)
    except Exception:  # never let a malformed answer crash a training step
        _log.debug("math_equal failed", exc_info=True)
        return False


def score_math(completion: str, reference: str, **kwargs) -> float:
    """1.0 when the completion's extracted answer equals the reference, else 0.0.

    A reference that is itself a worked solution (it contains ``\\boxed`` or ``####``) is reduced
    to its final answer first. ``kwargs`` go to :func:`math_equal`.
    """
    if not isinstance(completion, str) or not isinstance(reference, str):
        return 0.0
    pred = extract_answer(completion)
    if "\\boxed" in reference or "####" in reference:
        reference = extract_answer(reference) or ""
    return 1.0 if pred is not None and math_equal(pred, reference, **kwargs) else 0.0
