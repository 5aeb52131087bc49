"""How loaded each P:D split of a fixed GPU count would be under a given traffic mix: the model the Poise
controller scores candidate splits with.

The traffic is a request rate and the moments of its lengths (:class:`Mix`). Each side's load is a
utilisation, 1.0 meaning the side can no longer meet its SLO on average:

- prefill: ``rho_P = rate * W_P / p``, with ``W_P`` the mean prefill seconds one request costs
  (``overhead + a * E[L] + b * E[L^2]`` on the latency profile, exact for its quadratic shape), less the prompts
  that DOPD's local prefill keeps on the decode instances;
- decode: a decode instance with per-instance rate ``r`` runs ``n = r * OSL * T`` requests holding
  ``K = r * T * E[OSL * ISL + OSL^2 / 2]`` context tokens (Little's law per step), and a step costs
  ``T = o + s * n + c * K`` on the profile. Solved for ``T``: ``T = o / (1 - u)`` with
  ``u = r * (s * E[OSL] + c * E[OSL * ISL + OSL^2 / 2])`` (plus the local prefill work), so the TPOT SLO
  holds while ``u <= 1 - o / SLO``: ``rho_D = u / (1 - o / SLO)``. A step never costs more than one over the
  whole KV pool and every running slot (plus the most prompt a step prefills): past that, requests wait for
  KV rather than slowing the steps, so the KV bound below prices a request's decode at that step, not at the
  SLO. The running-request cap bounds it too, and
  so does KV: a decode instance reserves prompt + whole output when the request is dispatched (SGLang's
  decode side pre-allocates before the prefill starts), so a request holds ``ISL + OSL`` tokens through its
  prefill queue wait, its prefill and the KV transfer as well as its decode steps. Where prompts are long
  (Mooncake) the prefill phase is most of that, and a split short of prefill fills decode KV with prompts
  that wait: the prefill wait is M/M/1's ``E[S] * rho / (1 - rho)`` at the candidate's steady prefill load
  (at most the prefill target), at most the TTFT SLO. KV is a pool of whole requests, not a fluid: the
  tokens in use are a sum over a Poisson number of requests, with mean ``m`` (the token-seconds above times
  the rate) and variance about ``m * E[K^2] / E[K]`` for a request's ``K = ISL + OSL`` tokens (compound
  Poisson). The KV bound is ``m`` plus ``kv_sd`` standard deviations: where requests are a few percent of
  the pool each (Mooncake's 12K-token prompts in 380K tokens), one standard deviation is a quarter of the
  pool and a decode side at 90% mean use is full much of the time, while where they are small (Azure's)
  the term is a few percent.

The split's load is the larger of the two, each over its own target (prefill queues need headroom for
bursts; a decode batch runs at its SLO up to the line). Pure arithmetic, no state.

Colocated serving (:func:`colocated_load`) is the decode model with every prompt prefilled in the decode
steps (the same arithmetic as DOPD's local prefill, for all requests). Its load averages the prefill work over
the steps, which hides what decides colocated serving in practice: a step that carries a prompt delays
every running request's next token. So colocated serving is only *feasible* while one typical prompt's
step, the decode overhead plus the prefill work of ``sqrt(E[ISL^2])`` tokens (at most one chunk), fits in
``step_share`` of the TPOT SLO.
"""

from __future__ import annotations

import math

import msgspec

from shared.latency import LatencyModel

#: Standard deviations of KV use a decode side keeps free (module doc). At one, its pool is full about a sixth
#: of the time (a normal tail), when new requests queue a little and catch up. Chosen on Mooncake
#: conversation, where without it the controller flips to a 6P2D whose two decode pools stay full
#: (tests/bench/results/adaptive_pd.md).
KV_SD = 1.0


class Mix(msgspec.Struct, frozen=True, kw_only=True):
    """Traffic as the capacity model needs it: a rate and length moments (tokens)."""

    rate_rps: float
    isl: float
    osl: float
    isl_sq: float  # E[ISL^2]
    osl_sq: float  # E[OSL^2]
    isl_osl: float  # E[ISL * OSL]
    isl_cube: float = 0.0  # E[ISL^3]; 0 = unknown (read as a log-normal's, from the lower moments)
    isl_sq_osl: float = 0.0  # E[ISL^2 * OSL]; 0 = unknown (read as E[ISL^2] * E[OSL])
    local_share: float = 0.0  # share of requests prefilled on their decode instance (DOPD's local prefill)
    local_isl: float = 0.0  # their mean prompt length
    cached: float = 0.0  # E[C]: prompt tokens a prefill instance found in its prefix cache (0 for local ones)
    cached_sq: float = 0.0  # E[C^2]


