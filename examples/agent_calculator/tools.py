"""The calculator example's tool and rewards (examples/agent_calculator.yaml): the policy
may hand the arithmetic to `calculator`; the rewards pay for the right final number and for a
call that computed it."""

from __future__ import annotations

import ast
import operator
import re
import threading

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


# mogrpo runs a turn's calls at once, each sync tool on a thread of its own: a tool must be
# thread-safe. CPython's ast.parse is not (python/cpython#106905: the AST constructor's recursion
# counter is shared by every thread, so a parse that yields the GIL mid-way, to a finalizer the
# garbage collector runs, say, can fail with "SystemError: AST constructor recursion depth
# mismatch"). Under load that failed ~1 call in 1,500 in this example's rollouts and made two
# runs of one seed part; one parse at a time (a few microseconds each) costs nothing here.
_PARSE = threading.Lock()


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: The expression, e.g. "(12 + 3) * 7".
    """
    with _PARSE:
        tree = ast.parse(expression, mode="eval")
    result = _value(tree.body)
    return str(int(result) if float(result).is_integer() else round(result, 6))


_RESULT = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)


def _text(completion: str | list[dict]) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """1 when the last number of the episode's final turn is the row's answer, else 0."""
    scores = []
    for completion, want in zip(completions, answer, strict=True):
        text = _text(completion).rsplit("</tool_response>", 1)[-1]
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
        scores.append(1.0 if numbers and float(numbers[-1]) == float(want) else 0.0)
    return scores


def calculator_call(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """1 when the calculator returned the row's answer during the episode (the model called
    it with a right expression), else 0. Tool results are part of the episode's text."""
    return [1.0 if want in _RESULT.findall(_text(completion)) else 0.0
            for completion, want in zip(completions, answer, strict=True)]
