"""Each request's SLO class: the TTFT and TPOT targets the engines (and the late-binding queue) schedule for.

Where a request's targets come from, first match wins (explicit targets override per field, the rest comes
from the class the later rules pick):

1. ``slo``: a Poise extension object in the body, ``{"ttft_s": 0.5, "tpot_s": 0.05, "name": "interactive"}``
   (every key optional; ``name`` only labels the request in reports and is not looked up);
2. ``slo_class``: a Poise extension field naming one of the gateway's classes (400 if it knows no such class);
3. ``priority`` (SGLang's integer field) through the gateway's priority -> class map;
4. the model's default class, then the route's (``completions`` = /v1/completions, ``chat`` =
   /v1/chat/completions), then the gateway's default class;
5. the gateway's own SLO (``slo_ttft_s`` / ``slo_tpot_s``, what its dispatch and the planner plan for), with
   no class name (``slo_fallback``, on by default): the engines then order every prompt by its deadline, as
   the dispatcher placed it and as the simulator serves it. With ``slo_fallback`` off the request has no
   targets (best effort: after every prompt with a deadline, in arrival order).

``slo`` and ``slo_class`` are removed from the body before it is forwarded (the gateway sends what it resolved
as ``poise_slo``, see shared/protocol/request_slo.py); ``priority`` is forwarded unchanged to every engine.

The classes are gateway settings: ``slo_class`` specs ``NAME=TTFT_S:TPOT_S`` (shared/slo_spec.py's format; an empty
target is the gateway's ``slo_ttft_s`` / ``slo_tpot_s``, a trailing ``:SHARE`` is accepted and ignored) and/or
``slo_preset``, a preset (shared/slo_spec.py ``PRESETS``, e.g. ``tasks-flowprefill``: FlowPrefill's Table 2)
built on the gateway's SLO; specs add to or replace the preset's classes by name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.errors import APIError, bad_request
from shared.protocol.request_slo import RequestSlo
from shared.slo_spec import NAME_CHARS, preset_specs
from shared.slo_spec import parse_class_spec as parse_spec

#: Body fields the gateway reads and strips (the Poise extension).
SLO_BODY_FIELD = "slo"
SLO_CLASS_BODY_FIELD = "slo_class"
_SLO_KEYS = frozenset({"ttft_s", "tpot_s", "name"})
#: Route names for default classes, and the paths that mean the same.
ROUTES = {"completions": "completions", "chat": "chat", "/v1/completions": "completions",
          "/v1/chat/completions": "chat"}


class Targets(msgspec.Struct, frozen=True):
    """One class's targets, in seconds (None: no target)."""

    ttft_s: float | None
    tpot_s: float | None


_NO_TARGETS = Targets(None, None)


class ResolvedSlo(msgspec.Struct, frozen=True, kw_only=True):
    """A request's SLO after resolution: what the engines get as ``poise_slo``."""

    slo_class: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    source: str = "none"  # slo | slo_class | priority | model | route | default | gateway: which rule picked it

    def request_slo(self, waited_s: float) -> RequestSlo:
        return RequestSlo(slo_class=self.slo_class, ttft_s=self.ttft_s, tpot_s=self.tpot_s,
                          waited_s=max(0.0, waited_s))


def parse_class_spec(spec: str, default: Targets) -> tuple[str, Targets]:
    """``NAME=TTFT_S:TPOT_S[:SHARE]`` -> (name, targets); empty targets take ``default``'s, SHARE is ignored."""
    parsed = parse_spec(spec, default.ttft_s, default.tpot_s)
    return parsed.name, Targets(parsed.ttft_s, parsed.tpot_s)


def _pairs(items: Iterable[str], what: str) -> list[tuple[str, str]]:
    """``KEY=CLASS`` items (an item may hold several, comma-separated) -> [(key, class)]."""
    out = []
    for item in items:
        for part in item.split(","):
            if not part.strip():
                continue
            key, sep, name = part.rpartition("=")
            if not sep or not key.strip() or not name.strip():
                raise ValueError(f"{what} {part!r}: expected KEY=CLASS")
            out.append((key.strip(), name.strip()))
    return out


