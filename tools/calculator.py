"""``calculator``: exact arithmetic on an expression, with no sandbox and no ``eval``.

The expression is parsed with :mod:`ast` and only numbers, parentheses and the operators
``+ - * / // % **`` (and unary ``+``/``-``) are evaluated; anything else (names, calls,
attributes, strings) is refused with a message the model can act on. Integers stay exact
(Python ints); ``/`` gives a float unless the division is exact. Sizes are bounded so a model
cannot make the daemon spin: at most :data:`MAX_CHARS` characters, exponents up to
:data:`MAX_EXPONENT`, results up to :data:`MAX_DIGITS` digits.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_CHARS", "SCHEMA", "CalculatorError", "evaluate", "format_result"]

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 100

SCHEMA: dict[str, Any] = {
    "name": "calculator",
    "description": (
        "Evaluate an arithmetic expression exactly and return the result. Supports numbers, "
        "parentheses and + - * / // % ** (e.g. \"(12 + 3) * 45\")."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "The arithmetic expression."},
        },
        "required": ["expression"],
    },
}


class CalculatorError(ValueError):
    """The expression cannot be evaluated; the message says why (shown to the model)."""


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _check_size(value: int | float) -> int | float:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        if abs(value) >= 10.0**MAX_DIGITS:
            raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    elif abs(value) >= 10**MAX_DIGITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)  # type: ignore[arg-type]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponents are limited to {MAX_EXPONENT}")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (OverflowError, ValueError) as exc:
            raise CalculatorError(str(exc)) from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        if isinstance(node.op, ast.Div) and isinstance(left, int) and isinstance(right, int) \
                and left % right == 0:
            value = left // right  # exact division stays an integer
        return _check_size(value)
    what = type(node).__name__
    raise CalculatorError(f"only numbers, parentheses and + - * / // % ** are allowed (found {what})")


def evaluate(expression: str) -> int | float:
    """The value of ``expression``; raises :class:`CalculatorError` with a readable reason."""
    text = expression.strip().replace("\u00d7", "*").replace("\u00f7", "/").replace("^", "**")  # x, division sign
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r} as arithmetic") from None
    return _eval(tree)


def format_result(value: int | float) -> str:
    """Integers exactly; floats with up to 12 significant digits (no trailing noise)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"
