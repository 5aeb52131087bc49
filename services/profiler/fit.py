"""Least-squares fits of the latency model's coefficients (shared/latency/model.py) from measured points.

Prefill, one prompt of ``n`` tokens alone on an idle colocated engine, in ``k(n)`` forward passes (chunked
prefill: ``k = ceil(n / chunked_prefill_size)``)::

    t(n) = c0 + o * k(n) + a * n + b * n^2

``o`` is the profile's ``prefill_overhead_s`` (the latency model charges it once per pass), ``a`` and ``b``
its ``prefill_s_per_token`` and ``prefill_s_per_token2`` (chunks add up exactly to ``a*n + b*n^2``).
``c0`` is what a request costs outside forward passes (HTTP, tokenizer and scheduler hops); the model has no
field for it, so it is reported, not kept. ``c0`` and ``o`` can only be told apart when ``k`` varies in a way
``n`` does not (prompts on both sides of a chunk boundary); without that the intercept is all ``o``.

Decode, one step over ``B`` sequences holding ``ctx`` context tokens in all::

    step(B, ctx) = d0 + d1 * B + d2 * ctx

(``decode_overhead_s``, ``decode_s_per_seq``, ``decode_s_per_context_token``).

Each prompt length is repeated; the fit takes its fastest repetition by default: timing noise (a busy CPU,
the event loop's timer, a GPU's interference) mostly adds time, so the fastest of a few runs is the best
estimate of the work, and a constant bias (the engine's timer, say) lands in c0. A stall of a shared machine
can still stretch a decode window's segment, or every repetition of one prompt length. Both fits therefore
drop points far outside the others (more than ``OUTLIER_MADS`` noise scales from a fit of the others, see
``_worst_outlier``), at most a fifth of them, and refit; the prefill fit never drops a point it needs to tell
its coefficients apart. Each coefficient gets its least-squares standard error.

Coefficients must not be negative (``LatencyProfile`` refuses them): a negative one is fixed at zero and the
others are refitted, and the fit says which.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from services.profiler.samples import DecodeSample, PrefillSample, Statistic

OUTLIER_MADS = 5.0  # noise scales (robust standard deviations, see _z_scores) beyond which a sample is out
OUTLIER_FLOOR = 0.001  # the relative noise scale is at least this (exact data has a spread of ~0)
OUTLIER_FLOOR_S = 5e-5  # the absolute noise scale is at least this many (engine) seconds
OUTLIER_SHARE = 0.2  # never drop more than this share of the samples


class FitStats(msgspec.Struct, frozen=True, kw_only=True):
    points: int
    r2: float  # 1 - SS_res / SS_tot over the fitted points
    rmse_s: float
    max_rel_error: float  # max |fitted - measured| / measured
    rel_errors: list[float]  # per point, (fitted - measured) / measured, in the order given


class PrefillFit(msgspec.Struct, frozen=True, kw_only=True):
    overhead_s: float  # o: per forward pass
    s_per_token: float  # a
    s_per_token2: float  # b
    request_overhead_s: float  # c0: per request, outside passes (0 when not separable)
    separated_request_overhead: bool  # whether c0 was fitted apart from o
    clamped: list[str]  # coefficients that came out negative and were fixed at 0
    outliers: list[int]  # indices of samples left out of the final fit
    statistic: Statistic  # which repetition of each length was fitted: "min" (the fastest) or "median"
    stats: FitStats  # over every sample, the outliers included
    std_errors: dict[str, float]  # standard error of each coefficient, by profile field name

    def predict_s(self, tokens: int, passes: int) -> float:
        return (self.request_overhead_s + self.overhead_s * passes + self.s_per_token * tokens
                + self.s_per_token2 * tokens * tokens)


class DecodeFit(msgspec.Struct, frozen=True, kw_only=True):
    overhead_s: float  # d0
    s_per_seq: float  # d1
    s_per_context_token: float  # d2
    clamped: list[str]
    outliers: list[int]  # indices of samples left out of the final fit (stalls), see fit_decode
    stats: FitStats  # over every sample, the outliers included
    std_errors: dict[str, float]  # standard error of each coefficient, by profile field name

    def predict_s(self, batch: float, context_tokens: float) -> float:
        return self.overhead_s + self.s_per_seq * batch + self.s_per_context_token * context_tokens


def passes(tokens: int, chunk: int | None) -> int:
    """Forward passes a prompt alone takes: chunks of ``chunk`` tokens (None or <= 0: no chunking, one pass)."""
    if chunk is None or chunk <= 0:
        return 1
    return max(1, math.ceil(tokens / chunk))


def nonnegative_lstsq(columns: dict[str, np.ndarray], y: np.ndarray) -> tuple[dict[str, float], list[str]]:
    """Least squares over named columns with every coefficient >= 0.

    Columns are scaled to unit maximum first: prefill's ``n^2`` reaches 1e9 next to a column of ones, and an
    unscaled solve loses the small coefficients to rounding. A coefficient that comes out negative is fixed at
    zero (its column dropped) and the rest refitted, most negative first, until none is negative; one whose
    whole contribution is rounding noise (exact data, a true zero) is set to zero without being reported.
    """
    names = list(columns)
    active = list(names)
    clamped: list[str] = []
    tiny = 1e-9 * max(float(np.max(np.abs(y))), 1e-300)
    while True:
        if not active:
            return dict.fromkeys(names, 0.0), clamped
        scale = np.array([max(float(np.max(np.abs(columns[n]))), 1e-300) for n in active])
        design = np.column_stack([columns[n] for n in active]) / scale
        solution, *_ = np.linalg.lstsq(design, y, rcond=None)
        worst = int(np.argmin(solution))
        if solution[worst] >= -tiny:
            out = dict.fromkeys(names, 0.0)
            out.update({n: max(0.0, float(c)) for n, c in zip(active, solution / scale, strict=True)})
            return out, clamped
        clamped.append(active.pop(worst))


def standard_errors(columns: dict[str, np.ndarray], y: np.ndarray, coef: dict[str, float]) -> dict[str, float]:
    """Least-squares standard error of each coefficient, ``sqrt(s^2 (X'X)^-1)``, from the fit's own residuals:
    how well the data pin it down (a clamped coefficient, fixed at 0, gets 0). inf when there are no spare
    points to estimate the noise from."""
    free = [n for n in columns if coef[n] > 0]
    out = dict.fromkeys(columns, 0.0)
    dof = len(y) - len(free)
    if not free:
        return out
    if dof <= 0:
        return {n: (math.inf if n in free else 0.0) for n in columns}
    design = np.column_stack([columns[n] for n in free])
    residual = y - design @ np.array([coef[n] for n in free])
    s2 = float(residual @ residual) / dof
    scale = np.array([max(float(np.max(np.abs(columns[n]))), 1e-300) for n in free])
    cov = s2 * np.linalg.pinv((design / scale).T @ (design / scale)) / np.outer(scale, scale)
    out.update({n: math.sqrt(max(0.0, float(cov[i, i]))) for i, n in enumerate(free)})
    return out


def _stats(measured: np.ndarray, fitted: np.ndarray) -> FitStats:
    residual = fitted - measured
    ss_res = float(np.sum(residual**2))
    ss_tot = float(np.sum((measured - np.mean(measured)) ** 2))
    rel = residual / np.where(measured > 0, measured, np.nan)
    rel_list = [float(r) if np.isfinite(r) else 0.0 for r in rel]
    return FitStats(points=len(measured), r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
                    rmse_s=math.sqrt(ss_res / len(measured)), max_rel_error=max((abs(r) for r in rel_list), default=0.0),
                    rel_errors=rel_list)


def can_separate_request_overhead(samples: Sequence[PrefillSample]) -> bool:
    """Whether c0 and o are identifiable: several single-pass prompts of different lengths, and at least two
    multi-pass ones (so the pass count moves against length, not only with it)."""
    single = {s.tokens for s in samples if s.passes == 1}
    multi = {s.tokens for s in samples if s.passes > 1}
    return len(single) >= 3 and len(multi) >= 2


def _mad_sigma(values: np.ndarray) -> float:
    return 1.4826 * float(np.median(np.abs(values - np.median(values)))) if len(values) else 0.0


def _z_scores(residual: np.ndarray, y: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Residuals in noise scales estimated from the ``ref`` points.

    The noise scale of point i is ``max(s_abs, rho * y_i)``: noise differs in kind, an engine_sim (or a CPU-side
    hiccup) adds milliseconds whatever the prompt, a GPU's clock varies by a share of it. ``s_abs`` is the
    robust spread (1.4826 x MAD) of the faster half's residuals in seconds, ``rho`` that of the slower half's
    residuals relative to their values; floors keep exact data (spread ~0) from flagging rounding noise.
    """
    idx = np.flatnonzero(ref)
    order = idx[np.argsort(y[idx])]
    fast, slow = order[: len(order) // 2], order[len(order) // 2:]
    s_abs = max(_mad_sigma(residual[fast]), OUTLIER_FLOOR_S)
    rho = max(_mad_sigma(residual[slow] / y[slow]), OUTLIER_FLOOR)
    return np.asarray(np.abs(residual - float(np.median(residual[idx]))) / np.maximum(s_abs, rho * y))


def _worst_outlier(columns: dict[str, np.ndarray], y: np.ndarray, keep: np.ndarray,
                   may_drop: Callable[[np.ndarray], bool]) -> int | None:
    """The kept point that sits furthest (beyond OUTLIER_MADS) from a fit of the others, in the others' noise
    scales; None if there is none that ``may_drop`` lets go.

    Leave-one-out on purpose: an outlier drags a fit that includes it towards itself and widens its
    neighbours' residuals, so it hides in its own fit's scatter (a chunk-boundary prompt sets the per-pass
    overhead almost alone; a stalled decode segment bends its batch's line).
    """
    worst: tuple[float, int] | None = None
    for i in np.flatnonzero(keep):
        others = keep.copy()
        others[i] = False
        if not may_drop(others):
            continue
        coef, _ = nonnegative_lstsq({n: c[others] for n, c in columns.items()}, y[others])
        fitted = sum((coef[n] * c for n, c in columns.items()), start=np.zeros_like(y))
        z = float(_z_scores(fitted - y, y, others)[i])
        if z > OUTLIER_MADS and (worst is None or z > worst[0]):
            worst = (z, int(i))
    return None if worst is None else worst[1]


def _robust_fit(columns: dict[str, np.ndarray], y: np.ndarray, may_drop: Callable[[np.ndarray], bool],
                ) -> tuple[dict[str, float], list[str], list[int], dict[str, float]]:
    """``nonnegative_lstsq`` after dropping outliers one at a time, worst first (``_worst_outlier``), while
    ``may_drop(keep)`` accepts the reduced set and the share dropped stays within OUTLIER_SHARE. Returns
    coefficients, clamped names, the dropped indices and the coefficients' standard errors (kept points)."""
    keep = np.ones(len(y), dtype=bool)
    budget = int(OUTLIER_SHARE * len(y))
    while int((~keep).sum()) < budget:
        worst = _worst_outlier(columns, y, keep, may_drop)
        if worst is None:
            break
        keep[worst] = False
    coef, clamped = nonnegative_lstsq({n: c[keep] for n, c in columns.items()}, y[keep])
    errors = standard_errors({n: c[keep] for n, c in columns.items()}, y[keep], coef)
    return coef, clamped, [int(i) for i in np.flatnonzero(~keep)], errors


def fit_prefill(samples: Sequence[PrefillSample], statistic: Statistic = "min") -> PrefillFit:
    """Fit ``c0 + o*k + a*n + b*n^2`` to each length's fastest (or median) repetition (``o + a*n + b*n^2`` when
    c0 cannot be told apart from o), leaving out outliers (see above)."""
    if len({s.tokens for s in samples}) < 3:
        raise ValueError("a prefill fit needs at least 3 different prompt lengths")
    n = np.array([s.tokens for s in samples], dtype=float)
    k = np.array([s.passes for s in samples], dtype=float)
    y = np.array([s.value_s(statistic) for s in samples])
    separate = can_separate_request_overhead(samples)
    columns = {"overhead": k, "per_token": n, "per_token2": n * n}
    if separate:
        columns = {"request": np.ones_like(n), **columns}

    def may_drop(keep: np.ndarray) -> bool:
        rest = [s for s, kept in zip(samples, keep, strict=True) if kept]
        return len({s.tokens for s in rest}) >= 4 and (not separate or can_separate_request_overhead(rest))

    coef, clamped, dropped, errors = _robust_fit(columns, y, may_drop)
    c0 = coef.get("request", 0.0)
    fitted = c0 + coef["overhead"] * k + coef["per_token"] * n + coef["per_token2"] * n * n
    return PrefillFit(overhead_s=coef["overhead"], s_per_token=coef["per_token"], s_per_token2=coef["per_token2"],
                      request_overhead_s=c0, separated_request_overhead=separate, clamped=clamped, outliers=dropped,
                      statistic=statistic, stats=_stats(y, fitted),
                      std_errors={"prefill_overhead_s": errors["overhead"], "prefill_s_per_token": errors["per_token"],
                                  "prefill_s_per_token2": errors["per_token2"],
                                  "request_overhead_s": errors.get("request", 0.0)})


def fit_decode(samples: Sequence[DecodeSample]) -> DecodeFit:
    """Fit ``d0 + d1*B + d2*ctx`` to the samples' step times, leaving out outliers (see above)."""
    batch = np.array([s.batch for s in samples], dtype=float)
    ctx = np.array([s.context_tokens for s in samples], dtype=float)
    if len(set(batch.tolist())) < 2 or len(samples) < 3:
        raise ValueError("a decode fit needs at least 3 samples over at least 2 batch sizes")
    y = np.array([s.step_s for s in samples])

    def may_drop(keep: np.ndarray) -> bool:
        return len(set(batch[keep].tolist())) >= 2 and int(keep.sum()) >= 4

    coef, clamped, dropped, errors = _robust_fit(
        {"overhead": np.ones_like(batch), "per_seq": batch, "per_context": ctx}, y, may_drop)
    fitted = coef["overhead"] + coef["per_seq"] * batch + coef["per_context"] * ctx
    return DecodeFit(overhead_s=coef["overhead"], s_per_seq=coef["per_seq"], s_per_context_token=coef["per_context"],
                     clamped=clamped, outliers=dropped, stats=_stats(y, fitted),
                     std_errors={"decode_overhead_s": errors["overhead"], "decode_s_per_seq": errors["per_seq"],
                                 "decode_s_per_context_token": errors["per_context"]})
