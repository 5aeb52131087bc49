"""One-step load forecasting for the PD manager: ARIMA on a sliding window plus DOPD's correction factor.

DOPD (spec B7.2) forecasts the next interval's mean ISL, mean OSL and concurrency with ARIMA and
calibrates each forecast by f = previous forecast / observed, as ``x_cal = x_hat / f``. Dynamo's planner
does the forecasting with ``pmdarima.auto_arima`` on the last 50 samples and returns the last value below
5 samples; this module does the same with statsmodels and a small, fixed order grid, so that one
interval's decision stays cheap enough for a planner tick (tests/bench/forecast_latency.py).

Pure computation: no clock other than timing the fit, no I/O, no asyncio. The live planner runs it in a
thread executor, the simulator calls it inline.

Caller contract:

- Feed one observation per interval. Feed ``nan`` for a value that is undefined in that interval (the mean
  ISL of an interval in which nothing completed): it is skipped, not turned into 0 as Dynamo does, because
  a 0 in a mean-length series is a fake dip that ARIMA would then forecast. An idle interval's concurrency
  or rate is a real 0 and should be fed as 0.
- An instance is not thread-safe: use one forecaster per thread (or serialise calls). Two process-wide
  settings change for the duration of a fit: the warning filters (``warnings.catch_warnings`` is not
  thread-local before Python 3.14), so a warning raised by another thread then may be hidden; and the BLAS
  thread pools (threadpoolctl, limited to 1), so another thread's numpy linear algebra then runs on one
  thread.
- Same observations in the same order give the same forecasts; only ``Forecast.fit_s`` varies.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, NamedTuple

import msgspec
import numpy as np

from shared.errors import ConfigError

Order = tuple[int, int, int]
Method = Literal["arima", "last-value", "constant", "empty"]


class ForecastParams(msgspec.Struct, frozen=True, kw_only=True):
    """Tunables of one series' forecaster.

    window: observations kept (sliding); Dynamo's SLA planner uses 50.
    min_samples: below this many observations the forecast is the last value (Dynamo: 5).
    orders: the (p, d, q) candidates. A model with d = 0 gets a constant, one with d = 1 a drift (as
        auto_arima's default), one with d >= 2 neither. Kept small because every candidate costs one
        likelihood fit at each order selection.
    min_obs_per_param: a candidate takes part in a selection only when its differenced window holds this
        many observations per estimated coefficient (p + q + the constant or drift). Fits with fewer are
        noise, and they are the slow ones: the optimiser wanders along the stationarity boundary.
    reselect_every: run the order selection over ``orders`` every this many accepted observations; in
        between only the chosen order is refitted. 1 selects at every forecast (auto_arima behaviour).
    fit_ftol: the likelihood optimiser (L-BFGS) stops when an iteration improves it by less than this
        fraction. scipy's default (2.2e-9) doubles the fit time; at 2.2e-6 the one-step forecasts of the Azure
        series move by under 2% (mostly far less) against a one-step error of 10-20%.
    correction_min, correction_max: clamp of the correction factor f (0.5 and 2 are our choice, spec B7.2).
    correction_smoothing: weight of the newest ratio in f, an exponential average of the clamped ratios
        previous forecast / observed. 1.0 is the paper's f (the last ratio alone); on the Azure traces that
        adds one interval's noise to every calibrated forecast and scores worse than the raw forecast, while
        0.1-0.3 scores slightly better (tests/bench/results/forecast_latency.md).
    nonnegative: clip forecasts at 0 (lengths, rates and concurrency cannot be negative).
    """

    window: int = 50
    min_samples: int = 5
    orders: tuple[Order, ...] = ((1, 0, 0), (2, 0, 0), (0, 1, 1), (1, 1, 0))
    min_obs_per_param: int = 3
    reselect_every: int = 10
    fit_ftol: float = 2.2e-6
    correction_min: float = 0.5
    correction_max: float = 2.0
    correction_smoothing: float = 1.0
    nonnegative: bool = True

    def __post_init__(self) -> None:
        if self.min_samples < 1:
            raise ConfigError(f"min_samples must be >= 1, got {self.min_samples}")
        if self.window < self.min_samples:
            raise ConfigError(f"window ({self.window}) must be >= min_samples ({self.min_samples})")
        if not self.orders:
            raise ConfigError("orders must name at least one (p, d, q)")
        for order in self.orders:
            if len(order) != 3 or any(int(k) != k or k < 0 for k in order):
                raise ConfigError(f"orders: {order!r} is not a (p, d, q) of non-negative ints")
        if self.min_obs_per_param < 1:
            raise ConfigError(f"min_obs_per_param must be >= 1, got {self.min_obs_per_param}")
        if self.reselect_every < 1:
            raise ConfigError(f"reselect_every must be >= 1, got {self.reselect_every}")
        if not 0 < self.fit_ftol < 1:
            raise ConfigError(f"fit_ftol must be in (0, 1), got {self.fit_ftol}")
        if not 0 < self.correction_min <= 1.0 <= self.correction_max:
            raise ConfigError(
                f"need 0 < correction_min <= 1 <= correction_max, got {self.correction_min}, {self.correction_max}"
            )
        if not 0 < self.correction_smoothing <= 1:
            raise ConfigError(f"correction_smoothing must be in (0, 1], got {self.correction_smoothing}")


class Forecast(msgspec.Struct, frozen=True):
    """One one-step-ahead forecast.

    raw: the model's forecast (clipped at 0 when ``nonnegative``); what the next correction compares.
    calibrated: ``raw / correction``, the value a planner should use.
    order: the ARIMA order that produced ``raw``; None unless method is "arima".
    method: "arima"; "last-value" (too few samples, or the fit failed: see ``detail``); "constant" (the
        window holds one value, which the likelihood cannot fit); "empty" (no observation yet: raw is 0).
    fit_s: seconds spent fitting (order selection included), 0 when nothing was fitted.
    correction: the factor f in use, already clamped.
    detail: why a fallback was taken, else "".
    """

    raw: float
    calibrated: float
    order: Order | None
    method: Method
    fit_s: float
    correction: float
    detail: str = ""


def _trend_for(d: int) -> str:
    # statsmodels' ARIMA names a drift under differencing "t" (a linear trend in levels).
    return "c" if d == 0 else "t" if d == 1 else "n"


class _Fit(NamedTuple):
    next_value: Callable[[], float]  # the one-step forecast, computed on demand: a selection needs the winner's
    criterion: float
    params: np.ndarray


@functools.cache
def _backend() -> tuple[type, Any]:
    """statsmodels' ARIMA class and a BLAS thread-pool controller, loaded on first use.

    Lazily, because statsmodels pulls in scipy and pandas (about a second), and never inside
    warnings.catch_warnings: its import installs "always" filters that would override ours there. The
    controller is built after that import so it sees numpy's and scipy's OpenBLAS.
    """
    from statsmodels.tsa.arima.model import ARIMA
    from threadpoolctl import ThreadpoolController

    return ARIMA, ThreadpoolController()


def preload() -> None:
    """Import statsmodels now (about a second) so the first forecast is not charged for it: a planner calls
    this on its decision thread at start."""
    _backend()


def _fit_one(values: np.ndarray, order: Order, burn: int, start: np.ndarray | None, ftol: float) -> _Fit:
    """Fit one order and return its one-step forecast, a comparable AIC and the fitted parameters.

    ``start`` (the parameters of this order's previous fit) warm-starts the optimiser: the window moved by
    one sample, so the optimum barely moved (a fifth less CPU on the Azure conversation series).

    The AIC uses the likelihood of observations ``burn`` onwards only: statsmodels drops the first d
    (diffuse) terms of a differenced model, so comparing raw AICs across d favours d = 1 by about one
    observation's worth of likelihood. Dropping the same leading terms from every candidate removes that.
    """
    model = _backend()[0](values, order=order, trend=_trend_for(order[1]))
    # scipy's L-BFGS stops when the objective's relative change is below factr * machine epsilon.
    factr = ftol / np.finfo(float).eps
    try:
        result = model.fit(start_params=start, method_kwargs={"factr": factr})
    except Exception:
        if start is None:
            raise
        # A stale start can be infeasible for the new window; a cold start is not.
        result = model.fit(method_kwargs={"factr": factr})
    llf = float(np.sum(result.llf_obs[burn:]))
    criterion = -2.0 * llf + 2.0 * len(result.params)
    return _Fit(next_value=lambda: float(result.forecast(1)[0]), criterion=criterion,
                params=np.asarray(result.params))


class _TooShort(Exception):
    """The window is too short for every candidate order: a planned fallback, not a failure."""


class ArimaForecaster:
    """One series: a sliding window, an ARIMA order chosen from a small grid, and the correction factor.

    ``reselect_phase`` (0 <= phase < reselect_every) brings this series' order selections forward by that
    many observations after the first one; `MultiForecaster` spreads its series over phases so that their
    costly selections fall in different intervals.
    """

    def __init__(self, params: ForecastParams | None = None, *, reselect_phase: int = 0) -> None:
        self.params = params or ForecastParams()
        if not 0 <= reselect_phase < self.params.reselect_every:
            raise ConfigError(f"reselect_phase must be in [0, {self.params.reselect_every}), got {reselect_phase}")
        self._phase = reselect_phase
        self._window: deque[float] = deque(maxlen=self.params.window)
        self._order: Order | None = None
        self._since_selection = 0
        self._selections = 0
        self._candidates = 0  # how many orders the window could fit at the last selection
        self._start: dict[Order, np.ndarray] = {}
        self._correction = 1.0
        self._accepted = 0  # observations taken into the window so far: identifies the window's contents
        # (accepted count, raw, order, method, detail) of the last forecast: an interval whose observation was
        # skipped leaves the window as it was, and refitting it would cost a fit for the same answer.
        self._cached: tuple[int, float, Order | None, Method, str] | None = None
        # The raw forecast not yet compared with an observation; consumed by the next observe() so that a
        # forecast is only ever compared with the interval it was made for.
        self._pending_raw: float | None = None
        self.skipped = 0
        # Order selection must compare every candidate on the same observations (see _fit_one).
        self._burn = max(order[1] for order in self.params.orders)

    @property
    def window(self) -> tuple[float, ...]:
        return tuple(self._window)

    @property
    def correction(self) -> float:
        return self._correction

    @property
    def order(self) -> Order | None:
        """The order chosen at the last selection (None before the first, or after a failed fit)."""
        return self._order

    @property
    def selections(self) -> int:
        """How many order selections have run (each costs one fit per candidate order)."""
        return self._selections

    def observe(self, value: float) -> None:
        """Add this interval's observation; non-finite values are counted in ``skipped`` and ignored."""
        raw_prev, self._pending_raw = self._pending_raw, None
        value = float(value)
        if not math.isfinite(value):
            self.skipped += 1
            return
        if raw_prev is not None and value > 0:
            p = self.params
            # Each ratio is clamped before it is averaged, so one interval with a near-zero observation moves
            # f by at most the clamp. Written so that smoothing 1 gives exactly the newest ratio, and clamped
            # again after averaging only against rounding.
            ratio = min(p.correction_max, max(p.correction_min, raw_prev / value))
            a = p.correction_smoothing
            f = (1.0 - a) * self._correction + a * ratio
            self._correction = min(p.correction_max, max(p.correction_min, f))
        self._window.append(value)
        self._accepted += 1
        self._since_selection += 1

    def forecast(self) -> Forecast:
        """The next interval's value, from the current window (fit_s is 0 when the window did not change)."""
        if self._cached is not None and self._cached[0] == self._accepted:
            _, raw, order, method, detail = self._cached
            fit_s = 0.0
        else:
            raw, order, method, fit_s, detail = self._raw_forecast()
            self._cached = (self._accepted, raw, order, method, detail)
        if self.params.nonnegative:
            raw = max(0.0, raw)
        self._pending_raw = raw if method != "empty" else None
        return Forecast(raw=raw, calibrated=raw / self._correction, order=order, method=method, fit_s=fit_s,
                        correction=self._correction, detail=detail)

    def _raw_forecast(self) -> tuple[float, Order | None, Method, float, str]:
        if not self._window:
            return 0.0, None, "empty", 0.0, "no observation yet"
        last = self._window[-1]
        if len(self._window) < self.params.min_samples:
            return last, None, "last-value", 0.0, f"{len(self._window)} < {self.params.min_samples} samples"
        values = np.fromiter(self._window, dtype=float, count=len(self._window))
        if float(np.ptp(values)) <= 1e-9 * max(1.0, abs(last)):
            return last, None, "constant", 0.0, ""
        blas = _backend()[1]
        start = time.perf_counter()
        try:
            # One BLAS thread: the Kalman filter's matrices are a few states wide, and OpenBLAS waking its
            # pool for them doubled the CPU and gave 0.1-0.5 s tails per fit on a busy 2-core machine
            # (tests/bench/forecast_latency.py). The limit is process-wide while it lasts.
            with blas.limit(limits=1, user_api="blas"), warnings.catch_warnings():
                # statsmodels warns on most short-window fits (convergence, non-stationary start params);
                # the result is checked below instead, and the filters are restored on exit.
                warnings.simplefilter("ignore")
                order, value = self._fit(values)
        except _TooShort as exc:
            return last, None, "last-value", 0.0, str(exc)
        except Exception as exc:  # noqa: BLE001 - any fit failure means "fall back", never "crash the planner"
            self._order = None  # an order that failed is not trusted: select afresh next time
            return last, None, "last-value", time.perf_counter() - start, f"fit failed: {type(exc).__name__}: {exc}"
        fit_s = time.perf_counter() - start
        if not math.isfinite(value):
            self._order = None
            return last, None, "last-value", fit_s, "fit produced a non-finite forecast"
        return value, order, "arima", fit_s, ""

    def _fit(self, values: np.ndarray) -> tuple[Order, float]:
        candidates = [o for o in self.params.orders if self._fits_window(o, len(values))]
        # While the window fills, more orders become fittable: select again as soon as one does, so the
        # first selection with few samples does not lock the series into AR(1) for reselect_every intervals.
        grown = len(candidates) > self._candidates
        if self._order is not None and self._since_selection < self.params.reselect_every and not grown:
            return self._order, self._fit_order(values, self._order).next_value()
        if not candidates:
            raise _TooShort(f"{len(values)} samples are too few for every order at {self.params.min_obs_per_param} "
                            "per coefficient")
        best: tuple[Order, _Fit] | None = None
        errors: list[str] = []
        for order in candidates:
            try:
                fit = self._fit_order(values, order)
            except Exception as exc:  # noqa: BLE001 - one bad candidate must not sink the others
                errors.append(f"{order}: {type(exc).__name__}")
                continue
            # Strict < keeps the earlier candidate on a tie, so the grid's order is the tie-break.
            if math.isfinite(fit.criterion) and (best is None or fit.criterion < best[1].criterion):
                best = (order, fit)
        if best is None:
            raise RuntimeError("no candidate order could be fitted" + (f" ({'; '.join(errors)})" if errors else ""))
        value = best[1].next_value()  # a non-finite one is caught by the caller, which then selects again
        self._order = best[0]
        # Warm-up selections (the window still growing) keep the phase, so that a MultiForecaster's series
        # stay staggered once the periodic selections start.
        self._since_selection = self._phase if grown else 0
        self._candidates = len(candidates)
        self._selections += 1
        return best[0], value

    def _fits_window(self, order: Order, n: int) -> bool:
        p, d, q = order
        return n - d >= self.params.min_obs_per_param * (p + q + (1 if d <= 1 else 0))

    def _fit_order(self, values: np.ndarray, order: Order) -> _Fit:
        try:
            fit = _fit_one(values, order, self._burn, self._start.get(order), self.params.fit_ftol)
        except Exception:
            self._start.pop(order, None)
            raise
        self._start[order] = fit.params
        return fit


class MultiForecaster:
    """One `ArimaForecaster` per named series (e.g. "isl", "osl", "concurrency", "rate").

    ``params`` is one `ForecastParams` for every series, or a mapping from name to params (series not in it
    get the defaults). The series' order selections are staggered over the reselection period.
    """

    def __init__(self, names: Iterable[str], params: ForecastParams | Mapping[str, ForecastParams] | None = None):
        names = list(names)
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"series names must be non-empty and distinct, got {names}")
        if isinstance(params, Mapping):
            unknown = set(params) - set(names)
            if unknown:
                raise ConfigError(f"params given for unknown series {sorted(unknown)}")
            per_series = {n: params.get(n) or ForecastParams() for n in names}
        else:
            per_series = {n: params or ForecastParams() for n in names}
        # Spread the series over reselection phases: selecting all of them in the same interval would put
        # every candidate fit of every series into one decision, the p99 the planner has to budget for.
        self._series = {
            n: ArimaForecaster(p, reselect_phase=(i * p.reselect_every) // len(names))
            for i, (n, p) in enumerate(per_series.items())
        }

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._series)

    def __getitem__(self, name: str) -> ArimaForecaster:
        return self._series[name]

    def observe(self, values: Mapping[str, float]) -> None:
        """One interval's observations; a series missing from ``values`` is treated as missing (nan)."""
        unknown = set(values) - set(self._series)
        if unknown:
            # A typo'd name would otherwise silently starve its series.
            raise KeyError(f"unknown series {sorted(unknown)}; known: {list(self._series)}")
        for name, forecaster in self._series.items():
            forecaster.observe(values.get(name, math.nan))

    def forecast(self) -> dict[str, Forecast]:
        return {name: forecaster.forecast() for name, forecaster in self._series.items()}
