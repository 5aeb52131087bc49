"""ARES decode rescheduling (Algorithm 1, spec §1.5-1.9 with the errata of §1.12) as a pure migration policy.

Every ``interval_s`` the policy reads the cluster snapshot's running decode requests, simulates each decode
instance's token load over the next ``horizon_steps`` steps (each request grows by the instance's tokens per
step until its predicted remaining length runs out), and moves the one request whose move most reduces

    sigma_hat^2 = Var(current loads) + sum_{t=1..H} beta_t Var(loads at step t)          (Eq. 4, truncated)

with ``beta_t = gamma^t / sum_u gamma^u`` (normalised, errata §1.12.2, so ``w_i`` below is a token load).

- **Classification** (lines 13-15): ``w_i = sum_t beta_t N_hat_i(t)``; overloaded O: ``w_i > (1+theta) w_bar``;
  underloaded U by ``underload_rule``: ``paper`` = current load ``< (1+theta) w_bar`` (as printed), ``strict`` =
  current load ``< (1-theta) w_bar`` (errata §1.12.3); U never holds a member of O.
- **Candidates** (lines 17-23): requests r on s in O, to t in U, that pass the cost filter
  ``N_hat(r) > C_mig(r) / T_exec(s)`` (the move pays for itself in decode iterations) and the memory filter
  with r's own tokens included (errata §1.12.4): ``max_t (traj_t + r's tokens on t) <= C_mem * mem_safety``,
  and the target's reported KV use plus r's predicted final size within its capacity.
- **Selection** (lines 24-31): the largest reduction, if it is more than ``min_reduction_frac`` of the
  objective (errata §1.12.8). In the future simulation r is in flight (on no batch) for ``C_mig(r)`` and then
  grows on the target at the target's pace; at step 0 it counts on the target (the state right after the move).

Each candidate costs O(1) whatever the horizon: the objective's change is a sum over steps of products of
linear functions of the step index with the instances' trajectories, so per-instance prefix sums of
``beta_t x_t`` and ``t beta_t x_t`` (and global ones of ``S_t``, the running sum of loads) give it exactly
(the running-sums form of the incremental variance update, summed over steps in closed form). The O(H)
per-step version lives in the tests as the reference.

Step: one scheduler interval (``step_s`` = 1 s); instance i advances ``round(step_s / T_exec_i)`` tokens per
request per step, ``T_exec_i`` being its mean decode iteration time (reported: running requests / generated
tokens per second; else the latency model's step time at its token load). ``delta_tokens > 0`` fixes it.

Modes (spec §1.12.12): ``predicted`` (ARES: the snapshot's ``predicted_remaining_tokens``), ``oracle`` (the
same reader; the simulator fills the truth, see ``preferred_length_predictor``), ``current_only`` ("vLLM +
rescheduling", Llumnix-like): ``w_i`` = current load, objective = variance of current loads after the move,
memory filter ``N_t + N(r) <= C_mem``, no cost filter.

Guards against thrashing (spec §1.8 [REC]): ``max_migrations_per_round`` (1), a per-request cooldown, no
request that is already migrating, and at most one migration in flight per instance (as source or target).

Search width: Algorithm 1 scores every (source, request, target). At 256 instances that is ~5 x 10^5 candidates,
too many for a 30 ms budget in Python, so sources are taken most overloaded first and targets least loaded
first, ``max_sources`` x ``max_targets`` of them (0 = all: the exhaustive algorithm). The benchmark reports how
often the pruned search finds the exhaustive best.

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from shared.errors import ConfigError
from shared.latency import LatencyModel, load_profile
from shared.policies.migration_cost import KvTransfer, MigrationMechanism
from shared.policies.migration_decision import MigrationDecision
from shared.protocol.messages import ClusterSnapshot, DecodeRequestInfo, InstanceLoad

AresMode = Literal["predicted", "oracle", "current_only"]
UnderloadRule = Literal["paper", "strict"]


class AresParams(msgspec.Struct, frozen=True, kw_only=True):
    """ARES' knobs; the paper gives only the interval and one migration per round (spec §1.9)."""

    mode: AresMode = "predicted"
    interval_s: float = 1.0  # rescheduling period [PAPER: "e.g., every 1 second"]
    theta: float = 0.1  # overload margin [REC]
    horizon_steps: int = 30  # H [REC]
    gamma: float = 0.9  # beta_t = gamma^t / sum_u gamma^u [REC]
    step_s: float = 1.0  # one future step = one scheduler interval [REC]
    delta_tokens: int = 0  # > 0: fixed tokens per request per step instead of round(step_s / T_exec)
    underload_rule: UnderloadRule = "paper"
    mem_safety: float = 0.9  # C_mem = KV capacity x this (SGLang max_total_num_tokens x 0.9) [REC]
    min_reduction_frac: float = 0.01  # epsilon: a move must cut the objective by at least this share [REC]
    max_migrations_per_round: int = 1  # [PAPER: one m* per round]
    cooldown_s: float = 10.0  # a moved request stays put this long [REC]
    max_sources: int = 8  # most overloaded sources searched (0 = all)
    max_targets: int = 8  # least loaded targets searched per source (0 = all)

    def __post_init__(self) -> None:
        bad = []
        if not self.interval_s > 0 or not self.step_s > 0:
            bad.append("interval_s and step_s must be > 0")
        if self.theta < 0 or self.horizon_steps < 0 or not 0 < self.gamma <= 1:
            bad.append("theta >= 0, horizon_steps >= 0 and 0 < gamma <= 1")
        if self.max_migrations_per_round < 1 or self.max_sources < 0 or self.max_targets < 0:
            bad.append("max_migrations_per_round >= 1, max_sources and max_targets >= 0")
        if not 0 < self.mem_safety <= 1 or self.min_reduction_frac < 0 or self.cooldown_s < 0:
            bad.append("0 < mem_safety <= 1, min_reduction_frac >= 0, cooldown_s >= 0")
        if bad:
            raise ConfigError(f"ARES params: {'; '.join(bad)}")


