"""Every benchmark module imports against the current code (a stale import once made
``python -m bench wan`` vanish from the command's list without a word)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHES = ast.literal_eval(
    next(
        node.value
        for node in ast.parse(
            (Path(__file__).parents[1] / "bench" / "__main__.py").read_text()
        ).body
        if isinstance(node, ast.Assign) and node.targets[0].id == "BENCHES"
    )
)


@pytest.mark.parametrize("path", sorted(BENCHES.values()))
def test_bench_module_imports_and_declares_its_arguments(path):
    module = importlib.import_module(path)
    assert callable(module.run) and callable(module.add_arguments)
