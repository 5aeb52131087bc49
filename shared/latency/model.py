"""The latency model shared by engine_sim and the simulator.

Pure arithmetic over a :class:`LatencyProfile`; no I/O except :func:`load_profile`. Shapes come from the
papers (see ../shared/spec, Part C of spec-arrow-dopd.md and section 4 of spec-ares-kairos-flowprefill.md):

- prefill of ``n`` new tokens after ``c`` cached/earlier-chunk tokens:
  ``overhead + a*n + b*((c+n)^2 - c^2)``  (quadratic in the full length, split exactly across chunks)
- decode step: ``overhead + per_seq*batch + per_ctx*sum(context tokens)``, replayed from a CUDA graph up to the
  profile's largest captured batch and dearer (eager) past it
- KV transfer: ``overhead + tokens * kv_bytes_per_token / bandwidth``
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

import msgspec

from shared.errors import ConfigError

PROFILES_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = "llama-3.1-8b-h100"


class LatencyProfile(msgspec.Struct, frozen=True, kw_only=True):
    """Coefficients for one (model, GPU, TP). Units are in the names; see the JSON files' provenance."""

    name: str
    model: str
    gpu: str
    tp: int = 1
    prefill_overhead_s: float
    prefill_s_per_token: float
    prefill_s_per_token2: float
    decode_overhead_s: float
    decode_s_per_seq: float
    decode_s_per_context_token: float
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    max_running_requests: int
    chunked_prefill_size: int = 8192
    transfer_overhead_s: float = 0.002
    transfer_bytes_per_s: float = 25e9
    role_switch_s: float = 1.0
    # SGLang replays a decode step from a captured CUDA graph only up to its largest captured batch
    # (``cuda_graph_max_bs``: 256 on an 80-140 GB GPU at TP < 4); a larger batch runs eagerly, which costs
    # ``max(eager_decode_factor x the graphed step, eager_decode_floor_s)``: kernel launches the graph saves
    # either stretch a GPU-bound step a little or, for a small one, set its length. None: every step graphed.
    cuda_graph_max_batch: int | None = None
    eager_decode_factor: float = 1.0
    eager_decode_floor_s: float = 0.0
    # Operator boundaries, where an operator-level preemptible prefill (FlowPrefill) can stop: the dense
    # decoder layer's qkv_proj, attn, o_proj, gate_up_proj and down_proj, times the model's layers.
    num_layers: int = 32
    operators_per_layer: int = 5
    # Relative cost of the layer's four matrix products (qkv_proj, o_proj, gate_up_proj, down_proj): their
    # weight sizes, here Llama-3.1-8B's output widths 6144, 4096, 28672 and 4096 x 14336 / 4096 = 14336.
    # The pass's linear work and its per-pass floor (reading the weights) split in these shares; attention
    # takes the quadratic work. On an H100 the longest operator of a 2K-32K-token pass came out 1.1-1.4x the
    # measured one (conservative), where equal operators gave 0.5-0.65x (tests/bench/results/gpu/latency_check.md).
    operator_weights: list[float] = msgspec.field(default_factory=lambda: [6144.0, 4096.0, 28672.0, 14336.0])
    provenance: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        numbers = {f: getattr(self, f) for f in self.__struct_fields__
                   if f not in ("name", "model", "gpu", "provenance", "operator_weights", "cuda_graph_max_batch")}
        negative = [f for f, v in numbers.items() if v < 0]
        if negative:
            raise ConfigError(f"latency profile {self.name!r}: negative values for {', '.join(negative)}")
        for f in ("kv_bytes_per_token", "kv_capacity_tokens", "max_running_requests", "chunked_prefill_size", "tp",
                  "num_layers", "operators_per_layer"):
            if numbers[f] <= 0:
                raise ConfigError(f"latency profile {self.name!r}: {f} must be positive")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch <= 0:
            raise ConfigError(f"latency profile {self.name!r}: cuda_graph_max_batch must be positive (or null)")
        if self.eager_decode_factor < 1.0:
            raise ConfigError(f"latency profile {self.name!r}: eager_decode_factor must be >= 1 (an eager step is "
                              f"never faster than a graphed one), got {self.eager_decode_factor}")
        if self.transfer_bytes_per_s <= 0:
            raise ConfigError(f"latency profile {self.name!r}: transfer_bytes_per_s must be positive")
        if len(self.operator_weights) != self.operators_per_layer - 1 or min(self.operator_weights) <= 0:
            raise ConfigError(f"latency profile {self.name!r}: operator_weights needs {self.operators_per_layer - 1} "
                              "positive weights (the layer's matrix products; attention is the other operator)")


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> LatencyProfile:
    """Load a built-in profile by name, or any profile JSON file by path."""
    path = Path(name_or_path)
    builtin = PROFILES_DIR / f"{name_or_path}.json"
    if path.suffix != ".json" and builtin.is_file():
        path = builtin
    if not path.is_file():
        raise ConfigError(
            f"latency profile {str(name_or_path)!r} not found (built-in: {', '.join(available_profiles())}; "
            "or give a path to a .json file)"
        )
    try:
        return msgspec.json.decode(path.read_bytes(), type=LatencyProfile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"latency profile {path}: {exc}") from exc


