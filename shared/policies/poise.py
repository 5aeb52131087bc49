"""Poise's pool policy: score every P:D split of the instances on the traffic it serves, move only when a
clearly better split holds up, one flip at a time.

Every ``interval_s`` the controller reads the monitor's series over the last ``window_s`` (request rate and
length moments: :class:`shared.policies.split_capacity.Mix`) and the prefill work already queued, and scores
every split with the capacity model in ``split_capacity`` (the latency profile the engines run on: the same
model DOPD's Eq. 11-14 come from, generalised to length distributions and local prefill). It then flips one
instance towards the best split when

- the best split cuts the wait in the queues by ``min_gain`` (:func:`worth_a_flip`). A request's wait in
  a queue grows as load / (1 - load) (M/M/1's queueing delay; the time to serve it does not depend on the
  split), so what a flip buys is the wait it removes, not the ratio of two loads: at light loads the two
  agree, and near capacity a smaller ratio of scores removes most of the wait (from 0.81 to 0.65, a ratio
  of 0.80, the wait falls by 56%). Past capacity (score > 1) every second of waiting adds to a queue: a
  split that carries the load is worth a flip whatever it scores. When neither does, the score must fall
  by ``min_gain``: a drain takes an instance away while the queues grow, and at Mooncake synthetic's peak a
  bar on the excess over capacity flipped between two overloaded splits on the noise of their scores. The
  decode KV bound prices a pool of whole requests with a standard deviation of headroom
  (``kv_sd``, by default ``split_capacity.KV_SD``); on the mean alone the overload rule flips Mooncake
  conversation into a 6P2D whose two decode pools stay full (tests/bench/results/adaptive_pd.md); and
- the same direction came out ``confirm`` evaluations in a row (one interval's mix can be an outlier), or,
  when neither split carries the load, for as long as the window the mix is measured over (``window_s``).
  Past capacity the scores follow the queues, and a burst shorter than the window lifts them for a few
  evaluations; a flip made on it holds the instance for ``min_dwell_s`` and the way back needs the
  ``min_gain`` bar again, which the split it left, past capacity too, need not clear although it serves
  more once the burst is over (a decode burst on Mooncake conversation: tests/bench/results/adaptive_pd.md).

What keeps it stable, and why each rule is there:

- No flip while one is in flight: the next decision sees the last flip's effect (a flip drains an instance,
  so two at once take two instances away from serving).
- ``cooldown_s`` after a flip before the next, and an instance that flipped stays ``min_dwell_s`` in its new
  role: at most one flip per instance per ``min_dwell_s``, so no ping-pong. A flip that was called off
  counts too: the instance begins no other drain for ``min_dwell_s``.
- The hysteresis ``min_gain`` and the smoothing ``window_s``: a split is only worth a drain when the model
  says it is clearly better over minutes, not seconds; the drain costs the instance's work for its length.
- A drain has a deadline (the planner's ``drain_timeout_s``; the simulator's ``SimCosts.drain_timeout_s``):
  after it the flip is called off and the instance keeps its role. Where a migrator empties draining decode
  instances (``PolicyContext.drain_migration``), a decode instance whose requests the others have room for
  drains in about one move, and the flip is judged by that.

Colocated serving is a mode the controller can move the whole cluster into, and out of again. Where the
TPOT SLO leaves room for prefill in the decode steps, colocated engines serve more than any split: each one
does both phases, so no side sits short while the other idles (Azure conversation: colocated holds 15.5x
the trace rate, the best fixed split 13x; tests/bench/results/sustained). Where a prompt's step does not fit
the TPOT SLO (long prompts: Azure code, Mooncake) it serves less. The controller scores the colocated
cluster with :func:`shared.policies.split_capacity.colocated_load` beside the splits and changes mode when

- one mode scores ``mode_gain`` better than the other (colocated: only while the model calls it feasible),
  ``confirm`` evaluations in a row, and
- the last mode change is ``mode_dwell_s`` old, and
- the cluster carries its load with one instance away, in either mode when entering colocated serving and
  in the split when leaving it (a move begun under overload only deepens the queues, and there the model
  ranks the modes worse than they serve).

Colocated serving is left, without waiting out the dwell, once the TPOT it serves at reaches
``tpot_exit_share`` of the SLO (the median of the monitor's per-interval p90 over ``tpot_window_s``) and a
split would carry the load with one instance away: the model's step rule decides whether to try colocated
serving, the measurement whether it holds, and no move is begun into an overload it cannot relieve. Unless
the load does not explain the miss: the step rule says colocated serving cannot hold either, or the colocated
load fits the decode target and the steps miss all the same (the prompts grew: in stress-mix-shift's move from
chat to code prompts the tail of the lengths breaks the steps minutes before the typical prompt breaks the
step rule). Then no load shed mends the steps, while a split past its capacity still serves in time the
requests the gateway's early rejection lets in, so the move goes on under the overload, half the cluster a
round (engines that miss their TPOT serve little in time while they wait their turn).

A mode change moves the instances in rounds, each as soon as the last one is done (no cooldown: the
decision was made, each round only carries it out); the move is a restart of the engine in the other mode
(SGLang switches between colocated and PD only at launch), so it costs the engine's start time. A round
restarts as many instances as the cluster can spare: the most, up to half of them, with which the load still
fits in either mode (the same capacity test as entering the mode, with k instances away instead of one), so
the exposed minutes of a move shrink where the load is light and the move goes one instance at a time where it
is not. Meanwhile the dispatcher sends colocated engines their share of the requests
(``shared.policies.dispatch.ColocatedShare``).

The controller does not forecast: the splits it scores are flat in the rate (both sides' loads are linear
in it), so what moves the best split is the length mix, which the window tracks; the load level only sets
whether a move is worth its drain. The queued prefill work counts as extra load spread over
``backlog_horizon_s``, so a burst that outruns the window still shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import msgspec

from shared.latency import LatencyModel
from shared.policies.context import PolicyContext
from shared.policies.evacuation import EVACUATE_AFTER_S, free_kv_tokens
from shared.policies.migration_cost import make_migration_mechanism
from shared.policies.pools import PoolDecision, RoleChange
from shared.policies.report import PolicyReport
from shared.policies.split_capacity import (
    KV_SD,
    ColocatedLoad,
    Mix,
    SideLoad,
    best_split,
    colocated_load,
    split_loads,
)
from shared.protocol.messages import ClusterSnapshot, InstanceLoad, SeriesPoint
from shared.series import merge_points


class PoiseParams(msgspec.Struct, frozen=True, kw_only=True):
    interval_s: float = 10.0  # how often the splits are scored
    window_s: float = 120.0  # the traffic mix planned for: the series' last window
    min_completed: int = 30  # fewer finished requests in the window are too few to judge a mix by: no move
    prefill_target: float = 0.8  # prefill utilisation that counts as full (queues need headroom for bursts)
    decode_target: float = 0.95  # decode utilisation that counts as full (the TPOT SLO is already in it)
    min_gain: float = 0.25  # move only to a split whose queueing delay is this much lower (worth_a_flip;
    #                         chosen: tests/bench/results/poise_tuning.md)
    confirm: int = 2  # the same direction in this many evaluations in a row
    cooldown_s: float = 30.0  # after a flip, before the next
    min_dwell_s: float = 300.0  # an instance that flipped keeps its new role at least this long
    reverse_after_s: float = 300.0  # a flip against the direction of the last one waits this long
    backoff_s: float = 60.0  # after a flip was called off (drain past its deadline), that direction waits this
    #                          long, doubling with each call-off in a row, up to ``max_backoff_s``
    max_backoff_s: float = 600.0
    backlog_horizon_s: float = 60.0  # queued prefill work is load spread over this many seconds
    max_drain_s: float = 45.0  # no flip of an instance that would take longer to drain (the drain deadline is 60 s)
    colocated: bool = True  # colocated serving is a mode the controller may choose (restarts the engines)
    colocated_step_share: float = 0.6  # colocated only while a typical prompt's step fits this share of the TPOT
    #                                    SLO (chosen: azure-conv's is 0.41, azure-code's 1.04; tests/bench/results/provenance.md)
    mode_dwell_s: float = 900.0  # after a mode change, the next waits this long (a move restarts every engine)
    mode_gain: float = 0.1  # a mode change wants the other mode to score this much lower (the dwell, not a wide
    #                         hysteresis, keeps modes stable; chosen on azure-conv: tests/bench/results/provenance.md)
    tpot_exit_share: float = 0.8  # colocated serving is left when its measured TPOT p90 reaches this share of the SLO
    tpot_window_s: float = 60.0  # ... the median of the monitor's per-interval TPOT p90 over this window
    kv_sd: float = KV_SD  # decode KV kept free, in standard deviations of the tokens in use (split_capacity;
    #                       chosen: tests/bench/results/poise_tuning.md)


def worth_a_flip(current: float, best: float, min_gain: float) -> bool:
    """Whether a split scoring ``best`` is worth a drain away from one scoring ``current`` (scores: load over
    the target, > 1 past capacity): below capacity by the queueing delay each would see; past it, always for
    a split that carries the load, and by the ratio of the scores when neither does."""
    if best <= 1.0 < current:
        return True  # a queue that grows against one that does not
    if current < 1.0:
        return best / (1.0 - best) < (1.0 - min_gain) * current / (1.0 - current)
    return best < (1.0 - min_gain) * current


class PoisePools:
    name = "poise"
    note = ("poise: scores every P:D split and colocated serving on the served mix (latency model); flips one "
            "instance at a time towards a clearly better split, or restarts the cluster into colocated serving")

    def __init__(self, model: LatencyModel, ctx: PolicyContext, params: PoiseParams | None = None) -> None:
        self.model, self.ctx = model, ctx
        self.params = params or PoiseParams()
        self.interval_s = self.params.interval_s
        self._last_flip_s = float("-inf")
        self._flipped_at: dict[str, float] = {}
        self._streak = 0  # evaluations in a row that wanted the current direction
        self._direction = 0  # +1: more prefill, -1: more decode, 0: stay
        self._last_direction = 0  # of the last flip
        self._pending: tuple[str, str] | None = None  # the last flip (instance, new role), until it is seen done
        self._called_off = 0  # flips called off in a row
        self._blocked_until = {1: float("-inf"), -1: float("-inf")}  # per direction, after call-offs
        self.last_loads: list[SideLoad] = []  # the newest scoring, for logs, status and tests
        self.last_colocated: ColocatedLoad | None = None
        self.mode: str | None = None  # "colocated" or "disaggregated": the mode the cluster is in or moving to
        self._mode_since = float("-inf")
        self._mode_streak = 0
        self._left_hopeless = False  # the last mode change left a colocated mode failing for its steps, not load
        self.last_mix: Mix | None = None
        self.decisions = 0
        self.drains_deferred = 0  # flips the model wanted but no instance could drain in max_drain_s
        self._drain_mechanism = (make_migration_mechanism(ctx.drain_migration, model)
                                 if ctx.drain_migration is not None else None)

    @property
    def target_prefill(self) -> int | None:
        """The best split's prefill count at the newest scoring (None before the first)."""
        return best_split(self.last_loads).prefill if self.last_loads else None

    def describe_split(self) -> str:
        """One line on the newest scoring: the mix and the best split (for the planner's events and status)."""
        if not self.last_loads or self.last_mix is None:
            return ""
        m, best = self.last_mix, best_split(self.last_loads)
        co = self.last_colocated
        colocated = "" if co is None else (
            f"; colocated {co.score:.2f}" if co.feasible else f"; colocated infeasible (step {co.step_s * 1e3:.0f} ms)")
        return (f"mix {m.rate_rps:.1f} req/s, ISL {m.isl:.0f}, OSL {m.osl:.0f} -> best {best.prefill}P{best.decode}D "
                f"(score {best.score:.2f}: P {best.rho_prefill:.2f}, D {best.rho_decode:.2f}){colocated}; "
                f"mode {self.mode}")

    def report(self) -> PolicyReport:
        return PolicyReport(target_prefill=self.target_prefill, reason=self.describe_split(),
                            splits=tuple(self.last_loads), drains_deferred=self.drains_deferred)

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> PoolDecision | None:
        if any(i.info.status in ("draining", "switching") for i in snapshot.instances):
            return None  # one flip at a time: the next decision sees this one's effect
        self._check_pending(snapshot, now_s)
        mix = mix_of(snapshot.series, self.params.window_s, self.params.min_completed)
        if mix is None:
            return None
        ready = [i for i in snapshot.instances if i.info.status == "ready" and i.load is not None]
        prefills = [i for i in ready if i.info.role == "prefill"]
        decodes = [i for i in ready if i.info.role == "decode"]
        colocated = [i for i in ready if i.info.role == "null"]
        total = len(ready)
        if total < 2 * self.ctx.min_per_role:
            return None
        if colocated:
            # Colocated engines prefill every request themselves, which the series counts as local prefill:
            # a split would prefill them remotely, save DOPD's short ones, which colocated serving hides.
            mix = msgspec.structs.replace(mix, local_share=0.0, local_isl=0.0)
        if self.mode is None:  # the mode the cluster was launched in
            self.mode = "colocated" if len(colocated) * 2 > total else "disaggregated"
        backlog_s = sum(self._queued_prefill_s(i, mix) for i in prefills)
        loads = split_loads(self.model, mix, total, self.ctx.tpot_slo_s, ttft_slo_s=self.ctx.ttft_slo_s,
                            prefill_target=self.params.prefill_target,
                            decode_target=self.params.decode_target, min_per_role=self.ctx.min_per_role,
                            prefill_backlog_s=backlog_s / self.params.backlog_horizon_s, kv_sd=self.params.kv_sd)
        co = colocated_load(self.model, mix, total, self.ctx.tpot_slo_s, decode_target=self.params.decode_target,
                            step_share=self.params.colocated_step_share, kv_sd=self.params.kv_sd)
        self.last_loads, self.last_mix, self.last_colocated = loads, mix, co
        self.decisions += 1
        best = best_split(loads, len(prefills) if prefills else None)
        tpot_p90 = window_tpot_p90(snapshot.series, self.params.tpot_window_s)
        self._choose_mode(best, co, now_s, lambda: self.scores_away(mix, total, 1), tpot_p90)
        if self.mode == "colocated" and (prefills or decodes):
            return self._convert(prefills, decodes, best, now_s, mix, self._spare(mix, total))
        if self.mode == "disaggregated" and colocated:
            # Out of a colocated mode that failed its step, half the cluster a round: engines that miss their
            # TPOT serve little in time, so restarting them costs little and every round spent there costs all.
            spare = max(1, total // 2) if self._left_hopeless else self._spare(mix, total)
            return self._restore(colocated, prefills, decodes, best, now_s, mix, spare)
        if not prefills or not decodes:
            return None
        current = next(s for s in loads if s.prefill == len(prefills))
        worth = worth_a_flip(current.score, best.score, self.params.min_gain)
        direction = 0 if best.prefill == current.prefill or not worth else (1 if best.prefill > current.prefill else -1)
        self._streak = self._streak + 1 if direction == self._direction and direction != 0 else int(direction != 0)
        self._direction = direction
        if direction == 0 or self._streak < self._confirmations(current, best) \
                or now_s - self._last_flip_s < self.params.cooldown_s:
            return None
        if direction == -self._last_direction and now_s - self._last_flip_s < self.params.reverse_after_s:
            return None  # no back and forth: the last flip's direction holds for reverse_after_s
        if now_s < self._blocked_until[direction]:
            return None
        change = self._flip(decodes if direction > 0 else prefills, "prefill" if direction > 0 else "decode",
                            now_s, mix, f"poise: {current.prefill}P{current.decode}D scores {current.score:.2f} "
                                        f"(P {current.rho_prefill:.2f}, D {current.rho_decode:.2f}), "
                                        f"{best.prefill}P{best.decode}D {best.score:.2f}")
        return PoolDecision(changes=[change] if change is not None else [])

    def _confirmations(self, current: SideLoad, best: SideLoad) -> int:
        """Evaluations in a row a flip from ``current`` to ``best`` needs: ``confirm``, or, when neither split
        carries the load, as many as cover the window the mix is measured over (see the module doc)."""
        if current.score > 1.0 and best.score > 1.0:
            return max(self.params.confirm, math.ceil(self.params.window_s / self.params.interval_s))
        return self.params.confirm

    def scores_away(self, mix: Mix, total: int, away: int) -> tuple[float, float]:
        """The scores of the best split and of colocated serving with ``away`` instances out for their drain
        and restart (inf when fewer than two would be left)."""
        less = total - away
        if less < 2:
            return math.inf, math.inf
        split = best_split(split_loads(self.model, mix, less, self.ctx.tpot_slo_s, ttft_slo_s=self.ctx.ttft_slo_s,
                                       prefill_target=self.params.prefill_target,
                                       decode_target=self.params.decode_target, min_per_role=self.ctx.min_per_role,
                                       kv_sd=self.params.kv_sd))
        co = colocated_load(self.model, mix, less, self.ctx.tpot_slo_s, decode_target=self.params.decode_target,
                            step_share=self.params.colocated_step_share, kv_sd=self.params.kv_sd)
        return split.score, co.score

    def _spare(self, mix: Mix, total: int) -> int:
        """How many instances a round of a mode change may restart at once: the most, up to half the cluster,
        with which the load fits in either mode (at least one: a move, once begun, goes on)."""
        spare = 1
        for away in range(2, total // 2 + 1):
            if max(self.scores_away(mix, total, away)) > 1.0:
                break
            spare = away
        return spare

    def _choose_mode(self, best: SideLoad, co: ColocatedLoad, now_s: float,
                     one_away: Callable[[], tuple[float, float]], tpot_p90_s: float | None) -> None:
        """Change ``self.mode`` when the other mode has scored ``mode_gain`` better ``confirm`` times in a row
        and the last change is ``mode_dwell_s`` old.

        Colocated serving is entered only while the model calls it feasible and the cluster carries its load
        with one instance away in either mode (``one_away``: a move begun under overload only deepens the
        queues); once entered, the move goes on at any load (a cluster left half-way serves worse than either
        mode: pairs of the wrong split beside colocated engines, an instance without a partner). It is left,
        without waiting out the dwell, when it stops holding (the TPOT it serves at reaches
        ``tpot_exit_share`` of the SLO; the model's step rule only while nothing was measured) and a split
        would carry the load with one instance away: under an overload no split carries, the restarts would
        only take capacity away. The same holds for leaving because a split scores better."""
        keep = 1.0 - self.params.mode_gain
        if self.mode == "colocated":
            if tpot_p90_s is not None:
                failing = tpot_p90_s >= self.params.tpot_exit_share * self.ctx.tpot_slo_s
            else:
                failing = not co.feasible
            # Its load, not its score: the step rule that makes the score infinite only gates the way in. Either
            # reason to leave needs a split that carries the load: under an overload the model ranks the modes
            # worse than they serve, and each restart takes an instance away. Except when colocated serving
            # fails where its load does not explain it: the step rule says a typical prompt's step no longer
            # fits, or the load fits the decode target and the steps still miss (the prompts' tail grew before
            # their typical length). No load shed mends steps, while a split past its capacity still serves in
            # time what it takes (early rejection refuses the rest).
            hopeless = failing and (not co.feasible or co.rho <= self.params.decode_target)
            wants = ((failing or best.score < co.rho / self.params.decode_target * keep)
                     and (hopeless or one_away()[0] <= 1.0))
            leave = wants and failing
        else:
            leave = hopeless = False
            wants = (self.params.colocated and co.feasible and co.score < best.score * keep
                     and max(one_away()) <= 1.0)
        self._mode_streak = self._mode_streak + 1 if wants else 0
        if not wants or self._mode_streak < self.params.confirm:
            return
        if not leave and now_s - self._mode_since < self.params.mode_dwell_s:
            return
        self.mode = "disaggregated" if self.mode == "colocated" else "colocated"
        self._left_hopeless = hopeless
        self._mode_since, self._mode_streak, self._streak, self._direction = now_s, 0, 0, 0

    def _convert(self, prefills: Sequence[InstanceLoad], decodes: Sequence[InstanceLoad], best: SideLoad,
                 now_s: float, mix: Mix, spare: int) -> PoolDecision:
        """Up to ``spare`` more instances into colocated serving, each from the side the remaining pairs need
        least (the best split's shares), the last prefill or decode instance only once the other side is gone."""
        prefills, decodes = list(prefills), list(decodes)
        reason = f"poise: colocated mode ({self.describe_split()})"
        changes: list[RoleChange] = []
        while len(changes) < spare and (prefills or decodes):
            if not decodes:
                side = prefills
            elif not prefills:
                side = decodes
            elif len(prefills) == 1 or len(decodes) == 1:
                side = decodes if len(prefills) == 1 and len(decodes) > 1 else prefills
            else:
                share = len(prefills) / (len(prefills) + len(decodes))
                side = prefills if share > best.prefill / (best.prefill + best.decode) else decodes
            change = self._pick_victim(side, "null", now_s, mix, reason)
            if change is None:
                break
            changes.append(change)
            side[:] = [i for i in side if i.info.instance_id != change.instance_id]
        return PoolDecision(changes=changes)

    def _restore(self, colocated: Sequence[InstanceLoad], prefills: Sequence[InstanceLoad],
                 decodes: Sequence[InstanceLoad], best: SideLoad, now_s: float, mix: Mix,
                 spare: int) -> PoolDecision:
        """Up to ``spare`` colocated instances back to disaggregated serving, each in the role the best split
        needs most (a pair first: an instance without a partner serves nothing)."""
        colocated = list(colocated)
        n_prefill, n_decode = len(prefills), len(decodes)
        reason = f"poise: disaggregated mode ({self.describe_split()})"
        changes: list[RoleChange] = []
        while len(changes) < spare and colocated:
            if not n_decode:
                role = "decode"
            elif not n_prefill:
                role = "prefill"
            else:
                role = "prefill" if best.prefill - n_prefill >= best.decode - n_decode else "decode"
            change = self._pick_victim(colocated, role, now_s, mix, reason)
            if change is None:
                break
            changes.append(change)
            colocated = [i for i in colocated if i.info.instance_id != change.instance_id]
            n_prefill, n_decode = n_prefill + (role == "prefill"), n_decode + (role == "decode")
        return PoolDecision(changes=changes)

    def _pick_victim(self, side: Sequence[InstanceLoad], new_role: str, now_s: float, mix: Mix,
                     reason: str) -> RoleChange | None:
        """The instance of ``side`` that drains soonest, among those not dwelling after a move of their own,
        when it drains within ``max_drain_s``."""
        movable = [i for i in side if now_s - self._flipped_at.get(i.info.instance_id, float("-inf"))
                   >= self.params.min_dwell_s]
        if not movable:
            return None
        free = {i.info.instance_id: _free_kv(i) for i in side}
        room = sum(free.values())
        drain_s, victim = min(((self._drain_s(i, mix, room - free[i.info.instance_id]), i) for i in movable),
                              key=lambda d: (d[0], d[1].info.instance_id))
        if drain_s > self.params.max_drain_s:
            self.drains_deferred += 1
            return None
        self._flipped_at[victim.info.instance_id] = now_s
        self._pending = (victim.info.instance_id, new_role)
        return RoleChange(instance_id=victim.info.instance_id, new_role=new_role,  # type: ignore[arg-type]
                          reason=reason)

    def _flip(self, side: Sequence[InstanceLoad], new_role: str, now_s: float, mix: Mix,
              reason: str) -> RoleChange | None:
        """The instance of ``side`` that drains soonest, among those not dwelling after a flip of their own,
        when it can drain within ``max_drain_s``: a drain that outlives its deadline is called off, and until
        then it only took the instance's share of new work away from a cluster that is already behind."""
        if len(side) <= self.ctx.min_per_role:
            return None
        change = self._pick_victim(side, new_role, now_s, mix, reason)
        if change is not None:
            self._last_flip_s = now_s
            self._last_direction = 1 if new_role == "prefill" else -1
            self._streak = 0
        return change

    def _check_pending(self, snapshot: ClusterSnapshot, now_s: float) -> None:
        """Once the last flip is over, see whether it happened: an instance back in its old role means the drain
        outlived its deadline and the flip was called off, so that direction backs off (doubling)."""
        if self._pending is None:
            return
        instance_id, new_role = self._pending
        inst = next((i for i in snapshot.instances if i.info.instance_id == instance_id), None)
        self._pending = None
        if inst is None or inst.info.role == new_role:
            self._called_off = 0
            return
        self._called_off += 1
        direction = 1 if new_role == "prefill" else -1
        wait = min(self.params.max_backoff_s, self.params.backoff_s * 2 ** (self._called_off - 1))
        self._blocked_until[direction] = now_s + wait
        # It keeps its dwell although its role did not change: a drain that ran past its deadline says it is
        # busy, and an instance begins at most one drain per ``min_dwell_s`` (the next try takes another).
        self._last_direction = 0  # the reverse direction need not wait for a flip that did not happen

    def _drain_s(self, inst: InstanceLoad, mix: Mix, room_tokens: float) -> float:
        """About how long ``inst`` takes to drain: a prefill instance its queued prompts; a decode instance
        the tokens its requests still owe (a running one the mix's mean residual length, E[OSL^2] / 2 E[OSL];
        one waiting for its KV or a slot the whole mean OSL), at its current batch's tokens per step.

        Where drains migrate (``ctx.drain_migration``) and the other decode instances have ``room_tokens`` of
        free KV for what it holds, a decode instance drains by moving its requests instead: the running ones
        at once (each stalls for the mechanism's time, counted for twice the mean context as the longest), the
        waiting ones each after its prefill elsewhere (counted one after another, at the mix's mean prompt)."""
        load = inst.load
        if load is None:
            return 0.0
        if inst.info.role == "prefill":
            return self._queued_prefill_s(inst, mix)
        running, waiting = load.num_running_reqs, load.num_waiting_reqs
        if running + waiting == 0:
            return 0.0
        context = load.num_running_tokens if load.num_running_tokens is not None else load.num_used_tokens
        if self._drain_mechanism is not None and inst.info.role == "decode" and load.num_used_tokens <= room_tokens:
            longest = 2 * context // max(1, running)
            return (EVACUATE_AFTER_S + self._drain_mechanism.seconds(longest)
                    + waiting * self.model.prefill_time_s(round(mix.isl)))
        residual = mix.osl_sq / (2.0 * mix.osl) if mix.osl > 0 else 0.0
        owed = running * residual + waiting * mix.osl
        batch = max(1, running)
        return owed / batch * self.model.decode_step_time_s(batch, context)

    def _queued_prefill_s(self, inst: InstanceLoad, mix: Mix) -> float:
        """Prefill seconds waiting on ``inst``: its queued uncached tokens, as prompts of the mix's lengths. A
        queued token belongs to a prompt of ``E[L^2] / E[L]`` tokens on average (size-biased), which prices the
        quadratic term; the engine's waiting-request count cannot, as SGLang counts the bootstrap queue in it
        (requests waiting for their decode side's KV) but not their tokens."""
        load = inst.load
        if load is None or load.num_waiting_uncached_tokens <= 0:
            return 0.0
        tokens = load.num_waiting_uncached_tokens
        p = self.model.profile
        prompts = tokens / mix.isl if mix.isl > 0 else 1.0
        biased = min(float(tokens), mix.isl_sq / mix.isl) if mix.isl > 0 else float(tokens)
        return (prompts * p.prefill_overhead_s + p.prefill_s_per_token * tokens
                + p.prefill_s_per_token2 * tokens * biased) * self.model.time_scale


def _free_kv(inst: InstanceLoad) -> float:
    """Decode KV tokens ``inst`` could take in by migration: what it reports free, none when it is not ready or
    reports no capacity (the drain is then judged by its answers)."""
    room = free_kv_tokens(inst) if inst.info.status == "ready" else None
    return 0.0 if room is None else room


def window_tpot_p90(series: Sequence[SeriesPoint], window_s: float) -> float | None:
    """The median of the series' per-interval TPOT p90 over its last ``window_s`` (None when none measured):
    one interval's p90 of a few requests swings, the median of a minute's does not."""
    if not series:
        return None
    end = series[-1].start_unix_s + series[-1].interval_s
    values = sorted(p.tpot_p90_s for p in series if p.start_unix_s + p.interval_s > end - window_s
                    and p.tpot_p90_s is not None)
    return values[len(values) // 2] if values else None


def mix_of(series: Sequence[SeriesPoint], window_s: float, min_completed: int = 1) -> Mix | None:
    """The traffic of the series' last ``window_s``: arrival rate and the completed requests' length moments
    (None while fewer than ``min_completed`` requests completed in it)."""
    if not series:
        return None
    end = series[-1].start_unix_s + series[-1].interval_s
    w = merge_points([p for p in series if p.start_unix_s + p.interval_s > end - window_s])
    if w is None or w.completed < max(1, min_completed) or w.interval_s <= 0:
        return None
    isl, osl = w.mean_input_tokens, w.mean_output_tokens

    def moment(value: float, fallback: float) -> float:
        return value if value > 0 else fallback  # a monitor that sends no higher moments: equal lengths

    return Mix(rate_rps=w.arrival_rate_rps, isl=isl, osl=osl, isl_sq=moment(w.mean_input_tokens_sq, isl * isl),
               osl_sq=moment(w.mean_output_tokens_sq, osl * osl), isl_osl=moment(w.mean_input_output_tokens, isl * osl),
               isl_cube=w.mean_input_tokens_cube, isl_sq_osl=w.mean_input_sq_output_tokens,
               local_share=w.local_prefilled / w.completed, local_isl=w.mean_local_input_tokens,
               cached=w.mean_cached_input_tokens, cached_sq=w.mean_cached_input_tokens_sq)
