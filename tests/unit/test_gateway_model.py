"""The gateway model (``shared.gateway.model``), which the live gateway and the simulator both adapt: what it
places, holds, refuses and gives up, and what its placements hold in the in-flight ledger."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.gateway.model import GatewayModel, Refusal
from shared.latency import LatencyModel, load_profile
from shared.load_view import engine_view
from shared.policies import LeastLoad, Placement, make_prefill_policy
from shared.policies.late_binding import LateBinding
from shared.policies.views import EngineView, RequestView
from shared.protocol.messages import Role

LATENCY = LatencyModel(load_profile())


@dataclass(eq=False)
class Req:
    rid: str
    arrival_s: float = 0.0
    slo_ttft_s: float = math.inf
    input_tokens: int = 1000
    prefilled: int = 0
    retries: int = 0
    max_tokens: int = 100


@dataclass
class Cluster:
    """A port over fixed engines (registrations only, no load reports: the ledger is all the dispatcher sees)."""

    model: GatewayModel[Req]
    roles: dict[str, str]  # instance id -> role
    refuse_sends_to: set[str] = field(default_factory=set)  # placed there, the send fails (placed() -> False)
    sent: list[tuple[str, str | None, str]] = field(default_factory=list)  # (rid, prefill, decode)
    told: list[tuple[str, Refusal]] = field(default_factory=list)

    def engines(self, model: str, role: Role | None = None) -> Sequence[EngineView]:
        return [engine_view(i, r, "ready", kv_capacity_tokens=100_000, max_running_requests=8,  # type: ignore[arg-type]
                            load=None, load_age_s=None, held=self.model.ledger.engine(i), finish_rate_rps=None,
                            local_prefill=False)
                for i, r in self.roles.items() if role is None or r == role]

    def accepting(self, model: str, role: Role) -> Sequence[str]:
        return [i for i, r in self.roles.items() if r == role]

    def request(self, item: Req) -> RequestView:
        return RequestView(rid=item.rid, input_tokens=item.input_tokens, max_output_tokens=item.max_tokens,
                           slo_ttft_s=None if math.isinf(item.slo_ttft_s) else item.slo_ttft_s)

    def placed(self, item: Req, placement: Placement) -> bool:
        if placement.decode_id in self.refuse_sends_to:
            self.model.ledger.release(item.rid)
            return False
        self.sent.append((item.rid, placement.prefill_id, placement.decode_id))
        return True

    def refused(self, item: Req, refusal: Refusal) -> None:
        self.told.append((item.rid, refusal))


def cluster(roles: dict[str, str], *, late: bool = False, guard: bool = False, depth: int = 1) -> Cluster:
    binding = LateBinding(make_prefill_policy("edf", LATENCY), depth=depth, guard_decode=guard) if late else None
    return Cluster(GatewayModel(LeastLoad(), binding), roles)


PAIR = {"p0": "prefill", "d0": "decode"}


def test_without_late_binding_a_request_is_placed_at_once_and_holds_its_engines() -> None:
    c = cluster(PAIR)
    assert math.isinf(c.model.admit(Req("a", input_tokens=300, max_tokens=50), "m", 0.0, c))
    assert c.sent == [("a", "p0", "d0")] and c.model.held() == []
    ledger = c.model.ledger
    assert (ledger.engine("p0").reqs, ledger.engine("p0").tokens) == (1, 300)  # the prompt
    assert (ledger.engine("d0").reqs, ledger.engine("d0").tokens) == (1, 350)  # prompt + the client's limit
    ledger.first_token("a", "d0", "p0")
    assert ledger.engine("p0").reqs == 0 and (ledger.engine("d0").reqs, ledger.engine("d0").tokens) == (1, 0)


def test_nothing_to_route_to_is_a_503_and_the_ledger_stays_empty() -> None:
    c = cluster({"p0": "prefill"})
    c.model.admit(Req("a"), "m", 0.0, c)
    [(rid, refusal)] = c.told
    assert rid == "a" and (refusal.status, refusal.code, refusal.given_up) == (503, "no_capacity", False)
    assert c.model.ledger.requests() == 0


def test_late_binding_holds_what_finds_no_slot_and_a_freed_slot_releases_it() -> None:
    c = cluster(PAIR, late=True, depth=1)
    c.model.admit(Req("first"), "m", 0.0, c)
    c.model.admit(Req("second"), "m", 0.1, c)
    assert [s[0] for s in c.sent] == ["first"] and [h.rid for h in c.model.held("m")] == ["second"]
    assert math.isinf(c.model.pump("m", 0.2, c))  # nothing changed: still held
    assert [h.rid for h in c.model.held()] == ["second"] and c.model.held_count() == 1
    c.model.ledger.first_token("first", "d0", "p0")  # the prefill engine's part is over
    c.model.pump("m", 0.3, c)
    assert [s[0] for s in c.sent] == ["first", "second"] and c.model.held() == []


def test_a_placement_that_could_not_be_sent_takes_no_slot() -> None:
    c = cluster({"p0": "prefill", "d0": "decode", "d1": "decode"}, late=True, depth=1)
    c.refuse_sends_to = {"d0"}
    c.model.admit(Req("a"), "m", 0.0, c)  # least load ties on d0: placed there, the send fails
    assert c.sent == [] and c.model.ledger.requests() == 0 and c.model.held() == []
    c.refuse_sends_to = set()
    c.model.admit(Req("b"), "m", 0.1, c)  # p0's slot is still free
    assert [s[0] for s in c.sent] == ["b"]


def test_with_the_decode_guard_a_held_request_is_given_up_at_its_target_and_the_model_says_when() -> None:
    c = cluster(PAIR, late=True, guard=True, depth=1)
    c.model.admit(Req("busy"), "m", 0.0, c)
    wake = c.model.admit(Req("held", arrival_s=1.0, slo_ttft_s=2.0), "m", 1.0, c)
    assert wake == 3.0  # its give-up time: pump then, even if nothing else happens
    assert c.told == [] and math.isclose(c.model.pump("m", 2.9, c), 3.0)
    c.model.pump("m", 3.0, c)
    [(rid, refusal)] = c.told
    assert rid == "held" and refusal.given_up and (refusal.status, refusal.code) == (429, "slo_unreachable")
    assert "held 2.0 s" in refusal.reason and c.model.held() == []


def test_a_withdrawn_request_is_never_placed() -> None:
    c = cluster(PAIR, late=True, depth=1)
    c.model.admit(Req("busy"), "m", 0.0, c)
    gone = Req("gone")
    c.model.admit(gone, "m", 0.1, c)
    assert c.model.withdraw(gone) and not c.model.withdraw(gone)
    c.model.ledger.first_token("busy", "d0", "p0")
    c.model.pump("m", 0.2, c)
    assert [s[0] for s in c.sent] == ["busy"]


def test_a_retry_is_placed_directly_never_on_the_engine_that_failed_it() -> None:
    c = cluster({"p0": "prefill", "p1": "prefill", "d0": "decode"}, late=True, depth=1)
    req = Req("a")
    c.model.admit(req, "m", 0.0, c)
    failed = c.sent[0][1]
    assert failed is not None
    c.model.ledger.release("a")
    decision = c.model.place(req, "m", 0.5, c, frozenset({failed}))
    assert isinstance(decision, Placement) and decision.prefill_id not in (failed, None)
