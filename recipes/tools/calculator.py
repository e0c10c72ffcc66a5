"""A calculator tool for `environment.type: tools`: two-number arithmetic, parsed (never eval'd)."""

from __future__ import annotations

import re

_NUMBER = r"\s*(-?\d+(?:\.\d+)?)\s*"
_EXPRESSION = re.compile(rf"^{_NUMBER}([-+*/x×÷]){_NUMBER}$")


def calculate(expression: str) -> str:
    """Compute one arithmetic operation on two numbers.

    Args:
        expression: Two numbers and one operator among + - * /, for example "12 * 7" or "3.5 / 2".
    """
    match = _EXPRESSION.match(expression)
    if match is None:
        raise ValueError(f"cannot read {expression!r}: write two numbers and one of + - * /, e.g. '12 * 7'")
    left, operator, right = float(match.group(1)), match.group(2), float(match.group(3))
    if operator in "/÷" and right == 0:
        raise ValueError("division by zero")
    value = {"+": left + right, "-": left - right, "*": left * right, "x": left * right, "×": left * right,
             "/": left / right if right else 0.0, "÷": left / right if right else 0.0}[operator]
    return str(int(value)) if value == int(value) else f"{value:.6g}"
