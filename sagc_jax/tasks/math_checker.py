"""Math answer checking: extract a completion's final answer and compare it with a reference.

:func:`extract_answer` takes the first of these marked answers that holds a digit:
  1. the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces close, nested braces included,
     that holds a digit (else the last one that is not empty);
  2. the last ``#### X`` (GSM8K style; X runs to the end of its line);
  3. the last ``answer is X`` / ``answer: X`` (case-insensitive; X runs to the end of its line,
     a final period dropped);
then, when none holds a digit, the first of them that is not empty (a symbolic ``\\boxed{x}``),
else the last number (integer, decimal, ``a/b`` fraction, thousands separators allowed). An
empty box (``\\boxed{}``, spaces, braces or ``$`` only) or a placeholder without a digit
(``\\boxed{answer}``) thus never hides a number given as ``#### 18`` or in another box, as
math-verify's extraction tries its next target when one yields nothing it can parse. It takes
time linear in the length of the text (one scan of the braces).

:func:`math_equal` then compares, stopping at the first that decides:
  1. exact string equality after :func:`normalize_answer` (``$``, spacing, ``\\left``/``\\right``,
     ``\\dfrac``, thousands separators, degrees, ``%``, trailing unit words such as ``cm``,
     ``x =`` removed);
  2. numeric equality when both sides are numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``):
     exact as fractions, or, for a decimal written with ``n >= 4`` places, within half a unit of
     its last place (``0.3333`` matches ``1/3``; ``0.33`` does not);
  3. symbolic equality with math-verify (``\\frac{1}{2}`` vs ``0.5``, ``2\\sqrt{2}`` vs
     ``\\sqrt{8}``), skipped when math-verify is not installed and for plain-text answers (a run
     of three or more letters outside a LaTeX command), and refused for inputs that could make
     sympy hang (longer than ``max_symbolic_chars``, power towers such as ``9^{{9}^{9}}``, huge
     exponents or factorials). Stages 1-2 run in the caller (:func:`compare_answers`); stage 3
     runs in worker processes with a hard deadline (:func:`check_symbolic`), so it is bounded
     from any thread.

Nothing here raises on a string input: garbage compares as False.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import logging
import re
import threading
from collections.abc import Callable, Sequence
from fractions import Fraction

from sagc_jax.tasks.deadline_pool import TIMED_OUT, DeadlinePool

__all__ = [
    "Verdict",
    "check_symbolic",
    "compare_answers",
    "extract_answer",
    "final_answers",
    "math_equal",
    "normalize_answer",
    "parse_number",
    "score_math",
    "symbolic_equal",
]

_log = logging.getLogger(__name__)

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_ANSWER_IS = re.compile(r"answer\s*(?:is\s*:?|:)\s*([^\n]+)", re.IGNORECASE)
_MATH_WORDS = "pi|sqrt|ln|log|exp|sin|cos|tan|sec|csc|cot|deg|mod|inf|infty"
_HASHES = re.compile(r"####\s*([^\n]*)")
_BOX_OR_BRACE = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
# what an empty answer may hold: spaces, braces, $, LaTeX spacing (\, \; \quad ...), boxes
_FILLER = re.compile(r"\\(?:boxed|fbox|q?quad|[,;:! ])|[\s{}$~]")
_DIGIT = re.compile(r"\d")


def _closed_boxes(text: str) -> list[tuple[int, int]]:
    """(start, end) of the content of every ``\\boxed{...}``/``\\fbox{...}`` whose braces close,
    in the order the boxes start (an inner box after the box around it).

    One scan with a stack of the open braces (a box's records where its content starts), so
    linear in ``len(text)`` however many boxes are left open."""
    open_braces: list[int] = []  # content start of a box's brace, -1 for a plain brace
    closed: list[tuple[int, int]] = []
    for m in _BOX_OR_BRACE.finditer(text):
        token = m.group()
        if token == "{":
            open_braces.append(-1)
        elif token != "}":
            open_braces.append(m.end())
        elif open_braces:
            start = open_braces.pop()
            if start >= 0:
                closed.append((start, m.start()))
    return sorted(closed)


def _box_answer(text: str) -> str | None:
    """The content of the last box holding a digit, else of the last box that is not empty
    (:func:`_empty`), else None. Linear in ``len(text)``: what each box holds is read from
    running counts of answer characters and digits, not by rescanning nested boxes."""
    boxes = _closed_boxes(text)
    if not boxes:
        return None
    filler = bytearray(len(text) + 1)
    for m in _FILLER.finditer(text):
        filler[m.start() : m.end()] = b"\x01" * (m.end() - m.start())
    answer_chars, digits = [0], [0]
    for i, ch in enumerate(text):
        answer_chars.append(answer_chars[-1] + (not filler[i]))
        digits.append(digits[-1] + ch.isdigit())
    kept = [(a, b) for a, b in boxes if answer_chars[b] > answer_chars[a]]
    numeric = [(a, b) for a, b in kept if digits[b] > digits[a]]
    if not kept:
        return None
    a, b = (numeric or kept)[-1]
    return text[a:b].strip()


def _empty(answer: str) -> bool:
    """True for an answer with nothing in it: spaces, braces, ``$``, LaTeX spacing, or boxes."""
    return not _FILLER.sub("", answer)


def _last_matched(pattern: re.Pattern, text: str) -> str | None:
    matches = pattern.findall(text)
    if not matches or not matches[-1].strip():
        return None
    found = matches[-1].strip()
    return found[:-1].strip() if found.endswith(".") else found


def extract_answer(text: str) -> str | None:
    """The final answer of a completion (see the module docstring for the order), or None."""
    if not isinstance(text, str):
        return None
    marked = [
        _box_answer(text),
        _last_matched(_HASHES, text),
        _last_matched(_ANSWER_IS, text),
    ]
    marked = [m for m in marked if m is not None and not _empty(m)]
    for answer in marked:
        if _DIGIT.search(answer):
            return answer
    if marked:
        return marked[0]
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def _strip_wrappers(s: str) -> str:
    lo, hi = 0, len(s)  # strip by moving indices: slicing in the loop is quadratic on "$$$$..."
    while lo < hi and s[lo].isspace():
        lo += 1
    while hi > lo and s[hi - 1].isspace():
        hi -= 1
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        while (
            hi - lo >= len(left) + len(right)
            and s.startswith(left, lo, hi)
            and s.endswith(right, lo, hi)
        ):
            lo, hi = lo + len(left), hi - len(right)
            while lo < hi and s[lo].isspace():
                lo += 1
            while hi > lo and s[hi - 1].isspace():
                hi -= 1
    return s[lo:hi]


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
_HUGE_FACTORIAL = re.compile(r"(?:\d{3,}|[)}\]!])\s*!|\d{40,}")  # 1000!, {9^9}!, (9!)!, 10^40


def _huge_power(s: str) -> bool:
    """Whether ``s`` has a power tower or a huge exponent: a ``^`` inside an exponent
    (``9^{9^9}``, ``9^{{9}^{9}}``), a chain (``2^3^4``, ``9^{9}^{9}``), or an exponent holding a
    number of three or more digits (``10^{1000}``, ``2^{-100}``). One pass, linear in ``len(s)``.
    """
    groups: list[bool] = []  # open brackets, innermost last: True for an exponent's group
    depth = 0  # exponent groups open
    pending = False  # a ``^`` waits for its exponent
    bare = ""  # reading an unbracketed exponent: "digits" (2^123) or "command" (x^\pi)
    digits = 0  # length of the run of digits ending here
    exp_end = -2  # position of the last character of the last exponent
    pos = -1  # position among the non-space characters
    for ch in s:
        if ch.isspace():
            continue
        pos += 1
        digits = digits + 1 if ch.isdigit() else 0
        if bare:
            if (ch.isdigit() or ch == ".") if bare == "digits" else ch.isalpha():
                if digits >= 3:
                    return True
                continue
            bare, exp_end = "", pos - 1
        if pending:
            pending = ch in "+-"
            if ch in "{([":
                groups.append(True)
                depth += 1
            elif ch.isdigit():
                bare = "digits"
            elif ch == "\\":
                bare = "command"
            elif ch == "^":
                return True
            elif not pending:
                exp_end = pos  # a one-character exponent (x^n)
            continue
        if ch == "^":
            if depth or exp_end == pos - 1:
                return True
            pending = True
        elif ch in "{([":
            groups.append(False)
        elif ch in "})]":
            if groups and groups.pop():
                depth -= 1
                exp_end = pos
        elif depth and digits >= 3:
            return True
    return False


class Verdict(enum.Enum):
    """What the in-process stages of :func:`math_equal` decide about a pair of answers."""

    EQUAL = "equal"
    DIFFERENT = "different"
    SYMBOLIC = "symbolic"  # needs math-verify: :func:`check_symbolic`
    REFUSED = "refused"  # math-verify could hang on it: scored as different and counted


@functools.cache
def _have_math_verify() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def compare_answers(
    pred: str, ref: str, *, max_symbolic_chars: int = 200
) -> tuple[Verdict, tuple[str, str]]:
    """Stages 1-2 of :func:`math_equal` and the guards of stage 3, in the caller: the verdict and
    the normalized pair (what :func:`symbolic_equal` takes). Linear time in the answers' length.
    """
    if not isinstance(pred, str) or not isinstance(ref, str):
        return Verdict.DIFFERENT, ("", "")
    try:
        a, b = normalize_answer(pred), normalize_answer(ref)
        if not a or not b:
            return Verdict.DIFFERENT, (a, b)
        if a.replace(" ", "") == b.replace(" ", ""):
            return Verdict.EQUAL, (a, b)
        na, nb = parse_number(a), parse_number(b)
        if na is not None and nb is not None:
            return (Verdict.EQUAL if _numbers_equal(na, nb) else Verdict.DIFFERENT), (a, b)
        if not _have_math_verify() or _TEXT_WORD.search(a) or _TEXT_WORD.search(b):
            return Verdict.DIFFERENT, (a, b)
        if len(a) > max_symbolic_chars or len(b) > max_symbolic_chars:
            return Verdict.REFUSED, (a, b)
        if any(_HUGE_FACTORIAL.search(x) or _huge_power(x) for x in (a, b)):
            return Verdict.REFUSED, (a, b)
        return Verdict.SYMBOLIC, (a, b)
    except Exception:  # never let a malformed answer crash a training step
        _log.debug("compare_answers failed", exc_info=True)
        return Verdict.DIFFERENT, ("", "")


def symbolic_equal(pred: str, ref: str) -> bool:
    """Stage 3: math-verify on two normalized answers, with no time limit of its own: call it
    through :func:`check_symbolic`, which runs it in a worker process with a deadline."""
    try:
        from math_verify import parse, verify

        gold = parse(f"\\boxed{{{ref}}}", parsing_timeout=None)
        target = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
        return bool(gold and target and verify(gold, target, timeout_seconds=None))
    except Exception:  # math-verify should not raise, but a reward must never crash a step
        _log.debug("symbolic comparison failed", exc_info=True)
        return False


def _warm_up() -> None:
    """Runs once in each new checker process: imports sympy and builds the parser's caches."""
    # here the pool's deadline is the time limit: silence math-verify's "timeout disabled" warning
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if _have_math_verify():
        symbolic_equal("x+1", "1+x")


_pool: DeadlinePool | None = None
_pool_lock = threading.Lock()


def check_symbolic(
    pairs: Sequence[tuple[str, str]],
    *,
    item_seconds: float = 2.0,
    total_seconds: float = 30.0,
    workers: int = 2,
    check: Callable[[str, str], bool] = symbolic_equal,
) -> list[bool | None]:
    """``check(pred, ref)`` on each normalized pair in the process-wide pool of checker
    processes (started on first use, ``workers`` of them at least): True/False, or None for a
    pair stopped at its deadline (``item_seconds`` after it started, or ``total_seconds`` after
    the first started). ``check`` must be a module-level function (it is pickled by name)."""
    global _pool
    if not pairs:
        return []
    with _pool_lock:
        if _pool is None:
            _pool = DeadlinePool(workers, warmup=_warm_up)
        _pool.grow(workers)
        pool = _pool
    out = pool.map(check, pairs, item_seconds=item_seconds, total_seconds=total_seconds)
    return [None if r is TIMED_OUT else r is True for r in out]


def math_equal(
    pred: str, ref: str, *, timeout_seconds: float = 2.0, max_symbolic_chars: int = 200
) -> bool:
    """Whether answer ``pred`` equals reference ``ref`` (both already extracted answers); the
    symbolic stage is stopped after ``timeout_seconds`` (False), from any thread."""
    verdict, pair = compare_answers(pred, ref, max_symbolic_chars=max_symbolic_chars)
    if verdict is not Verdict.SYMBOLIC:
        return verdict is Verdict.EQUAL
    [same] = check_symbolic([pair], item_seconds=timeout_seconds, total_seconds=timeout_seconds)
    return same is True


def final_answers(completion: str, reference: str) -> tuple[str, str] | None:
    """``(extracted answer, reference)``, or None when the completion has no answer. A reference
    that is itself a worked solution (it contains ``\\boxed`` or ``####``) is reduced to its final
    answer."""
    if not isinstance(completion, str) or not isinstance(reference, str):
        return None
    pred = extract_answer(completion)
    if pred is None:
        return None
    if "\\boxed" in reference or "####" in reference:
        reference = extract_answer(reference) or ""
    return pred, reference


def score_math(completion: str, reference: str, **kwargs) -> float:
    """1.0 when the completion's extracted answer equals the reference (see
    :func:`final_answers`), else 0.0. ``kwargs`` go to :func:`math_equal`."""
    answers = final_answers(completion, reference)
    return 1.0 if answers is not None and math_equal(*answers, **kwargs) else 0.0
