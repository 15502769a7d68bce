"""The calculator example's tool and reward (examples/agent_calculator.yaml)."""

from __future__ import annotations

import ast
import operator
import re

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError("only numbers and + - * / are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: The expression, e.g. "(12 + 3) * 7".
    """
    result = _value(ast.parse(expression, mode="eval").body)
    return str(int(result) if float(result).is_integer() else round(result, 6))


def correct(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """1 when the last number of the episode's final turn is the row's answer, else 0."""
    scores = []
    for completion, want in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text.rsplit("</tool_response>", 1)[-1])
        scores.append(1.0 if numbers and float(numbers[-1]) == float(want) else 0.0)
    return scores
