"""Every test in ``tests/distributed`` carries the ``distributed`` marker (``-m "not distributed"`` then starts no
torchrun): on the module (``pytestmark``) or on the test itself, read from the source without importing it."""

from __future__ import annotations

import ast
from pathlib import Path

DISTRIBUTED = Path(__file__).resolve().parents[1] / "distributed"


def _marks_distributed(node: ast.expr) -> bool:
    """``pytest.mark.distributed`` (called or not), alone or in a list/tuple."""
    if isinstance(node, ast.List | ast.Tuple):
        return any(_marks_distributed(item) for item in node.elts)
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == "distributed" and ast.unparse(node.value) == "pytest.mark"


def unmarked_tests(source: str) -> list[str]:
    """The test functions of one module that would run without the ``distributed`` marker."""
    tree = ast.parse(source)
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in stmt.targets):
            if _marks_distributed(stmt.value):
                return []
    return [
        stmt.name
        for stmt in tree.body
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
        and stmt.name.startswith("test")
        and not any(_marks_distributed(d) for d in stmt.decorator_list)
    ]


def test_every_distributed_test_carries_the_marker():
    modules = sorted(DISTRIBUTED.glob("test_*.py"))
    assert modules
    unmarked = {m.name: names for m in modules if (names := unmarked_tests(m.read_text()))}
    assert not unmarked, f"tests without @pytest.mark.distributed (or a module pytestmark): {unmarked}"


def test_the_check_sees_an_unmarked_test():
    assert unmarked_tests("import pytest\n\ndef test_a():\n    pass\n") == ["test_a"]
    assert unmarked_tests("import pytest\n\n@pytest.mark.distributed\ndef test_a():\n    pass\n") == []
    assert unmarked_tests("import pytest\npytestmark = [pytest.mark.distributed]\ndef test_a():\n    pass\n") == []
    assert unmarked_tests("import pytest\npytestmark = pytest.mark.slow\ndef test_a():\n    pass\n") == ["test_a"]