def step_weights(horizon: int, gamma: float) -> list[float]:
    """omega_0 = 1 (the current variance), omega_t = beta_t for t = 1..H, with sum beta_t = 1."""
    raw = [gamma**t for t in range(1, horizon + 1)]
    total = sum(raw)
    return [1.0] + [b / total for b in raw]


@dataclass(slots=True)
class Req:
    """A running request as the future simulation sees it."""

    rid: str
    tokens: int  # N(r): prompt + generated, all in its KV
    remaining: float  # N_hat(r) >= 1
    movable: bool  # not migrating, not cooling down


@dataclass(slots=True)
class Inst:
    """A decode instance: its requests, pace and simulated token-load trajectory ``x[0..H]``."""

    instance_id: str
    reqs: list[Req]
    t_exec_s: float  # mean decode iteration time
    delta: float  # tokens per request per future step
    kv_capacity: int  # tokens
    kv_used: int  # reported KV in use (tokens)
    busy: bool  # a migration to or from it is in flight
    profile: str = ""  # its latency profile (what a move off it costs)
    infos: list[DecodeRequestInfo] = field(default_factory=list)  # from the snapshot; ``reqs`` are built from
    # them only for the instances a round searches (a policy call at 256 instances then allocates a few hundred
    # objects, not ~10K: fewer garbage-collector pauses)
    x: list[float] = field(default_factory=list)
    xmax: float = 0.0
    wx: list[float] = field(default_factory=list)  # prefix sums of omega_k x_k (length H + 2), built on demand
    wkx: list[float] = field(default_factory=list)  # prefix sums of omega_k k x_k
    w: float = 0.0  # the classification load


def alive_steps(remaining: float, delta: float, horizon: int) -> int:
    """Steps 0.. at which a request with ``remaining`` tokens left, advancing ``delta`` per step, still runs
    (it runs at step k while k * delta < remaining), capped at the horizon's H + 1 and at least 1 (it runs now)."""
    return max(1, min(horizon + 1, math.ceil(remaining / delta)))


def trajectory(requests: Iterable[tuple[int, float]], delta: float, horizon: int) -> list[float]:
    """x[k] = sum over (tokens N, remaining N_hat) alive at step k of (N + k delta): two difference arrays,
    O(R + H)."""
    h = horizon
    base = [0.0] * (h + 2)  # difference array of the sum of N over requests alive at k
    count = [0] * (h + 2)  # ... and of how many are alive
    total = 0.0
    alive = 0
    for tokens, remaining in requests:
        end = math.ceil(remaining / delta)
        end = 1 if end < 1 else (h + 1 if end > h else end)
        total += tokens
        alive += 1
        base[end] -= tokens
        count[end] -= 1
    x = [total]
    for k in range(1, h + 1):
        total += base[k]
        alive += count[k]
        x.append(total + k * delta * alive)
    return x


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    acc = 0.0
    for v in values:
        acc += v
        out.append(acc)
    return out