@dataclass(frozen=True)
class SloTable:
    """The gateway's SLO classes and the rules that give a request one (see the module docstring)."""

    classes: dict[str, Targets] = field(default_factory=dict)
    by_priority: dict[int, str] = field(default_factory=dict)
    by_model: dict[str, str] = field(default_factory=dict)
    by_route: dict[str, str] = field(default_factory=dict)  # "completions" | "chat"
    default_class: str | None = None
    fallback: Targets = _NO_TARGETS  # rule 5: the targets of a request no other rule classifies
    # The least TTFT a request's own ``slo`` may ask for: an engine's fixed cost of any prefill pass, on the
    # profile the gateway plans with. Below it no engine can answer in time, so a retry cannot help: a 400.
    min_ttft_s: float = 0.0

    def __post_init__(self) -> None:
        for what, mapping in (("priority", self.by_priority), ("model", self.by_model), ("route", self.by_route)):
            for key, name in mapping.items():
                if name not in self.classes:
                    raise ValueError(f"SLO class for {what} {key!r}: unknown class {name!r}; {self._known()}")
        if self.default_class is not None and self.default_class not in self.classes:
            raise ValueError(f"default SLO class: unknown class {self.default_class!r}; {self._known()}")

    def _known(self) -> str:
        return f"classes: {', '.join(sorted(self.classes))}" if self.classes else "no SLO classes are configured"

    @classmethod
    def build(cls, *, specs: Iterable[str] = (), preset: str | None = None, default_slo: Targets = _NO_TARGETS,
              priority: Iterable[str] = (), model: Iterable[str] = (), route: Iterable[str] = (),
              default_class: str | None = None, fallback: bool = False) -> SloTable:
        """From the gateway's settings; ValueError with a readable message on bad input."""
        classes: dict[str, Targets] = {}
        if preset:
            if default_slo.ttft_s is None or default_slo.tpot_s is None:
                raise ValueError("an SLO preset needs the gateway's slo_ttft_s and slo_tpot_s")
            for c in preset_specs(preset, default_slo.ttft_s, default_slo.tpot_s):
                classes[c.name] = Targets(c.ttft_s, c.tpot_s)
        for spec in specs:
            name, targets = parse_class_spec(spec, default_slo)
            classes[name] = targets
        by_priority: dict[int, str] = {}
        for key, name in _pairs(priority, "SLO priority class"):
            try:
                by_priority[int(key)] = name
            except ValueError:
                raise ValueError(f"SLO priority class {key}={name}: the priority must be an integer") from None
        by_route: dict[str, str] = {}
        for key, name in _pairs(route, "SLO route class"):
            if key not in ROUTES:
                raise ValueError(f"SLO route class {key}={name}: routes are completions (/v1/completions) and "
                                 "chat (/v1/chat/completions)")
            by_route[ROUTES[key]] = name
        return cls(classes=classes, by_priority=by_priority, by_model=dict(_pairs(model, "SLO model class")),
                   by_route=by_route, default_class=default_class or None,
                   fallback=default_slo if fallback else _NO_TARGETS)

    @classmethod
    def from_settings(cls, settings: Any) -> SloTable:
        table = cls.build(specs=settings.slo_class, preset=settings.slo_preset,
                         default_slo=Targets(settings.slo_ttft_s, settings.slo_tpot_s),
                         priority=settings.slo_priority_class, model=settings.slo_model_class,
                         route=settings.slo_route_class, default_class=settings.slo_default_class,
                         fallback=settings.slo_fallback)
        return dataclasses.replace(table, min_ttft_s=settings.latency_model().prefill_time_s(1))

    # -- per request -------------------------------------------------------------------------------
    def resolve(self, body: dict[str, Any], *, model: str, endpoint: str, priority: int | None) -> ResolvedSlo | None:
        """The request's SLO (None: no targets), with ``slo`` / ``slo_class`` removed from ``body``.

        Raises :class:`APIError` (400, naming the parameter) for a malformed ``slo``, an unknown ``slo_class``.
        """
        explicit = body.pop(SLO_BODY_FIELD, None)
        named = body.pop(SLO_CLASS_BODY_FIELD, None)
        ttft, tpot, label = _explicit(explicit)
        if ttft is not None and ttft < self.min_ttft_s:
            raise bad_request(f"'{SLO_BODY_FIELD}.ttft_s' is {ttft:g} s, below {self.min_ttft_s:g} s, what any "
                              f"prefill pass of these engines takes: no engine can meet it",
                              param=f"{SLO_BODY_FIELD}.ttft_s")
        base: str | None = None
        source = "none"
        if named is not None:
            if not isinstance(named, str) or not named:
                raise bad_request(f"'{SLO_CLASS_BODY_FIELD}' must be a class name (a string)", param=SLO_CLASS_BODY_FIELD)
            if named not in self.classes:
                raise APIError(400, f"unknown SLO class {named!r}; {self._known()}", param=SLO_CLASS_BODY_FIELD,
                               code="unknown_slo_class")
            base, source = named, "slo_class"
        elif priority is not None and priority in self.by_priority:
            base, source = self.by_priority[priority], "priority"
        elif model in self.by_model:
            base, source = self.by_model[model], "model"
        elif endpoint in self.by_route:
            base, source = self.by_route[endpoint], "route"
        elif self.default_class is not None:
            base, source = self.default_class, "default"
        targets = self.classes[base] if base is not None else self.fallback
        if base is None and targets != _NO_TARGETS:
            source = "gateway"
        if explicit is not None:
            source = "slo"
        resolved = ResolvedSlo(slo_class=label or base, ttft_s=targets.ttft_s if ttft is None else ttft,
                               tpot_s=targets.tpot_s if tpot is None else tpot, source=source)
        if resolved.slo_class is None and resolved.ttft_s is None and resolved.tpot_s is None:
            return None
        return resolved


def _explicit(value: Any) -> tuple[float | None, float | None, str | None]:
    """The ``slo`` object's (ttft_s, tpot_s, name); 400 naming the key when malformed."""
    if value is None:
        return None, None, None
    if not isinstance(value, dict):
        raise bad_request(f"'{SLO_BODY_FIELD}' must be an object like {{\"ttft_s\": 0.5, \"tpot_s\": 0.05}}",
                          param=SLO_BODY_FIELD)
    unknown = sorted(set(value) - _SLO_KEYS)
    if unknown:
        raise bad_request(f"'{SLO_BODY_FIELD}' has unknown key(s) {', '.join(unknown)}; allowed: name, ttft_s, tpot_s",
                          param=f"{SLO_BODY_FIELD}.{unknown[0]}")
    out: list[float | None] = []
    for key in ("ttft_s", "tpot_s"):
        v = value.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0):
            raise bad_request(f"'{SLO_BODY_FIELD}.{key}' must be a positive number of seconds, got {v!r}",
                              param=f"{SLO_BODY_FIELD}.{key}")
        out.append(None if v is None else float(v))
    name = value.get("name")
    if name is not None and (not isinstance(name, str) or not name or not set(name) <= NAME_CHARS):
        raise bad_request(f"'{SLO_BODY_FIELD}.name' must be letters, digits, '_', '.' or '-', got {name!r}",
                          param=f"{SLO_BODY_FIELD}.name")
    return out[0], out[1], name