class SideLoad(msgspec.Struct, frozen=True, kw_only=True):
    prefill: int
    decode: int
    rho_prefill: float
    rho_decode: float
    score: float  # max of the two over their targets: > 1 means a side is past what it can serve


def prefill_seconds(model: LatencyModel, mix: Mix) -> float:
    """Mean prefill-instance seconds per request (averaged over every request; local ones cost none). A prompt
    whose first C tokens were cached costs the work of its whole length less that of its prefix:
    s1 (I - C) + s2 (I^2 - C^2), so the cached moments come off the linear and the quadratic term."""
    p = model.profile
    f = min(1.0, max(0.0, mix.local_share))
    loc = mix.local_isl if f > 0 else 0.0
    linear = max(0.0, mix.isl - f * loc - mix.cached)
    quad = max(0.0, mix.isl_sq - f * loc * loc - mix.cached_sq)
    return ((1.0 - f) * p.prefill_overhead_s + p.prefill_s_per_token * linear + p.prefill_s_per_token2 * quad) \
        * model.time_scale


def prefill_kv_seconds(model: LatencyModel, mix: Mix, wait_s: float) -> float:
    """E[(ISL + OSL) * (wait + prefill + transfer)]: the decode KV token-seconds a request holds before its
    first token, when it waits ``wait_s`` for a prefill instance."""
    p = model.profile
    kv = mix.isl + mix.osl
    cube = mix.isl_cube if mix.isl_cube > 0 else (mix.isl_sq**3 / mix.isl**3 if mix.isl > 0 else 0.0)
    sq_osl = mix.isl_sq_osl if mix.isl_sq_osl > 0 else mix.isl_sq * mix.osl
    # (L + O) * S(L) with S = o + a L + b L^2, and (L + O) * transfer(L) with transfer = t0 + L * bytes / bandwidth
    prefill = (p.prefill_overhead_s * kv + p.prefill_s_per_token * (mix.isl_sq + mix.isl_osl)
               + p.prefill_s_per_token2 * (cube + sq_osl))
    transfer = p.transfer_overhead_s * kv + (mix.isl_sq + mix.isl_osl) * p.kv_bytes_per_token / p.transfer_bytes_per_s
    return wait_s * kv + (prefill + transfer) * model.time_scale


def kv_tokens_bound(mix: Mix, mean_tokens: float, kv_sd: float = KV_SD) -> float:
    """The KV tokens a decode side plans for when ``mean_tokens`` are in use on average: the mean plus
    ``kv_sd`` standard deviations of a compound Poisson sum of requests of ``K = ISL + OSL`` tokens each,
    whose variance is about ``mean * E[K^2] / E[K]``."""
    size = mix.isl + mix.osl
    biased = (mix.isl_sq + 2.0 * mix.isl_osl + mix.osl_sq) / size if size > 0 else 0.0  # E[K^2] / E[K]
    return mean_tokens + kv_sd * math.sqrt(max(0.0, mean_tokens) * biased)


def decode_rho(model: LatencyModel, mix: Mix, decode: int, tpot_slo_s: float, prefill_wait_s: float = 0.0, *,
               kv_sd: float = KV_SD, step_prompt_tokens: float | None = None) -> float:
    """Decode load of ``decode`` instances: the largest of the TPOT, KV and running-request bounds, for requests
    that wait ``prefill_wait_s`` for a prefill instance while their decode KV is reserved; the KV bound holds
    ``kv_sd`` standard deviations of the tokens in use as headroom (module doc). ``step_prompt_tokens`` is the
    most prompt a step prefills (default: the mean locally prefilled prompt, if any)."""
    if decode <= 0:
        return math.inf
    p = model.profile
    r = mix.rate_rps / decode
    ctx_steps = mix.isl_osl + mix.osl_sq / 2.0  # context tokens read over a request's decode steps
    local = mix.local_share * model.prefill_work_s(int(mix.local_isl)) if mix.local_share > 0 else 0.0
    u = r * ((p.decode_s_per_seq * mix.osl + p.decode_s_per_context_token * ctx_steps) * model.time_scale + local)
    overhead = p.decode_overhead_s * model.time_scale
    room = 1.0 - overhead / tpot_slo_s
    if room <= 0:
        return math.inf
    rho_tpot = u / room
    step = overhead / (1.0 - u) if u < 1.0 else tpot_slo_s
    # No step costs more than one that carries the whole KV pool, every running slot and the most prompt a
    # step prefills: past the decode side's capacity requests wait for KV instead of slowing the steps.
    if step_prompt_tokens is None:
        step_prompt_tokens = mix.local_isl if mix.local_share > 0 else 0.0
    full = ((p.decode_overhead_s + p.decode_s_per_seq * p.max_running_requests
             + p.decode_s_per_context_token * p.kv_capacity_tokens) * model.time_scale
            + model.prefill_work_s(int(step_prompt_tokens)))
    step = min(step, tpot_slo_s, full)
    # Whole outputs reserved from dispatch: through the prefill phase, and for OSL steps of decode.
    kv_mean = r * (prefill_kv_seconds(model, mix, prefill_wait_s) + step * (mix.isl_osl + mix.osl_sq))
    kv = kv_tokens_bound(mix, kv_mean, kv_sd) / p.kv_capacity_tokens
    running = r * step * mix.osl / p.max_running_requests
    return max(rho_tpot, kv, running)


