"""The engine stays readable (issue 14): train() reads in one sitting, and no engine function needs a long
argument list (a run's state travels as one object)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "src" / "rangefinder" / "training"
MAX_PARAMETERS = 6
MAX_TRAIN_LINES = 120


def _functions():
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield path, node


def _parameters(node) -> list[str]:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return names[1:] if names and names[0] in ("self", "cls") else names


def test_no_engine_function_takes_more_than_six_parameters():
    found = list(_functions())
    assert len(found) > 50, "the engine's sources were not found"
    long = [f"{p.name}:{n.lineno} {getattr(n, 'name', 'lambda')} ({len(_parameters(n))})"
            for p, n in found if len(_parameters(n)) > MAX_PARAMETERS]
    assert not long, f"more than {MAX_PARAMETERS} parameters: {long}"


def test_train_reads_in_one_sitting():
    (train,) = [n for p, n in _functions() if p.name == "loop.py" and getattr(n, "name", "") == "train"]
    assert train.end_lineno - train.lineno + 1 < MAX_TRAIN_LINES