SourceTerms = tuple[float, float, int, float, float, float]
"""A request's side of a move, the same for every target: (pa, qa, la, A1, A2, SA) of :meth:`AresState.gain`."""


class AresState:
    """The cluster as Algorithm 1 sees it in one round: trajectories, weights and running sums, with O(1)
    scoring of a move. Built by :meth:`AresMigration.state`; tests score moves on it directly.

    Notation of :meth:`gain`: a move takes ``a_k`` (r's load) off the source's ``x_s[k]`` and puts ``b_k`` on
    the target's ``x_t[k]``. Per step, with S and Q the sum and the sum of squares of the loads,
    ``Var = Q/n - (S/n)^2`` changes by ``(-2 a x_s + a^2 + 2 b x_t + b^2)/n - (2 S (b - a) + (b - a)^2)/n^2``.
    ``a_k`` and ``b_k`` are linear in k on one interval each, so the omega-weighted sums over k of every term
    are differences of prefix sums (of omega, k omega, k^2 omega, omega S, k omega S, omega x and k omega x).
    """

    def __init__(self, insts: list[Inst], horizon: int, weights: list[float], step_s: float) -> None:
        self.insts = {i.instance_id: i for i in insts}
        self.horizon = horizon
        self.step_s = step_s
        self.omega = weights
        self.n = len(insts)
        ks = range(horizon + 1)
        self.W = _prefix(weights)
        self.WK = _prefix([w * k for w, k in zip(weights, ks, strict=True)])
        self.WK2 = _prefix([w * k * k for w, k in zip(weights, ks, strict=True)])
        for inst in insts:
            self._trajectory(inst)
        self._sums()

    def _trajectory(self, inst: Inst) -> None:
        if not inst.x:  # built by AresMigration.state from the snapshot, or here from ``reqs``
            inst.x = trajectory(((r.tokens, r.remaining) for r in inst.reqs), inst.delta, self.horizon)
        inst.xmax = max(inst.x)
        inst.wx = inst.wkx = []

    def prepare(self, inst: Inst) -> None:
        """The prefix sums a move from or to ``inst`` is scored with (only searched instances need them)."""
        om, x = self.omega, inst.x
        inst.wx = _prefix([om[k] * x[k] for k in range(self.horizon + 1)])
        inst.wkx = _prefix([om[k] * k * x[k] for k in range(self.horizon + 1)])

    def _sums(self) -> None:
        h = self.horizon
        S = [0.0] * (h + 1)
        Q = [0.0] * (h + 1)
        for inst in self.insts.values():
            for k, v in enumerate(inst.x):
                S[k] += v
                Q[k] += v * v
        self.S, self.Q = S, Q
        om = self.omega
        self.WS = _prefix([om[k] * S[k] for k in range(h + 1)])
        self.WKS = _prefix([om[k] * k * S[k] for k in range(h + 1)])

    def objective(self) -> float:
        """sigma_hat^2: the weighted sum of the per-step variances of the instances' token loads."""
        n = self.n
        return sum(w * (q / n - (s / n) ** 2) for w, q, s in zip(self.omega, self.Q, self.S, strict=True))

    def target_window(self, req: Req, target: Inst, delay_s: float) -> tuple[float, float, int, int]:
        """r's contribution on ``target`` at steps >= 1: ``pb + qb k`` for k in [k0, k1). It is in flight
        (on no batch) for ``delay_s``, then advances ``target.delta`` per step until ``remaining`` runs out."""
        m = delay_s / self.step_s
        qb = target.delta
        pb = req.tokens - m * qb
        k0 = max(1, math.ceil(m))
        k1 = min(self.horizon + 1, math.ceil(m + req.remaining / qb))
        return pb, qb, k0, k1

    def source_terms(self, req: Req, source: Inst) -> SourceTerms:
        """r's load on the source, ``a_k = pa + qa k`` for k in [0, la), and its sums against the source."""
        if not source.wx:
            self.prepare(source)
        pa = float(req.tokens)
        qa = source.delta
        la = alive_steps(req.remaining, qa, self.horizon)
        a1 = pa * source.wx[la] + qa * source.wkx[la]
        a2 = pa * pa * self.W[la] + 2 * pa * qa * self.WK[la] + qa * qa * self.WK2[la]
        sa = pa * self.WS[la] + qa * self.WKS[la]
        return pa, qa, la, a1, a2, sa

    def gain(self, terms: SourceTerms, req: Req, target: Inst, delay_s: float) -> float:
        """The objective's reduction when r (whose source side is ``terms``) moves to ``target``."""
        if not target.wx:
            self.prepare(target)
        W, WK, WK2, WS, WKS = self.W, self.WK, self.WK2, self.WS, self.WKS
        pa, qa, la, a1, a2, sa = terms
        # Target, step 0: r counts with its current tokens (the state right after the move).
        w0 = self.omega[0]
        b1 = w0 * pa * target.x[0]
        b2 = ab = w0 * pa * pa
        sb = w0 * pa * self.S[0]
        pb, qb, k0, k1 = self.target_window(req, target, delay_s)
        if k1 > k0:
            b1 += pb * (target.wx[k1] - target.wx[k0]) + qb * (target.wkx[k1] - target.wkx[k0])
            b2 += pb * pb * (W[k1] - W[k0]) + 2 * pb * qb * (WK[k1] - WK[k0]) + qb * qb * (WK2[k1] - WK2[k0])
            sb += pb * (WS[k1] - WS[k0]) + qb * (WKS[k1] - WKS[k0])
            hi = la if la < k1 else k1
            if hi > k0:
                ab += (pa * pb * (W[hi] - W[k0]) + (pa * qb + qa * pb) * (WK[hi] - WK[k0])
                       + qa * qb * (WK2[hi] - WK2[k0]))
        n = self.n
        return -((-2 * a1 + a2 + 2 * b1 + b2) / n - (2 * (sb - sa) + a2 + b2 - 2 * ab) / (n * n))

    def reduction(self, req: Req, source: Inst, target: Inst, delay_s: float) -> float:
        """How much moving ``req`` from ``source`` to ``target`` lowers :meth:`objective` (negative: raises it)."""
        return self.gain(self.source_terms(req, source), req, target, delay_s)

    def fits(self, req: Req, target: Inst, delay_s: float, mem_safety: float, predictive: bool) -> bool:
        """The memory filter with r's own tokens (errata §1.12.4): at every step of the horizon the target's
        simulated load plus r's KV (held from the start of the copy, growing once r runs, gone once it ends)
        stays within ``C_mem``; and the target's reported KV use plus r's tokens and predicted remaining
        length stays within its capacity (what an engine that reserves ahead, as the simulator does, needs)."""
        extra = req.remaining if predictive else 0.0
        if target.kv_used + req.tokens + extra > target.kv_capacity:
            return False
        cap = target.kv_capacity * mem_safety
        if not predictive or self.horizon == 0:
            return target.x[0] + req.tokens <= cap
        if target.xmax + req.tokens + min(req.remaining, self.horizon * target.delta) <= cap:
            return True  # a bound on the exact maximum below: most checks end here
        pb, qb, _, k1 = self.target_window(req, target, delay_s)
        return all(x + (max(float(req.tokens), pb + qb * k) if k < k1 else 0.0) <= cap
                   for k, x in enumerate(target.x))

    def apply(self, req: Req, source: Inst, target: Inst) -> None:
        """Carry a chosen move out in the state (for several migrations in one round)."""
        source.reqs.remove(req)
        target.reqs.append(Req(req.rid, req.tokens, req.remaining, movable=False))
        source.x = target.x = []
        self._trajectory(source)
        self._trajectory(target)
        self._sums()