def split_loads(model: LatencyModel, mix: Mix, instances: int, tpot_slo_s: float, *,
                ttft_slo_s: float = math.inf, prefill_target: float = 0.8, decode_target: float = 0.95,
                min_per_role: int = 1, prefill_backlog_s: float = 0.0, kv_sd: float = KV_SD) -> list[SideLoad]:
    """Every split of ``instances`` with at least ``min_per_role`` a side, with its loads and score;
    ``prefill_backlog_s`` is prefill work already queued, in instance-seconds per second; ``kv_sd`` the decode
    KV headroom (:func:`decode_rho`)."""
    w_p = prefill_seconds(model, mix)
    served = 1.0 - min(1.0, max(0.0, mix.local_share))
    s_mean = w_p / served if served > 0 else 0.0  # one remotely prefilled request's prefill time
    out = []
    for p in range(min_per_role, instances - min_per_role + 1):
        d = instances - p
        steady = mix.rate_rps * w_p / p
        rho_p = steady + prefill_backlog_s / p
        # The prefill wait decode KV is held through: at the steady load, and at most the prefill target's
        # (past it the prefill side's own score says the split is short; a backlog passes, so it moves prefill
        # instances, not decode ones).
        x = min(steady, prefill_target)
        wait = min(ttft_slo_s, s_mean * x / (1.0 - x)) if x < 1.0 else ttft_slo_s
        rho_d = decode_rho(model, mix, d, tpot_slo_s, wait if math.isfinite(wait) else 0.0, kv_sd=kv_sd)
        out.append(SideLoad(prefill=p, decode=d, rho_prefill=rho_p, rho_decode=rho_d,
                            score=max(rho_p / prefill_target, rho_d / decode_target)))
    return out


class ColocatedLoad(msgspec.Struct, frozen=True, kw_only=True):
    instances: int
    rho: float  # the decode model's load with every prompt prefilled in the decode steps
    step_s: float  # a step carrying one typical prompt (sqrt(E[ISL^2]) tokens, at most a chunk)
    feasible: bool  # step_s fits in the TPOT SLO's step share
    score: float  # rho over the decode target (inf when not feasible)


def colocated_load(model: LatencyModel, mix: Mix, instances: int, tpot_slo_s: float, *,
                   decode_target: float = 0.95, step_share: float = 0.6, kv_sd: float = KV_SD) -> ColocatedLoad:
    """How loaded ``instances`` colocated engines would be under ``mix`` (see the module doc)."""
    p = model.profile
    everything_local = msgspec.structs.replace(mix, local_share=1.0, local_isl=mix.isl)
    typical = min(math.sqrt(max(mix.isl_sq, 0.0)), float(p.chunked_prefill_size))
    rho = decode_rho(model, everything_local, instances, tpot_slo_s, kv_sd=kv_sd,
                     step_prompt_tokens=float(p.chunked_prefill_size))
    step_s = p.decode_overhead_s * model.time_scale + model.prefill_work_s(int(typical))
    feasible = step_s <= step_share * tpot_slo_s
    return ColocatedLoad(instances=instances, rho=rho, step_s=step_s, feasible=feasible,
                         score=rho / decode_target if feasible else math.inf)


def best_split(loads: list[SideLoad], current: int | None = None) -> SideLoad:
    """The split with the lowest score; among near-equal ones (within 2%), the closest to ``current``."""
    low = min(s.score for s in loads)
    near = [s for s in loads if s.score <= low * 1.02 + 1e-12]
    return min(near, key=lambda s: (abs(s.prefill - current) if current is not None else 0, s.score))