def save_profile(profile: LatencyProfile, path: Path) -> None:
    path.write_text(json.dumps(msgspec.to_builtins(profile), indent=2) + "\n")


class LatencyModel:
    """Times for engine work under one profile.

    ``time_scale`` multiplies every result: 1.0 is the profiled GPU, 0.0 makes compute free (used to
    measure the control plane's own overhead).
    """

    def __init__(self, profile: LatencyProfile, time_scale: float = 1.0) -> None:
        if time_scale < 0:
            raise ConfigError(f"time_scale must be >= 0, got {time_scale}")
        self.profile = profile
        self.time_scale = time_scale
        # One prefill pass's launch overhead, time-scaled (the profile is frozen): read once per queued prompt
        # by the prefill policies' rankings.
        self.pass_overhead_s = profile.prefill_overhead_s * time_scale
        self._graph_max_batch = profile.cuda_graph_max_batch or sys.maxsize

    # -- prefill -----------------------------------------------------------------------------------
    def prefill_work_s(self, new_tokens: int, done_tokens: int = 0) -> float:
        """Compute for ``new_tokens`` after ``done_tokens`` of the same sequence, without launch overhead."""
        p = self.profile
        end = done_tokens + new_tokens
        work = p.prefill_s_per_token * new_tokens + p.prefill_s_per_token2 * (end * end - done_tokens * done_tokens)
        return work * self.time_scale

    def prefill_tokens_done(self, new_tokens: int, done_tokens: int, fraction: float) -> int:
        """Tokens of a ``new_tokens`` part whose work is ``fraction`` of the part's: how much of a prompt an
        operator-level cut keeps (every layer processed the same share of its work; attention makes later
        tokens dearer, so this is a little more than ``fraction * new_tokens``)."""
        if fraction >= 1.0:
            return new_tokens
        if fraction <= 0.0 or new_tokens <= 0:
            return 0
        p = self.profile
        target = fraction * (p.prefill_s_per_token * new_tokens + p.prefill_s_per_token2 * (
            (done_tokens + new_tokens) ** 2 - done_tokens**2))
        a, b = p.prefill_s_per_token2, p.prefill_s_per_token + 2 * p.prefill_s_per_token2 * done_tokens
        k = target / b if a == 0 else (-b + (b * b + 4 * a * target) ** 0.5) / (2 * a)
        return max(0, min(new_tokens, int(k)))

    def prefill_time_s(self, new_tokens: int, done_tokens: int = 0) -> float:
        """One prefill (or one chunk) run alone in a forward pass."""
        if new_tokens <= 0:
            return 0.0
        return self.pass_overhead_s + self.prefill_work_s(new_tokens, done_tokens)

    def prefill_batch_time_s(self, parts: Iterable[tuple[int, int]]) -> float:
        """A forward pass over several (new_tokens, done_tokens) parts: one launch overhead, summed work."""
        work = 0.0  # added part by part in order (FlowPrefill's batching keeps the same running total)
        for n, d in parts:
            if n > 0:
                work += self.prefill_work_s(n, d)
        return self.prefill_pass_s(work)

    def prefill_pass_s(self, work: float) -> float:
        """A prefill pass whose parts' summed work (:meth:`prefill_work_s`) is ``work``: one launch overhead
        on top, none for an empty pass."""
        if work == 0.0 and self.time_scale > 0:
            return 0.0
        return self.pass_overhead_s + work

    def attention_share(self, parts: Iterable[tuple[int, int]]) -> float:
        """The share of a prefill pass over (new_tokens, done_tokens) parts that is attention (the quadratic
        work); the rest, the linear work and the per-pass floor, is the matrix products."""
        p = self.profile
        parts = list(parts)
        quad = sum(p.prefill_s_per_token2 * ((d + n) ** 2 - d * d) for n, d in parts if n > 0)
        total = p.prefill_overhead_s + sum(p.prefill_s_per_token * n for n, _ in parts if n > 0) + quad
        return quad / total if total > 0 else 0.0

    def operator_boundary_s(self, start_s: float, now_s: float, duration_s: float,
                            attention_share: float | None = None) -> float:
        """The first operator boundary at or after ``now_s`` of a forward pass that runs from ``start_s`` for
        ``duration_s``: where a cooperative operator-level preemption (FlowPrefill) takes effect.

        Every layer takes the same time. Within a layer, with ``attention_share`` (see :meth:`attention_share`)
        attention gets that share and the matrix products split the rest by ``operator_weights``, in the
        layer's order (qkv_proj, attn, o_proj, gate_up_proj, down_proj); without it the operators are equal.
        The blocking time is at most one operator: on the default profile about 4.6 ms for an 8K prompt
        (gate_up_proj; measured on an H100: 3.2 ms) and 18 ms for 32K (measured: 16 ms). FlowPrefill's
        < 4.5 ms holds for passes up to about 8K tokens.
        """
        if duration_s <= 0 or now_s <= start_s:
            return max(start_s, now_s)
        p = self.profile
        layer_s = duration_s / p.num_layers
        layer = int((now_s - start_s) // layer_s)
        if layer >= p.num_layers:
            return start_s + duration_s
        offset = now_s - start_s - layer * layer_s
        end = 0.0
        boundary = start_s + (layer + 1) * layer_s
        for d in self.operator_durations_s(layer_s, attention_share):
            end += d
            if end >= offset - 1e-12:
                boundary = start_s + layer * layer_s + end
                break
        # Summed durations round: a last boundary a hair before the pass's end is its end (no cut there), and a
        # boundary a hair before now is now (a cut is never scheduled in the past).
        end_s = start_s + duration_s
        return max(end_s if boundary >= end_s - 1e-9 else boundary, now_s)

    def operator_durations_s(self, layer_s: float, attention_share: float | None = None) -> list[float]:
        """How one layer of ``layer_s`` splits into its operators, in order (see :meth:`operator_boundary_s`)."""
        p = self.profile
        if attention_share is None:
            return [layer_s / p.operators_per_layer] * p.operators_per_layer
        share = min(max(attention_share, 0.0), 1.0)
        weights = p.operator_weights
        linear = [(1.0 - share) * layer_s * w / sum(weights) for w in weights]
        return [linear[0], share * layer_s, *linear[1:]]  # attention follows qkv_proj

    # -- decode ------------------------------------------------------------------------------------
    def decode_step_time_s(self, batch_size: int, context_tokens: int) -> float:
        """One decode iteration over ``batch_size`` sequences holding ``context_tokens`` in total (eager past
        the profile's largest CUDA-graph batch)."""
        if batch_size <= 0:
            return 0.0
        p = self.profile
        t = p.decode_overhead_s + p.decode_s_per_seq * batch_size + p.decode_s_per_context_token * context_tokens
        if batch_size > self._graph_max_batch:
            t = max(t * p.eager_decode_factor, p.eager_decode_floor_s)
        return t * self.time_scale

    def mixed_step_time_s(self, batch_size: int, context_tokens: int, prefill_parts: Iterable[tuple[int, int]]) -> float:
        """A colocated step: the decode batch plus prefill chunks in one forward pass (SGLang mixed chunk).

        The decode step already pays the launch overhead, so prefill parts add only their work.
        """
        parts = list(prefill_parts)
        if batch_size <= 0:
            return self.prefill_batch_time_s(parts)
        return self.decode_step_time_s(batch_size, context_tokens) + sum(self.prefill_work_s(n, d) for n, d in parts)

    # -- transfer ----------------------------------------------------------------------------------
    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.profile.kv_bytes_per_token

    def kv_transfer_time_s(self, tokens: int) -> float:
        p = self.profile
        return (p.transfer_overhead_s + self.kv_bytes(tokens) / p.transfer_bytes_per_s) * self.time_scale

    def migration_transfer_time_s(self, tokens: int, gbps: float) -> float:
        """A decode→decode KV copy of ``tokens`` over a ``gbps`` link (ARES' migration; its simulator: 25 Gbps)."""
        return (self.profile.transfer_overhead_s + self.kv_bytes(tokens) * 8 / (gbps * 1e9)) * self.time_scale

    def role_switch_time_s(self) -> float:
        return self.profile.role_switch_s * self.time_scale
