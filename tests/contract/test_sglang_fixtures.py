"""The SGLang 0.5.23 fixtures themselves: well-formed, and (when the wheel is on this machine) true to its source.

Every fixture cites the wheel: ``provenance`` entries give a file inside the wheel, a line, the symbol and the
text on that line. With the wheel at ``$POISE_SGLANG_WHEEL`` (default
``/tmp/sglang/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``) these tests read those lines back and
regenerate ``cli_flags.json`` and ``metrics.json``; without it they are skipped (the fixtures still drive the
other contract tests).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.contract.fixtures.generate_from_wheel import DEFAULT_WHEEL, Source, build
from tests.contract.shapes import FIXTURES, fixture, shape

WHEEL = Path(os.environ.get("POISE_SGLANG_WHEEL", str(DEFAULT_WHEEL)))
# the wheel, or a directory it was unzipped or installed into (make test points here at .venv-sglang's)
needs_wheel = pytest.mark.skipif(not (WHEEL.is_file() or (WHEEL / "sglang" / "srt").is_dir()),
                                 reason=f"the sglang 0.5.23 wheel is not at {WHEEL}")
HAND_WRITTEN = sorted(p.name for p in FIXTURES.glob("*.json") if p.name not in ("cli_flags.json", "metrics.json"))


def _shapes(node: Any) -> list[Any]:
    """Every shape inside a fixture (definitions and the shape/ref entries of its sections)."""
    found: list[Any] = []
    if isinstance(node, dict):
        if "ref" in node or "fields" in node or "array" in node:
            found.append(node)
        for key, value in node.items():
            if key in ("definitions", "shape", "chunk", "usage_chunk", "fields", "more_fields", "array"):
                found.extend(value.values() if key in ("definitions", "fields", "more_fields") and isinstance(value, dict)
                             else [value])
            elif isinstance(value, dict | list):
                found.extend(_shapes(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_shapes(item))
    return found


def _walk(spec: Any, doc: str, seen: set[int]) -> None:
    """Fail on anything that is not shape grammar (tests/contract/shapes.py) or a dangling reference."""
    if isinstance(spec, str):
        assert spec in ("string", "integer", "number", "boolean", "null", "object", "array", "any"), spec
        return
    if isinstance(spec, list):
        for alt in spec:
            _walk(alt, doc, seen)
        return
    assert isinstance(spec, dict), spec
    if id(spec) in seen:
        return
    seen.add(id(spec))
    if "ref" in spec:
        target = spec["ref"]
        _walk(shape(target, doc), target[1:].split("/", 1)[0] if target.startswith("#") else doc, seen)
    elif "array" in spec:
        _walk(spec["array"], doc, seen)
    elif "fields" in spec:
        assert set(spec) <= {"object", "fields", "optional", "more_fields", "extra"}, spec
        for sub in [*spec["fields"].values(), *spec.get("more_fields", {}).values()]:
            _walk(sub, doc, seen)
    else:
        assert set(spec) in ({"const"}, {"enum"}), spec


@pytest.mark.parametrize("name", HAND_WRITTEN)
def test_fixture_is_well_formed(name: str) -> None:
    doc = fixture(name)
    assert doc["sglang_version"] == "0.5.23" and doc["wheel"].startswith("sglang-0.5.23-")
    assert doc["provenance"], f"{name} cites nothing"
    for entry in doc["provenance"]:
        assert set(entry) == {"file", "line", "symbol", "contains"} and entry["file"].startswith("sglang/")
    for spec in [*doc.get("definitions", {}).values(), *_shapes(doc)]:
        _walk(spec, name, set())


@needs_wheel
@pytest.mark.parametrize("name", HAND_WRITTEN)
def test_provenance_lines_are_in_the_wheel(name: str) -> None:
    wheel = Source(WHEEL)
    for entry in fixture(name)["provenance"]:
        lines = wheel.read(entry["file"]).splitlines()
        line = lines[entry["line"] - 1] if entry["line"] <= len(lines) else ""
        assert entry["contains"] in line, f"{name}: {entry['file']}:{entry['line']} is {line.strip()!r}, " \
                                          f"not {entry['contains']!r}"


@needs_wheel
def test_generated_fixtures_match_the_wheel() -> None:
    for file_name, doc in build(Source(WHEEL)).items():
        assert json.loads((FIXTURES / file_name).read_text()) == json.loads(json.dumps(doc)), (
            f"{file_name} is stale: run `python -m tests.contract.fixtures.generate_from_wheel`")
