"""The SGLang fixtures and a small checker for the JSON shapes they describe.

A *shape* in a fixture is one of:

- a type name: ``"string"``, ``"integer"`` (not a bool), ``"number"`` (int or float), ``"boolean"``, ``"null"``,
  ``"object"`` / ``"array"`` (any content), ``"any"``;
- a list of shapes: any of them (``["integer", "null"]``);
- ``{"const": v}`` / ``{"enum": [...]}``;
- ``{"ref": "Name"}``: ``definitions.Name`` of the same fixture, or ``"#other.json/Name"``;
- ``{"array": shape, "min": n, "max": n}``;
- ``{"object": "Name", "fields": {key: shape}, "optional": [keys], "more_fields": {key: shape}, "extra": bool}``:
  every key of ``fields`` must be present unless listed in ``optional``; ``more_fields`` gives the shapes of
  optional keys not in ``fields``; with ``extra`` false (the default) no other key is allowed.

:func:`check` returns every mismatch as ``"<path>: <what>"``. The stand-in's own additions are not SGLang's:
``extensions`` maps an object's name to the keys it may carry on top (Poise extensions, each documented),
``omissions`` to the required keys it may lack (documented deviations).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sglang-0.5.23"


@cache
def fixture(name: str) -> dict[str, Any]:
    """One fixture document (``name`` with or without ``.json``)."""
    name = name if name.endswith(".json") else name + ".json"
    doc: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return doc


def shape(ref: str, doc: str) -> Any:
    """The shape a reference names: ``Name`` in ``doc``'s definitions, or ``#other.json/Name``."""
    if ref.startswith("#"):
        doc, ref = ref[1:].split("/", 1)
    return fixture(doc)["definitions"][ref]


_TYPES: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "any": lambda v: True,
}


def check(value: Any, spec: Any, doc: str, *, path: str = "$", extensions: Mapping[str, set[str]] | None = None,
          omissions: Mapping[str, set[str]] | None = None) -> list[str]:
    """Mismatches of ``value`` against ``spec`` (a shape from fixture ``doc``)."""
    ext = extensions or {}
    omit = omissions or {}

    def go(v: Any, s: Any, p: str, d: str) -> list[str]:
        if isinstance(s, str):
            if s not in _TYPES:
                raise ValueError(f"unknown type {s!r} in {d}")
            return [] if _TYPES[s](v) else [f"{p}: expected {s}, got {type(v).__name__} {v!r:.80}"]
        if isinstance(s, list):
            errors = [go(v, alt, p, d) for alt in s]
            if any(not e for e in errors):
                return []
            return [f"{p}: matches none of {json.dumps(s)[:160]}: " + " | ".join(e[0] for e in errors if e)]
        if "ref" in s:
            target = s["ref"]
            return go(v, shape(target, d), p, target[1:].split("/", 1)[0] if target.startswith("#") else d)
        if "const" in s:
            return [] if v == s["const"] and type(v) is type(s["const"]) else [f"{p}: expected {s['const']!r}, got {v!r}"]
        if "enum" in s:
            return [] if v in s["enum"] else [f"{p}: expected one of {s['enum']}, got {v!r}"]
        if "array" in s:
            if not isinstance(v, list):
                return [f"{p}: expected array, got {type(v).__name__}"]
            errs = []
            if len(v) < s.get("min", 0) or len(v) > s.get("max", len(v)):
                errs.append(f"{p}: {len(v)} items, expected {s.get('min', 0)}..{s.get('max', 'any')}")
            for i, item in enumerate(v):
                errs += go(item, s["array"], f"{p}[{i}]", d)
            return errs
        if "fields" in s:
            name = s.get("object", "?")
            if not isinstance(v, dict):
                return [f"{p}: expected object {name}, got {type(v).__name__}"]
            fields, more = s["fields"], s.get("more_fields", {})
            optional = set(s.get("optional", ())) | set(more) | omit.get(name, set())
            errs = [f"{p}: {name} lacks {k!r}" for k in fields if k not in v and k not in optional]
            for k, item in v.items():
                if k in fields or k in more:
                    errs += go(item, fields.get(k, more.get(k)), f"{p}.{k}", d)
                elif k in s.get("optional", ()):
                    continue  # an optional key SGLang may add, shape not described
                elif not s.get("extra", False) and k not in ext.get(name, set()):
                    errs.append(f"{p}: {name} has unexpected key {k!r}")
            return errs
        raise ValueError(f"bad shape {s!r} in {d}")

    return go(value, spec, path, doc)


def assert_shape(value: Any, spec: Any, doc: str, **kw: Any) -> None:
    errors = check(value, spec, doc, **kw)
    assert not errors, "\n".join(errors)
