"""No function in the package is over 60 lines: a longer one holds more than one idea."""

import ast

from helpers import ROOT

MAX_LINES = 60


def test_no_function_in_the_package_is_over_60_lines():
    long = []
    for path in sorted((ROOT / "asyncrl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
