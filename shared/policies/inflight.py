"""The dispatcher's in-flight ledger: the work it sent each engine and has not yet seen come back.

Engines report their load only every few hundred milliseconds, so back-to-back requests must see each other
through the dispatcher's own count (``EngineView.inflight_*``). The ledger keeps it by the events a gateway
can observe, and by nothing it cannot (the true output length, the moment an engine reserves KV):

- a request **holds its prefill engine** for its prompt from dispatch until its first token reached the
  decode side (the prefill engine's part is over then);
- it **holds its decode (or colocated) engine** as one request from dispatch until it ends there, and for
  prompt + ``max_tokens`` of KV (the client's limit: the length it will really reach is known only at its
  end) until its first token: from then the engine has reserved the request's KV and its own load report
  counts it, so holding the tokens on would count them twice (a KV-balancing dispatcher would then shun
  the engines that admit work and pile requests onto the ones that queue them);
- a **move** to another decode engine holds the target the same way from the moment it is decided, and
  the source until the request left it.

The live gateway (``services/gateway/cluster.py``) and the simulator (``loadgen/sim/cluster.py``) keep one
each and feed it the same events, so the dispatcher sees the same ``inflight_*`` numbers live and simulated.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Inflight:
    """One engine's share of the ledger."""

    reqs: int = 0
    tokens: int = 0
    tokens_sq: int = 0  # sum of squared token counts: a quadratic prefill-time model sums exactly over it

    def add(self, reqs: int, tokens: int, sign: int) -> None:
        self.reqs += sign * reqs
        self.tokens += sign * tokens
        self.tokens_sq += sign * tokens * tokens


NOTHING = Inflight()


@dataclass
class InflightLedger:
    """Holds by request id: each request holds one or more engines, each for a number of tokens."""

    _engines: dict[str, Inflight] = field(default_factory=dict)
    _holds: dict[str, dict[str, int]] = field(default_factory=dict)  # rid -> engine -> tokens

    def dispatched(self, rid: str, decode_id: str, prefill_id: str | None, input_tokens: int,
                   max_output_tokens: int) -> None:
        """A request was placed: its prefill engine (None: the decode or colocated engine prefills it) holds
        its prompt, its decode engine the prompt and its output limit."""
        if prefill_id is not None:
            self.hold(rid, prefill_id, input_tokens)
        self.hold(rid, decode_id, input_tokens + max_output_tokens)

    def hold(self, rid: str, instance_id: str, tokens: int) -> None:
        """``rid`` holds ``instance_id`` for ``tokens`` (one hold per request and engine: a second replaces it)."""
        holds = self._holds.setdefault(rid, {})
        if instance_id in holds:
            self.release(rid, instance_id)
            holds = self._holds.setdefault(rid, {})
        holds[instance_id] = tokens
        self._engines.setdefault(instance_id, Inflight()).add(1, tokens, +1)

    def release(self, rid: str, instance_id: str | None = None) -> list[str]:
        """Give back ``rid``'s hold on ``instance_id`` (None: all of them); returns the engines released."""
        holds = self._holds.get(rid)
        if not holds:
            return []
        released = [instance_id] if instance_id is not None and instance_id in holds else (
            [] if instance_id is not None else list(holds))
        for engine in released:
            tokens = holds.pop(engine)
            slot = self._engines[engine]
            slot.add(1, tokens, -1)
            if slot.reqs <= 0:
                del self._engines[engine]
        if not holds:
            del self._holds[rid]
        return released

    def first_token(self, rid: str, decode_id: str, prefill_id: str | None = None) -> None:
        """``rid``'s first token came from ``decode_id``: its prefill hold ends, and its decode hold keeps the
        request but no longer its KV (the engine's report has it)."""
        if prefill_id is not None:
            self.release(rid, prefill_id)
        holds = self._holds.get(rid)
        if holds and holds.get(decode_id):
            self._engines[decode_id].add(0, holds[decode_id], -1)
            holds[decode_id] = 0

    def rename(self, rid: str, to: str) -> None:
        """``rid``'s holds become ``to``'s (whose own holds are released first): a move that succeeded takes
        over the request."""
        self.release(to)
        holds = self._holds.pop(rid, None)
        if holds:
            self._holds[to] = holds

    def holds(self, rid: str) -> dict[str, int]:
        """The engines ``rid`` holds, and for how many tokens."""
        return dict(self._holds.get(rid, {}))

    def engine(self, instance_id: str) -> Inflight:
        """What ``instance_id`` was sent and has not given back (read-only: a zero share when nothing)."""
        return self._engines.get(instance_id, NOTHING)

    def requests(self) -> int:
        """Requests holding at least one engine."""
        return len(self._holds)
