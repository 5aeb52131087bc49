"""Rooms a newcomer can live in: no module in services/ over 600 lines and no function there over 80, so each
service stays a set of small files with one idea each (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = sorted((REPO / "services").rglob("*.py"))
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def test_services_has_modules_to_check() -> None:
    assert len(SERVICES) > 50


def test_no_module_in_services_is_over_600_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in SERVICES if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"


def test_no_function_in_services_is_over_80_lines() -> None:
    long = []
    for path in SERVICES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (give their steps names): {long}"