def _remaining(info: DecodeRequestInfo) -> float:
    """N_hat(r) >= 1: the prediction, or without one the max_tokens bound."""
    remaining = info.predicted_remaining_tokens
    if remaining is None:
        remaining = info.max_output_tokens - info.generated_tokens
    return remaining if remaining > 1.0 else 1.0


class AresMigration:
    """ARES (or its Llumnix-like / oracle ablations, by ``params.mode``); see the module docstring.

    ``model`` (the engines' latency model) and ``mechanism`` (how a request moves) are the simulator's or the
    migrator's; without them the policy loads the latency profile each instance registered and assumes
    ``kv-transfer``.
    """

    needs_requests = True

    def __init__(self, params: AresParams | None = None, model: LatencyModel | None = None,
                 mechanism: MigrationMechanism | None = None, name: str | None = None) -> None:
        self.params = params or AresParams()
        self.name = name or {"predicted": "ares", "oracle": "ares-oracle", "current_only": "llumnix-like"}[
            self.params.mode]
        self.interval_s = self.params.interval_s
        self.model = model
        self.mechanism = mechanism
        self._models: dict[str, LatencyModel] = {}
        self._mechanisms: dict[str, MigrationMechanism] = {}
        self._moved_at: dict[str, float] = {}  # rid -> when this policy last moved it (cooldown)
        self.last_round: dict[str, float] = {}  # what the latest call saw and scored (benchmarks, status)
        p = self.params
        what = {"predicted": "predicted remaining lengths", "oracle": "true remaining lengths (simulator)",
                "current_only": "current token loads only (vLLM + rescheduling)"}[p.mode]
        self.note = (f"{self.name}: ARES Algorithm 1 on {what}; theta {p.theta}, H {p.horizon_steps}, "
                     f"{p.max_migrations_per_round} move(s) per {p.interval_s:g} s, cooldown {p.cooldown_s:g} s")

    @property
    def preferred_length_predictor(self) -> str | None:
        """The length predictor the simulator should fill the snapshot with when none is chosen explicitly."""
        return {"predicted": "ares-noise", "oracle": "oracle", "current_only": None}[self.params.mode]

    # -- inputs --------------------------------------------------------------------------------------
    def _model_for(self, profile: str) -> LatencyModel:
        if self.model is not None:
            return self.model
        model = self._models.get(profile)
        if model is None:
            try:
                model = LatencyModel(load_profile(profile))
            except ConfigError:
                model = LatencyModel(load_profile())  # an attached engine names no profile: assume the default
            self._models[profile] = model
        return model

    def _mechanism_for(self, profile: str) -> MigrationMechanism:
        if self.mechanism is not None:
            return self.mechanism
        mech = self._mechanisms.get(profile)
        if mech is None:
            mech = self._mechanisms[profile] = KvTransfer(self._model_for(profile))
        return mech

    def _t_exec(self, inst: InstanceLoad, infos: list[DecodeRequestInfo]) -> float:
        load = inst.load
        if load is not None and load.gen_throughput_tps > 0 and load.num_running_reqs > 0:
            return load.num_running_reqs / load.gen_throughput_tps
        model = self._model_for(inst.info.profile)
        tokens = sum(i.input_tokens + i.generated_tokens for i in infos)
        return max(model.decode_step_time_s(max(len(infos), 1), tokens), 1e-4)

    def requests(self, inst: Inst, now_s: float) -> list[Req]:
        """``inst``'s requests as candidates (built once per round, for searched instances only)."""
        if not inst.reqs and inst.infos:
            cooldown, moved_at = self.params.cooldown_s, self._moved_at
            inst.reqs = [Req(i.rid, i.input_tokens + i.generated_tokens, _remaining(i),
                             not i.migrating and (i.rid not in moved_at or now_s - moved_at[i.rid] >= cooldown))
                         for i in inst.infos]
        return inst.reqs

    def state(self, snapshot: ClusterSnapshot, now_s: float) -> AresState | None:
        """The round's :class:`AresState`, or None when fewer than two decode instances can take part."""
        p = self.params
        decode = {i.info.instance_id: i for i in snapshot.instances
                  if i.info.role == "decode" and i.info.status == "ready" and i.load is not None and i.load.healthy}
        if len(decode) < 2:
            return None
        horizon = 0 if p.mode == "current_only" else p.horizon_steps
        by_inst: dict[str, list[DecodeRequestInfo]] = {i: [] for i in decode}
        busy: set[str] = set()
        for info in snapshot.decode_requests:
            if info.migrating:
                busy.add(info.instance_id)
                if info.migration_source_id is not None:
                    busy.add(info.migration_source_id)
            infos = by_inst.get(info.instance_id)
            if infos is not None:
                infos.append(info)
        insts = []
        for iid, infos in by_inst.items():
            load = decode[iid]
            assert load.load is not None
            t_exec = self._t_exec(load, infos)
            delta = float(p.delta_tokens) if p.delta_tokens > 0 else float(max(1, round(p.step_s / t_exec)))
            capacity = load.load.max_total_num_tokens or load.info.kv_capacity_tokens
            inst = Inst(iid, [], t_exec, delta, capacity, load.load.num_used_tokens, iid in busy,
                        profile=load.info.profile, infos=infos)
            inst.x = trajectory(((i.input_tokens + i.generated_tokens, _remaining(i)) for i in infos), delta, horizon)
            insts.append(inst)
        return AresState(insts, horizon, step_weights(horizon, p.gamma), p.step_s)

    # -- Algorithm 1 ---------------------------------------------------------------------------------
    def classify(self, state: AresState) -> tuple[list[Inst], list[Inst]]:
        """(O, U): overloaded instances, most loaded first; underloaded ones, least loaded first (lines 13-15)."""
        p = self.params
        betas = state.omega[1:]
        for inst in state.insts.values():
            inst.w = inst.x[0] if state.horizon == 0 else sum(b * x for b, x in zip(betas, inst.x[1:], strict=True))
        w_bar = sum(i.w for i in state.insts.values()) / state.n
        over = sorted((i for i in state.insts.values() if i.w > (1 + p.theta) * w_bar),
                      key=lambda i: (-i.w, i.instance_id))
        bound = (1 + p.theta) if p.underload_rule == "paper" else (1 - p.theta)
        overloaded = {i.instance_id for i in over}
        under = sorted((i for i in state.insts.values()
                        if i.x[0] < bound * w_bar and i.instance_id not in overloaded),
                       key=lambda i: (i.w, i.instance_id))
        return over, under

    def select(self, snapshot: ClusterSnapshot, now_s: float) -> list[MigrationDecision]:
        p = self.params
        self._moved_at = {rid: t for rid, t in self._moved_at.items() if now_s - t < p.cooldown_s}
        state = self.state(snapshot, now_s)
        self.last_round = {"instances": 0, "overloaded": 0, "underloaded": 0, "candidates": 0}
        if state is None:
            return []
        moves: list[MigrationDecision] = []
        for _ in range(p.max_migrations_per_round):
            best = self._best_move(state, now_s)
            if best is None:
                break
            gain, req, source, target = best
            base = state.objective()
            moves.append(MigrationDecision(
                rid=req.rid, source_id=source.instance_id, target_id=target.instance_id,
                reason=(f"{self.name}: {source.instance_id} w={source.w:.0f} -> {target.instance_id} "
                        f"w={target.w:.0f}; objective -{gain / base:.1%}" if base > 0 else self.name)))
            self._moved_at[req.rid] = now_s
            self.requests(target, now_s)
            state.apply(req, source, target)
            source.busy = target.busy = True
        return moves

    def _best_move(self, state: AresState, now_s: float) -> tuple[float, Req, Inst, Inst] | None:
        p = self.params
        over, under = self.classify(state)
        over = [i for i in over if not i.busy]
        under = [i for i in under if not i.busy]
        self.last_round.update(instances=state.n, overloaded=len(over), underloaded=len(under))
        if not over or not under:
            return None
        if p.max_sources:
            over = over[:p.max_sources]
        if p.max_targets:
            under = under[:p.max_targets]
        base = state.objective()
        threshold = max(p.min_reduction_frac * base, 1e-9)
        predictive = p.mode != "current_only"
        best: tuple[float, Req, Inst, Inst] | None = None
        best_gain = threshold
        candidates = 0
        for source in over:
            mech = self._mechanism_for(source.profile)
            for req in self.requests(source, now_s):
                if not req.movable:
                    continue
                delay = mech.seconds(req.tokens)
                if predictive and req.remaining <= delay / source.t_exec_s:
                    continue  # it would finish before the move paid for itself (line 20)
                terms = state.source_terms(req, source)
                for target in under:
                    if not state.fits(req, target, delay, p.mem_safety, predictive):
                        continue
                    candidates += 1
                    gain = state.gain(terms, req, target, delay)
                    if gain > best_gain:
                        best, best_gain = (gain, req, source, target), gain
        self.last_round["candidates"] = self.last_round.get("candidates", 0) + candidates
        self.last_round["objective"] = base
        self.last_round["best_reduction"] = best_gain if best is not None else 0.0
        return best

