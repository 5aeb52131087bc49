"""The dispatcher's in-flight ledger (shared/policies/inflight.py): what a request holds on which engine and
until when, and that the simulator keeps it by the same events as the live gateway."""

from __future__ import annotations

from loadgen.sim.cluster import SimCluster
from loadgen.sim.events import EventQueue
from loadgen.sim.instance import SimRequest
from shared.latency import LatencyModel, load_profile
from shared.policies import LeastLoad
from shared.policies.inflight import InflightLedger


def test_a_pd_request_holds_its_prompt_on_prefill_and_prompt_plus_limit_on_decode_until_its_first_token() -> None:
    ledger = InflightLedger()
    ledger.dispatched("a", "d0", "p0", 100, 50)
    ledger.dispatched("b", "d0", "p0", 10, 5)
    p0, d0 = ledger.engine("p0"), ledger.engine("d0")
    assert (p0.reqs, p0.tokens, p0.tokens_sq) == (2, 110, 100 * 100 + 10 * 10)
    assert (d0.reqs, d0.tokens, d0.tokens_sq) == (2, 165, 150 * 150 + 15 * 15)
    assert ledger.release("a", "p0") == ["p0"]  # its prefill leg answered
    assert (ledger.engine("p0").reqs, ledger.engine("p0").tokens) == (1, 10)
    assert ledger.release("a", "p0") == []  # a second release of the same hold gives nothing back
    ledger.first_token("a", "d0", "p0")  # the decode engine holds its KV now, and reports it
    assert (ledger.engine("d0").reqs, ledger.engine("d0").tokens, ledger.engine("d0").tokens_sq) == (2, 15, 15 * 15)
    assert ledger.holds("a") == {"d0": 0}
    assert sorted(ledger.release("a")) == ["d0"]
    assert (ledger.engine("d0").reqs, ledger.engine("d0").tokens) == (1, 15)
    assert ledger.requests() == 1
    ledger.release("b")
    assert ledger.requests() == 0 and ledger.engine("d0").reqs == 0 and ledger.engine("p0").tokens_sq == 0


def test_a_colocated_request_holds_only_its_engine() -> None:
    ledger = InflightLedger()
    ledger.dispatched("a", "c0", None, 100, 50)
    assert ledger.holds("a") == {"c0": 150}


def test_a_move_holds_its_target_under_its_own_id_until_it_takes_over() -> None:
    ledger = InflightLedger()
    ledger.dispatched("a", "d0", "p0", 100, 50)
    ledger.first_token("a", "d0", "p0")
    ledger.dispatched("a-m1", "d1", "p1", 120, 30)  # recompute through a prefill engine, 20 tokens in
    assert ledger.engine("d0").reqs == 1 and ledger.engine("d1").reqs == 1 and ledger.engine("d1").tokens == 150
    ledger.first_token("a-m1", "d1", "p1")
    ledger.release("a")  # the source is left once the target produced its first token
    ledger.rename("a-m1", "a")
    assert ledger.holds("a") == {"d1": 0} and ledger.holds("a-m1") == {} and ledger.engine("d1").reqs == 1
    assert ledger.engine("d0").reqs == 0


def test_holding_an_engine_twice_replaces_the_hold() -> None:
    ledger = InflightLedger()
    ledger.hold("a", "d0", 100)
    ledger.hold("a", "d0", 40)
    assert (ledger.engine("d0").reqs, ledger.engine("d0").tokens) == (1, 40)


def test_the_simulator_holds_by_the_events_the_gateway_sees() -> None:
    """The prefill hold ends when the KV reached the decode side (not as the prompt's chunks are computed);
    the decode hold keeps its KV until the first token (not only until the decode engine reserved it, which
    the gateway cannot see) and the request until the end."""
    q = EventQueue()
    c = SimCluster(["prefill", "decode"], LatencyModel(load_profile()), LeastLoad(), q)
    req = SimRequest(index=0, rid="r0", arrival_s=0.0, input_tokens=2000, output_tokens=200)
    seen: list[tuple[str, int, int]] = []

    def look(what: str) -> None:
        views = {v.role: v for v in (i.view() for i in c.live)}
        seen.append((what, views["prefill"].inflight_tokens, views["decode"].inflight_tokens,
                     views["decode"].inflight_reqs))

    def watch() -> None:
        # After every event until the end, note whether the prompt is computed and the first token is out.
        if req.finished_s is not None:
            return
        if req.generated == 0 and c.instances["p0"].sent:
            look("sending")
        elif req.generated > 0:
            look("decoding")
        q.at(q.now_s + 0.001, 3, watch)

    q.at(0.0, 2, lambda: c.submit(req))
    q.at(0.0, 3, watch)
    q.run()
    assert req.finished_s is not None and req.error is None
    sending = [s for s in seen if s[0] == "sending"]
    decoding = [s for s in seen if s[0] == "decoding"]
    assert sending and decoding
    assert all(s[1:] == (2000, 2200, 1) for s in sending)  # computed, not yet at the decode side: still held
    assert all(s[1:] == (0, 0, 1) for s in decoding)  # its KV is the engine's to report; the request stays
    assert c.ledger.requests() == 0 and all(i.view().inflight_reqs == 0 for i in c.live)
