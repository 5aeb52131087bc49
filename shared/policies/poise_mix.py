"""The Poise mix: what the ``poise`` planner policy brings with it, declared once.

`poise up` and `poise run` (services/cli/stack.py), the compose file (kept in sync with `poise up`),
`make deploy` (services/deploy/render.py), the gateway's own defaults, the simulator's ``poise`` mix
(loadgen/sim/baselines.py) and the CLI help all read :data:`POISE_MIX`, so the live stack runs the mix the
simulator and the reports model. A field an operator sets wins; the mix fills only what is left unset.

Why each rule is in it:

- Arrow's SLO-aware dispatch: it predicts each pair's TTFT and TPOT and sends a request where both hold.
- FlowPrefill inside the engines, giving up the fewest prompts when a burst outruns the engine, with operator
  preemption and no chunks (``POISE_PREFILL_POLICY``); colocated engines refuse prompts that waited out their
  TTFT target unstarted, which past capacity would otherwise be served late in the slack of others.
- Late binding: the gateway holds prompts and releases one to a prefill engine only when it has fewer than
  ``late_binding_depth`` unprefilled, because SGLang's decode side reserves a request's KV at dispatch.
- Early rejection: a request the decode side cannot start within its TTFT target is refused (429) at once.
- DOPD's local prefill: prompts up to ``local_prefill_max_tokens`` are prefilled on an engine_sim decode
  engine itself (SGLang's PD decode engines cannot prefill, so they never get them).
- A draining decode engine has its requests moved by recompute instead of waiting for its longest answer.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.policies.late_binding import DEFAULT_DEPTH
from shared.policies.local_prefill import DEFAULT_MAX_LOCAL_PREFILL_TOKENS
from shared.policies.migration_cost import MIGRATION_MECHANISMS
from shared.policies.prefill_order import PREEMPTION
from shared.policies.registry import (
    DECODE_BATCH_POLICIES,
    DISPATCH_POLICIES,
    POISE_LATE_BINDING_POLICY,
    POISE_PREFILL_POLICY,
    POOL_POLICIES,
    PREFILL_POLICIES,
    lookup,
)


class PoiseMix(msgspec.Struct, frozen=True, kw_only=True):
    """The policies and rules of the Poise mix (the field names are `poise up`'s settings of the same name)."""

    planner_policy: str = "poise"
    dispatch_policy: str = "arrow"
    prefill_policy: str = POISE_PREFILL_POLICY
    decode_policy: str = "continuous"
    preemption: str = "operator"
    chunked_prefill_size: int | None = -1  # -1: no chunks (operator preemption bounds a wait); None: the engines'
    give_up_late_prompts: bool = True
    late_binding: bool = True
    late_binding_policy: str = POISE_LATE_BINDING_POLICY
    late_binding_depth: int = DEFAULT_DEPTH
    early_rejection: bool = True
    local_prefill_max_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS
    drain_by_migration: bool = True
    migration_mechanism: str = "recompute"

    def __post_init__(self) -> None:
        lookup(POOL_POLICIES, self.planner_policy, "pool policy")
        lookup(DISPATCH_POLICIES, self.dispatch_policy, "dispatch policy")
        lookup(PREFILL_POLICIES, self.prefill_policy, "prefill policy")
        lookup(PREFILL_POLICIES, self.late_binding_policy, "late-binding policy")
        lookup(DECODE_BATCH_POLICIES, self.decode_policy, "decode batch policy")
        lookup(dict.fromkeys(PREEMPTION), self.preemption, "preemption")
        lookup(MIGRATION_MECHANISMS, self.migration_mechanism, "migration mechanism")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("chunked_prefill_size must be a token count, -1 (no chunks) or None (the engines')")
        if self.late_binding_depth < 1 or self.local_prefill_max_tokens < 0:
            raise ValueError("late_binding_depth must be >= 1 and local_prefill_max_tokens >= 0")

    def gateway_rules(self) -> dict[str, Any]:
        """The gateway's share (services/gateway/config.py field names): what a gateway started for the poise
        planner runs besides its dispatch policy."""
        return {"early_rejection": self.early_rejection, "late_binding": self.late_binding,
                "late_binding_policy": self.late_binding_policy}

    def engine_rules(self) -> dict[str, Any]:
        """The engines' share (engine_sim's scheduling; SGLang engines run their own)."""
        return {"prefill_policy": self.prefill_policy, "preemption": self.preemption,
                "chunked_prefill_size": self.chunked_prefill_size, "give_up_late_prompts": self.give_up_late_prompts}

    def stack_defaults(self) -> dict[str, Any]:
        """What `poise up --planner-policy poise` fills in for every field left unset."""
        return {"dispatch_policy": self.dispatch_policy, **self.engine_rules(), **self.gateway_rules()}

    def describe(self) -> str:
        """One line for the CLI help and the reports."""
        return (f"--dispatch-policy {self.dispatch_policy}, --prefill-policy {self.prefill_policy}, "
                f"--preemption {self.preemption}, --chunked-prefill-size {self.chunked_prefill_size}, "
                f"{'--give-up-late-prompts, ' if self.give_up_late_prompts else ''}"
                f"{'--early-rejection, ' if self.early_rejection else ''}"
                f"{'--late-binding' if self.late_binding else '--no-late-binding'} with --late-binding-policy "
                f"{self.late_binding_policy} (depth {self.late_binding_depth}), local prefill of prompts up to "
                f"{self.local_prefill_max_tokens} tokens on engine_sim decode engines, and decode drains by "
                f"{self.migration_mechanism if self.drain_by_migration else 'waiting'}")


POISE_MIX = PoiseMix()

#: The Poise mix as it runs on stock SGLang 0.5.23 engines: the controller and the gateway's rules (Arrow's
#: dispatch, late binding, early rejection, drains by recompute), and inside the engines SGLang's own
#: scheduling (first come first served, chunked prefill at the engines' size, no give-up), with no prefill on
#: PD decode engines, which SGLang's cannot do. What `poise up --engines sglang-cpu` and `make deploy` run.
POISE_ON_SGLANG = PoiseMix(prefill_policy="fcfs", preemption="chunk", chunked_prefill_size=None,
                           give_up_late_prompts=False, local_prefill_max_tokens=0)
