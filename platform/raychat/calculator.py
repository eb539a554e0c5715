"""Safe arithmetic for the calculator tool: walks Python's syntax tree, never calls eval.

Accepted: integer and decimal literals, + - * / // %, parentheses, unary + and -, and thousands separators
("1,000" means 1000: a comma between a digit and exactly three digits, in a number's integer part: a comma
after its decimal point is left, so "1.234,567" is refused); and one letter count,
`'<word>'.count('<letters>')` with single-quoted literals (the spelling task's call: str.count, an int), as
nanochat's calculator allows. Everything else (names, other calls, attributes, subscripts, powers,
comparisons, other strings, tuples, ...) gives None.
Bounds: at most MAX_CHARS characters, and every intermediate |value| <= MAX_MAGNITUDE, so no input can
allocate huge integers or loop long. Errors (syntax, division by zero, recursion, overflow) give None:
no exception escapes `eval_expression` or `calculate`.
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_CHARS = 256
MAX_MAGNITUDE = 10**18

_ALLOWED_CHARS = re.compile(r"[0-9+\-*/%()., \t]*")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_INTEGER_PART = re.compile(r"(?<![\d.,])[\d,]+")  # digits and commas not after a decimal point
# floats below it hold every integer exactly (IEEE 754 binary64's 53-bit significand)
_EXACT_FLOAT_INT = 2**53
_LETTER_COUNT = re.compile(r"'([^'\\]*)'\.count\('([^'\\]+)'\)")
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class _Rejected(Exception):
    pass


def _check(value):
    if isinstance(value, float) and not math.isfinite(value):
        raise _Rejected
    if abs(value) > MAX_MAGNITUDE:
        raise _Rejected
    return value


def _walk(node):
    if isinstance(node, ast.Expression):
        return _walk(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _walk(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Div) and isinstance(left, int) and isinstance(right, int) and right:
            if left % right == 0:
                return _check(left // right)
        return _check(_BINOPS[type(node.op)](left, right))
    raise _Rejected


def eval_expression(expression: str) -> int | float | None:
    """Value of an arithmetic expression, or None if it is not allowed or cannot be computed.

    Exact integer division stays an int (84/2 -> 42); other divisions give a float.
    """
    try:
        if not isinstance(expression, str) or len(expression) > MAX_CHARS:
            return None
        if letter_count := _LETTER_COUNT.fullmatch(expression.strip()):
            return letter_count.group(1).count(letter_count.group(2))
        if not _ALLOWED_CHARS.fullmatch(expression):
            return None
        text = _INTEGER_PART.sub(lambda m: _THOUSANDS.sub("", m.group()), expression).strip()
        if not text:
            return None
        return _walk(ast.parse(text, mode="eval"))
    except Exception:  # SyntaxError, ZeroDivisionError, RecursionError, MemoryError, _Rejected, ...
        return None


def format_value(value: int | float) -> str:
    """Text injected for a value: ints as digits; floats with up to 12 significant digits (a whole float below
    2**53 as its digits, all of them exact; from 2**53 a float's digits past the 16th are not)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < _EXACT_FLOAT_INT:
        return str(int(value))
    return format(value, ".12g")


def calculate(expression: str) -> str | None:
    """The tool output text for `expression` (e.g. "12*(3+4)" -> "84"), or None to inject nothing."""
    value = eval_expression(expression)
    return None if value is None else format_value(value)
