"""The dev stack as plain processes: nats-server, etcd, monitor, planner, migrator, gateway, and one worker
sidecar per engine (each worker spawns its engine_sim). The same commands run in docker-compose.

Processes start in dependency order and stop in reverse: workers first (they deregister, then stop their
engines), then the gateway and the control plane, then etcd and NATS. Every process logs to
``<run dir>/logs/<name>.log``. A ``stack.json`` in the run dir (and ``.poise/current.json``) tells
``poise admin`` and ``poise bench`` where the stack is.

With ``auth`` (the default) every process runs as its own NATS user (permissions: shared/protocol/permissions.py),
etcd's auth is on and the gateway wants an API key; the credentials are made per run (``credentials.json`` in
the run dir, mode 0600) and each process gets only its own, in its environment (docs/security.md).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import Field, ValidationInfo, field_validator, model_validator

from loadgen.slo import slo_for
from services.cli.stack_lock import StackLock, check_ports_free
from services.cli.supervise import retired
from services.worker.presets import SGLANG_CPU_MODEL, SGLANG_CPU_PROFILE, SGLANG_CPU_SLO_S
from shared.devservers import EtcdServer, ManagedProcess, NatsServer, free_port
from shared.errors import PoiseError
from shared.latency import DEFAULT_PROFILE, load_profile
from shared.policies.poise_mix import POISE_MIX
from shared.protocol import Keys, Subjects
from shared.protocol.permissions import user_permissions, worker_user
from shared.security import Credentials, EtcdAuth, NatsUser
from shared.settings import ServiceSettings, fill_unset, settings_config

STATE_DIR = Path(".poise")
SIM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the default latency profile's model, which engine_sim emulates
DEFAULT_SLO_TRACE = "azure-conv"  # Arrow Table 1's Azure conversation SLO (2 s TTFT, 0.15 s TPOT): `poise up`'s default
ENV_PREFIX = {"services.monitor": "POISE_MONITOR_", "services.planner": "POISE_PLANNER_",
              "services.migrator": "POISE_MIGRATOR_", "services.gateway": "POISE_GATEWAY_",
              "services.worker": "POISE_WORKER_"}
ENGINE_KEY_HOLDERS = ("services.gateway", "services.worker")  # the processes that call the engines' HTTP APIs
ROLE_PREFIX = {"prefill": "p", "decode": "d", "null": "c"}  # instance ids: p0, d1, c0 (as the local connector's)
DEFAULT_DISPATCH_POLICY = "least-load"  # with every planner policy but poise
DEFAULT_PLANNER_POLICY = "poise"  # the P:D controller (shared/policies/poise.py); --planner-policy static turns it off


CPU_ENGINE_PROBE_TIMEOUT_S = 60.0  # above the longest prefill pass of a CPU engine (max_prefill_tokens, one core)


def one_core_each(n: int, cores: int) -> dict[str, str]:
    """The environment that keeps SGLang CPU engine ``n`` on one core (round robin over ``cores``).

    SGLANG_CPU_OMP_THREADS_BIND pins an engine's OpenMP threads, but SGLang applies it only with its AMX or arm64
    kernels; elsewhere (an AVX-512 CPU without AMX) it is ignored and torch starts one thread per core in every
    engine, so two engines on two cores spin against each other: a 1024-token prefill took 5.8-7 s in a PD pair,
    2.6-2.8 s with one thread each. One OpenMP thread per engine holds on both kinds of CPU.
    """
    return {"SGLANG_CPU_OMP_THREADS_BIND": str(n % cores), "OMP_NUM_THREADS": "1"}


class StackSettings(ServiceSettings):
    """The local dev stack that ``poise up`` and ``poise run`` bring up."""

    model_config = settings_config("POISE_STACK_")

    engines: Literal["sim", "sglang-cpu"] = Field("sim", description="What the workers run: sim = engine_sim (the latency profile's GPU, in real time); sglang-cpu = real SGLang 0.5.23 on this CPU with SmolLM2-135M-Instruct (the worker's sglang-cpu preset; make sglang-setup installs it), one core per engine. SGLang engines run SGLang's own scheduling: the engine_sim scheduling fields below do not reach them.")
    prefill: int = Field(2, description="Number of prefill engines (engine_sim + worker sidecar each).")
    decode: int = Field(2, description="Number of decode engines.")
    colocated: int = Field(0, description="Number of colocated (SGLang disaggregation mode null) engines.")
    profile: str = Field(None, validate_default=False, description="Latency profile of the engines (name or JSON path): engine_sim runs it, the planner and gateway policies plan with it; unset = llama-3.1-8b-h100 (engine_sim) or smollm2-135m-cpu (sglang-cpu: fitted to the preset's engines on one core).")  # type: ignore[assignment]  # always set by _engines_imply
    model: str = Field(None, validate_default=False, description="Served model name; unset = meta-llama/Llama-3.1-8B-Instruct (engine_sim's profile model) or SmolLM2-135M-Instruct (sglang-cpu).")  # type: ignore[assignment]  # always set by _engines_imply
    time_scale: float = Field(1.0, description="engine_sim compute time multiplier (0 = free compute).")
    seed: int = Field(0, description="Seed of the simulated engines (token ids, stop lengths).")
    namespace: str = Field("default", description="Poise namespace of this stack.")
    host: str = Field("127.0.0.1", description="Address every process binds to.")
    gateway_port: int = Field(8000, description="Gateway HTTP port (0 = a free port).")
    monitor_port: int = Field(9100, description="Monitor /metrics port (0 = a free port).")
    nats_port: int = Field(0, description="nats-server port (0 = a free port).")
    etcd_port: int = Field(0, description="etcd client port (0 = a free port).")
    state_dir: Path = Field(STATE_DIR, description="Where current.json and the stack lock live: one running stack per state dir. `poise admin` and `poise bench` read ./.poise/current.json; for a stack in another state dir give them --nats-url / --gateway-url and its credentials.")
    run_dir: Path | None = Field(None, description="Where logs and stack.json go (default <state dir>/runs/<timestamp>).")
    gateway_args: list[str] = Field(default_factory=list, description="Extra flags for the gateway (JSON list).")
    planner_args: list[str] = Field(default_factory=list, description="Extra flags for the planner (JSON list), e.g. [\"--tick-interval-s\", \"1\"].")
    ready_timeout_s: float = Field(None, validate_default=False, description="How long to wait for every engine to register; unset = 60 s with engine_sim, 900 s with sglang-cpu (an SGLang engine takes 30-180 s to start on a CPU, longer on a busy one).")  # type: ignore[assignment]  # always set by _engines_imply
    planner_policy: str = Field(DEFAULT_PLANNER_POLICY, description="The planner's pool policy: poise (the P:D controller: scores every split on the served mix, flips one instance at a time towards a clearly better one), static (roles never change), arrow or dopd. poise also brings the rest of the Poise mix (shared/policies/poise_mix.py, the simulator's poise mix), each part unless given: " + POISE_MIX.describe() + ".")
    dispatch_policy: str = Field(None, validate_default=False, description="The gateway's dispatch policy: least-load, round-robin, arrow or cache-aware (SMG's); unset = arrow with --planner-policy poise, least-load with the others.")  # type: ignore[assignment]  # always set by _planner_policy_implies
    slo_ttft_s: float | None = Field(None, gt=0.0, description="TTFT SLO (s) the planner and gateway policies plan for (and poise run judges by); unset = 4 s with sglang-cpu engines, else the trace's (poise run) or Arrow Table 1's Azure conversation value, 2 s.")
    slo_tpot_s: float | None = Field(None, gt=0.0, description="TPOT SLO (s) the policies plan for (and poise run judges by); unset = 0.3 s with sglang-cpu engines, else the trace's (poise run) or 0.15 s (Azure conversation).")
    # -- engine scheduling (every engine_sim; see services/engine_sim/config.py) ------------------------------
    prefill_policy: str | None = Field(None, description="Prefill scheduling policy of every engine (shared.policies PREFILL_POLICIES: fcfs, edf, ...); unset = flowprefill-fewest-late-cautious with --planner-policy poise, else engine_sim's default (fcfs).")
    decode_policy: str | None = Field(None, description="Decode batch policy of every engine (shared.policies DECODE_BATCH_POLICIES: continuous, ...); unset = engine_sim's default.")
    preemption: str | None = Field(None, description="Where prefill engines may switch to a more urgent prompt: chunk (SGLang, at chunk boundaries) or operator (FlowPrefill); unset = operator with --planner-policy poise, else chunk.")
    give_up_late_prompts: bool | None = Field(None, description="Colocated engines refuse (429) prompts still waiting, unstarted, past their TTFT target (engine_sim --give-up-late-prompts); unset = on with --planner-policy poise, else off.")
    chunked_prefill_size: int | None = Field(None, description="Prefill chunk size in tokens of every engine (SGLang --chunked-prefill-size); -1 = no chunking; unset = -1 with --planner-policy poise, else the profile's.")
    # -- decode-to-decode migration (ARES; services/migrator, services/gateway/flow.py) ------------------------
    migration_policy: str = Field("none", description="The migrator's policy (shared.policies MIGRATION_POLICIES: none, ares, llumnix-like, ...).")
    migration_mechanism: str = Field("recompute", description="How moves are carried out: recompute (re-prefill; works with stock SGLang) or kv-transfer (engine_sim's decode-to-decode KV copy).")
    length_predictor: str | None = Field(None, description="Remaining-length predictions of the decode engines (engine_sim: oracle or ares-noise; what ARES' policy reads); unset = none, or what the migration policy reads (ares: ares-noise, ares-oracle: oracle).")
    # -- gateway: late binding and SLO classes (services/gateway/admission.py, slo.py) ----------------------
    late_binding: bool = Field(False, description="The gateway holds requests and releases them to prefill engines in --late-binding-policy's order, so decode engines reserve KV only for prompts about to be prefilled (and stock engines get the policy's order); on with --planner-policy poise unless --no-late-binding.")
    late_binding_policy: str = Field("edf", description="Late binding: the prefill policy that orders held requests (flowprefill-fewest-late with --planner-policy poise).")
    late_binding_depth: int = Field(2, ge=1, description="Late binding: prompts a prefill engine may hold unprefilled.")
    local_prefill_max_tokens: int | None = Field(None, ge=0, description="DOPD's local prefill: the gateway sends prompts up to this many tokens to an engine_sim decode engine alone, which prefills them itself (no KV transfer); 0 = off; unset = 512 (the spec's threshold) with the DOPD-based planner policies (dopd, poise), as the simulator's mixes, else off. SGLang decode engines never get them.")
    early_rejection: bool | None = Field(None, description="The gateway refuses (429) requests whose decode engine's queue would keep them from starting within their TTFT target (shared/policies/admission.py); unset = on with --planner-policy poise, as the simulator's poise mix, else off.")
    gateway_slo_class: list[str] = Field(default_factory=list, description="An SLO class NAME=TTFT_S:TPOT_S requests may name (body field slo_class); repeatable; passed to the gateway as --slo-class.")
    gateway_slo_preset: str | None = Field(None, description="The gateway's SLO classes from a preset (tasks-flowprefill: FlowPrefill Table 2; interactive-batch), built on the planning SLO.")
    # -- security (docs/security.md) -------------------------------------------------------------------
    auth: bool = Field(True, description="NATS users with per-service permissions, etcd authentication and a gateway API key, with credentials made for this run (<run dir>/credentials.json); --no-auth turns all three off (debugging).")
    api_key: str | None = Field(None, description="The gateway's API key (clients send 'Authorization: Bearer <key>'; poise run's replay does); unset = a random one with auth on (in stack.json), none with --no-auth.")
    spare_worker_ids: int = Field(16, ge=0, description="With auth and the planner's local connector: NATS users made for this many more engine ids per role, for the engines the connector starts.")

    @model_validator(mode="before")
    @classmethod
    def _engines_imply(cls, data: Any) -> Any:
        """The served model, the latency profile and the start-up wait follow the engines, unless set."""
        sglang = isinstance(data, dict) and data.get("engines") == "sglang-cpu"
        return fill_unset(data, {"model": SGLANG_CPU_MODEL if sglang else SIM_MODEL,
                                 "profile": SGLANG_CPU_PROFILE if sglang else DEFAULT_PROFILE,
                                 "ready_timeout_s": 900.0 if sglang else 60.0})

    @model_validator(mode="before")
    @classmethod
    def _planner_policy_implies(cls, data: Any) -> Any:
        """The poise planner brings the rest of its mix (`POISE_MIX`) for every field left unset,
        the other planners least-load dispatch; a flag or env var given for a field wins. The data here is
        flags and env merged."""
        poise = isinstance(data, dict) and data.get("planner_policy", DEFAULT_PLANNER_POLICY) == "poise"
        return fill_unset(data, POISE_MIX.stack_defaults() if poise else {"dispatch_policy": DEFAULT_DISPATCH_POLICY})

    @field_validator("planner_policy", "dispatch_policy", "prefill_policy", "late_binding_policy", "decode_policy")
    @classmethod
    def _known_policy(cls, value: str | None, info: ValidationInfo) -> str | None:
        # Imported here, not at module import: `poise admin` needs none of the policies.
        from shared.policies import (
            DECODE_BATCH_POLICIES,
            DISPATCH_POLICIES,
            POOL_POLICIES,
            PREFILL_POLICIES,
            lookup,
        )

        registry, kind = {
            "planner_policy": (POOL_POLICIES, "pool policy"),
            "dispatch_policy": (DISPATCH_POLICIES, "dispatch policy"),
            "decode_policy": (DECODE_BATCH_POLICIES, "decode batch policy"),
        }.get(info.field_name or "", (PREFILL_POLICIES, "prefill policy"))
        if value is not None:
            lookup(registry, value, kind)  # type: ignore[arg-type]
        return value

    @field_validator("preemption")
    @classmethod
    def _known_preemption(cls, value: str | None) -> str | None:
        from shared.policies.prefill_order import PREEMPTION

        if value is not None and value not in PREEMPTION:
            raise ValueError(f"unknown preemption {value!r}; known: {', '.join(PREEMPTION)}")
        return value

    @field_validator("chunked_prefill_size")
    @classmethod
    def _valid_chunk(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value != -1:
            raise ValueError(f"chunked_prefill_size must be positive, or -1 for no chunking, got {value}")
        return value

    @field_validator("migration_policy")
    @classmethod
    def _known_migration_policy(cls, value: str) -> str:
        from shared.policies.migration import MIGRATION_POLICIES

        if value not in MIGRATION_POLICIES:
            raise ValueError(f"unknown migration policy {value!r}; known: {', '.join(sorted(MIGRATION_POLICIES))}")
        return value

    @field_validator("migration_mechanism")
    @classmethod
    def _known_mechanism(cls, value: str) -> str:
        if value not in ("recompute", "kv-transfer"):
            raise ValueError(f"unknown migration mechanism {value!r}; known: recompute, kv-transfer")
        return value

    @field_validator("length_predictor")
    @classmethod
    def _known_length_predictor(cls, value: str | None) -> str | None:
        from shared.policies.length import LENGTH_PREDICTORS

        if value is not None and value != "none" and value not in LENGTH_PREDICTORS:
            raise ValueError(f"unknown length predictor {value!r}; known: none, {', '.join(sorted(LENGTH_PREDICTORS))}")
        return value

    @property
    def sim_engines(self) -> bool:
        """engine_sim engines, which take Poise's engine scheduling flags; SGLang's run SGLang's own."""
        return self.engines == "sim"

    def engines_length_predictor(self) -> str | None:
        """What the engines predict with: the setting, or ARES' stand-in when an ARES policy needs predictions."""
        if self.length_predictor is not None:
            return self.length_predictor
        if self.migration_policy == "ares-oracle":
            return "oracle"
        return "ares-noise" if self.migration_policy.startswith("ares") else None

    def engine_args(self) -> list[str]:
        """engine_sim flags for the scheduling settings that are set (the worker appends them to its engine);
        none for SGLang engines, which run SGLang's own scheduling."""
        args: list[str] = []
        if not self.sim_engines:
            return args
        predictor = self.engines_length_predictor()
        if predictor is not None:
            args += ["--length-predictor", predictor]
        for flag, value in (("--prefill-policy", self.prefill_policy), ("--decode-policy", self.decode_policy),
                            ("--preemption", self.preemption), ("--chunked-prefill-size", self.chunked_prefill_size)):
            if value is not None:
                args += [flag, str(value)]
        if self.give_up_late_prompts:
            args += ["--give-up-late-prompts"]
        return args

    def local_prefill_tokens(self) -> int:
        """The gateway's local-prefill threshold: as set, else DOPD's default under a DOPD-based planner."""
        if self.local_prefill_max_tokens is not None:
            return self.local_prefill_max_tokens
        if self.planner_policy == "poise":
            return POISE_MIX.local_prefill_max_tokens
        from shared.policies.local_prefill import DEFAULT_MAX_LOCAL_PREFILL_TOKENS

        return DEFAULT_MAX_LOCAL_PREFILL_TOKENS if self.planner_policy == "dopd" else 0

    def gateway_policy_args(self) -> list[str]:
        """Gateway flags for late binding, local prefill, early rejection, SLO classes, moving non-streaming
        requests and, on SGLang CPU engines, the /health probe's patience."""
        args: list[str] = []
        if self.migration_policy != "none":  # the migrator may pick any running request, streamed or not
            args += ["--move-non-streaming"]
        if self.late_binding:
            args += ["--late-binding", "--late-binding-policy", self.late_binding_policy,
                     "--late-binding-depth", str(self.late_binding_depth)]
        local = self.local_prefill_tokens()
        if local > 0:
            args += ["--local-prefill-max-tokens", str(local)]
        if self.early_rejection:  # unset: on with the poise planner (POISE_MIX), else off
            args += ["--early-rejection"]
            if self.give_up_late_prompts and self.sim_engines:
                # Colocated engines refuse late prompts themselves; make_mix leaves them unjudged the same way.
                args += ["--no-early-rejection-colocated"]
        if not self.sim_engines:
            # A CPU engine's prefill pass runs for seconds (a 4096-token chunk ~16 s on one core) and SGLang's
            # /health answers only after it: the default 5 s probe would call a busy engine hung and fail its
            # requests with 502s (seen near a 1P1D CPU pair's capacity, 0.44 req/s).
            args += ["--probe-timeout-s", str(CPU_ENGINE_PROBE_TIMEOUT_S)]
        for spec in self.gateway_slo_class:
            args += [f"--slo-class={spec}"]
        if self.gateway_slo_preset:
            args += ["--slo-preset", self.gateway_slo_preset]
        return args

    @model_validator(mode="after")
    def _valid_gateway_slo(self) -> StackSettings:
        """Build the gateway's SLO table now, so a bad --gateway-slo-class fails before anything starts."""
        if self.gateway_slo_class or self.gateway_slo_preset:
            from services.gateway.slo import SloTable, Targets

            ttft, tpot = self.planning_slo()
            SloTable.build(specs=self.gateway_slo_class, preset=self.gateway_slo_preset, default_slo=Targets(ttft, tpot))
        return self

    def slo_trace(self) -> str:
        """The trace whose SLO the policies plan for when --slo-ttft-s / --slo-tpot-s are unset."""
        return DEFAULT_SLO_TRACE

    def planning_slo(self) -> tuple[float, float]:
        """(TTFT, TPOT) SLO in seconds handed to the planner and the gateway: the flags', else what the engines
        can meet (sglang-cpu: a CPU's), else the trace's."""
        if self.engines == "sglang-cpu":
            ttft_s, tpot_s = SGLANG_CPU_SLO_S
            return (self.slo_ttft_s or ttft_s, self.slo_tpot_s or tpot_s)
        try:
            default = slo_for(self.slo_trace())
        except ValueError:  # a trace file of our own: no Table 1 entry
            default = slo_for(DEFAULT_SLO_TRACE)
        return (self.slo_ttft_s or default.ttft_s, self.slo_tpot_s or default.tpot_s)


class Stack:
    """Starts and stops the processes of one dev stack."""

    def __init__(self, settings: StackSettings, progress: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self._progress = progress or (lambda line: None)
        self._t0 = time.monotonic()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.state_dir = settings.state_dir
        self.run_dir = settings.run_dir or self.state_dir / "runs" / stamp
        self._lock: StackLock | None = None
        self.processes: list[ManagedProcess] = []
        self.engines: dict[str, str] = {}  # instance id -> engine URL
        # instance id -> KV bootstrap port of a PD engine (what SGLang's router takes beside a prefill URL)
        self.bootstrap_ports: dict[str, int] = {}
        self.nats: NatsServer | None = None
        self.etcd: EtcdServer | None = None
        self.gateway_url = ""
        self.monitor_url = ""
        self.credentials: Credentials | None = None  # with auth on
        self.api_key: str | None = settings.api_key  # the gateway's; a random one is made at start with auth on
        self.dry_run = False  # describe the processes (planned), start none
        load_profile(settings.profile)  # fail now, not in four engine logs

    def planned(self) -> list[ManagedProcess]:
        """Every process ``start`` would start, in order, with its command line and environment, none started
        (nothing waited for, no state written); the credentials and config files go to the run dir."""
        self.dry_run = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._start()
        return [p for p in (self.nats, self.etcd) if p is not None] + self.processes

    def _say(self, message: str) -> None:
        self._progress(f"[{time.monotonic() - self._t0:5.1f}s] {message}")

    def _common(self) -> list[str]:
        assert self.nats is not None and self.etcd is not None
        return ["--namespace", self.settings.namespace, "--nats-url", self.nats.plain_url,
                "--etcd-url", self.etcd.plain_url]

    def _spawn(self, name: str, module: str, args: list[str], *, nats_user: str | None = None,
               env: dict[str, str] | None = None, instance_id: str | None = None) -> ManagedProcess:
        """Start ``python -m module args``; with auth on, its credentials go in its environment (flags show in ps)."""
        extra = dict(env or {})
        if self.credentials is not None and nats_user is not None:
            prefix, c = ENV_PREFIX[module], self.credentials
            etcd_user, etcd_password = c.etcd_login(instance_id)
            extra |= {prefix + "NATS_USER": nats_user, prefix + "NATS_PASSWORD": c.nats_password(nats_user),
                      prefix + "ETCD_USER": etcd_user or "", prefix + "ETCD_PASSWORD": etcd_password or ""}
            if module in ENGINE_KEY_HOLDERS and c.engine_api_key:
                extra[prefix + "ENGINE_API_KEY"] = c.engine_api_key
        proc = ManagedProcess(name, [sys.executable, "-m", module, *args], self.run_dir / "logs" / f"{name}.log",
                              env={**os.environ, **extra} if extra else None, start=not self.dry_run)
        self.processes.append(proc)
        return proc

    def _instance_ids(self) -> list[tuple[str, str]]:
        """(instance id, role) of every engine this stack starts."""
        s = self.settings
        roles = ["prefill"] * s.prefill + ["decode"] * s.decode + ["null"] * s.colocated
        counters = {"prefill": 0, "decode": 0, "null": 0}
        ids = []
        for role in roles:
            ids.append((f"{ROLE_PREFIX[role]}{counters[role]}", role))
            counters[role] += 1
        return ids

    def _spare_ids(self) -> list[str]:
        """The ids the planner's local connector gives the engines it starts (after ours, per role)."""
        s = self.settings
        counts = {"prefill": s.prefill, "decode": s.decode, "null": s.colocated}
        return [f"{ROLE_PREFIX[role]}{n + k}" for role, n in counts.items() for k in range(s.spare_worker_ids)]

    def _make_credentials(self) -> list[NatsUser]:
        """Credentials for this run (written 0600 to the run dir) and the nats-server users they give."""
        s = self.settings
        spares = self._spare_ids() if planner_uses_local_connector(s.planner_args) else []
        ids = [i for i, _ in self._instance_ids()] + spares
        permissions = user_permissions(Subjects(s.namespace), ids)
        self.credentials = creds = Credentials.generate(permissions, api_key=s.api_key, etcd_workers=ids)
        self.api_key = creds.api_key
        creds.write(self.run_dir / "credentials.json")
        if spares:  # what the planner's local connector hands the workers it starts: nothing else
            creds.subset((worker_user(i) for i in spares), etcd_workers=spares).write(
                self.run_dir / "worker-credentials.json")
        return [NatsUser(user, creds.nats[user], p) for user, p in permissions.items()]

    def start(self) -> None:
        s = self.settings
        self._lock = StackLock(self.state_dir)  # before anything starts: a second stack here is refused
        try:
            check_ports_free(s.host, [("gateway", s.gateway_port), ("monitor", s.monitor_port),
                                      ("nats-server", s.nats_port), ("etcd", s.etcd_port)])
        except BaseException:
            self._lock.release()
            self._lock = None
            raise
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        s = self.settings
        users = self._make_credentials() if s.auth else []
        self.nats = NatsServer(self.run_dir, host=s.host, port=s.nats_port or None, users=users,
                               client_user="admin" if users else None, start=not self.dry_run)
        self._say(f"nats-server up at {self.nats.plain_url}")
        self.etcd = EtcdServer(self.run_dir, host=s.host, port=s.etcd_port or None,
                               auth=EtcdAuth.of(self.credentials, Keys(s.namespace).instance) if self.credentials else None,
                               start=not self.dry_run)
        self._say(f"etcd up at {self.etcd.plain_url}")
        if self.credentials is not None:
            self._say(f"auth on: a NATS user per service and engine, etcd auth, gateway API key "
                      f"(credentials in {self.run_dir / 'credentials.json'})")
        common = self._common()
        monitor_port = s.monitor_port or self._free_port()
        gateway_port = s.gateway_port or self._free_port()
        self.monitor_url = f"http://{s.host}:{monitor_port}"
        self.gateway_url = f"http://{s.host}:{gateway_port}"
        self._spawn("monitor", "services.monitor", [*common, "--http-host", s.host, "--http-port", str(monitor_port)],
                    nats_user="monitor")
        ttft, tpot = s.planning_slo()
        # The planner's and the gateway's policies model the engines this stack runs, at the SLO it serves.
        plan = ["--profile", s.profile, "--slo-ttft-s", str(ttft), "--slo-tpot-s", str(tpot)]
        spares = self.run_dir / "worker-credentials.json"
        self._spawn("planner", "services.planner", [*common, *plan, "--policy", s.planner_policy,
                                                    "--drain-mechanism", s.migration_mechanism, *s.planner_args],
                    nats_user="planner",
                    env={"POISE_PLANNER_WORKER_CREDENTIALS_FILE": str(spares)} if spares.exists() else None)
        self._spawn("migrator", "services.migrator", [*common, *plan, "--policy", s.migration_policy,
                                                      "--mechanism", s.migration_mechanism], nats_user="migrator")
        self._spawn("gateway", "services.gateway", [*common, *plan, "--dispatch-policy", s.dispatch_policy,
                                                    "--host", s.host, "--port", str(gateway_port),
                                                    *s.gateway_policy_args(), *s.gateway_args],
                    nats_user="gateway",
                    env={"POISE_GATEWAY_API_KEYS": json.dumps([self.api_key])} if self.api_key else None)
        self._say(f"planner policy {s.planner_policy}, dispatch {s.dispatch_policy}, planning for TTFT {ttft:g}s / "
                  f"TPOT {tpot:g}s")
        engine_args = s.engine_args()
        if engine_args or s.late_binding or not s.sim_engines:
            late = f"late binding {s.late_binding_policy} depth {s.late_binding_depth}" if s.late_binding else "no late binding"
            scheduling = ' '.join(engine_args) or ("default scheduling" if s.sim_engines else "SGLang's own scheduling")
            self._say(f"engines: {s.engines}, {scheduling}; gateway: {late}")
        engines = self._instance_ids()
        cores = os.cpu_count() or 1
        for n, (instance_id, role) in enumerate(engines):
            engine_port = self._free_port()
            self.engines[instance_id] = f"http://{s.host}:{engine_port}"
            args = [*common, "--instance-id", instance_id, "--role", role,
                    "--engine-host", s.host, "--engine-port", str(engine_port),
                    "--profile", s.profile, "--model", s.model, "--log-dir", str(self.run_dir / "logs")]
            if s.sim_engines:
                args += ["--engine-kind", "sim", "--time-scale", str(s.time_scale),
                         "--seed", str(s.seed + len(self.processes))]
            else:
                args += ["--engine-preset", s.engines, "--engine-env", json.dumps(one_core_each(n, cores))]
            if role != "null":  # decode engines get one too: a flip to prefill needs it
                self.bootstrap_ports[instance_id] = self._free_port()
                args += ["--bootstrap-port", str(self.bootstrap_ports[instance_id])]
            if engine_args:  # every engine, whatever its role: a flip keeps the engine's settings
                args += ["--extra-args", json.dumps(engine_args)]
            self._spawn(f"worker-{instance_id}", "services.worker", args, nats_user=worker_user(instance_id),
                        instance_id=instance_id)
        if self.dry_run:
            return
        self._say(f"started {len(self.processes)} processes; waiting for {len(engines)} engines to register")
        self._wait_ready(len(engines))
        self._write_state()
        self._say(f"stack ready: gateway {self.gateway_url}  (logs in {self.run_dir / 'logs'})")

    def _free_port(self) -> int:
        return free_port(self.settings.host)  # never one this process handed out before (shared.devservers)

    def _wait_ready(self, engines: int) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        seen = -1
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                for proc in self.processes:
                    if not proc.alive:
                        raise PoiseError(f"{proc.name} exited with {proc.proc.returncode} during start-up; "
                                         f"last lines of {proc.log_path}:\n{proc.tail()}")
                try:
                    health = client.get(self.gateway_url + "/health").json()
                    count = int(health.get("instances", 0))
                except (httpx.HTTPError, ValueError):
                    count = -1
                if count != seen and count >= 0:
                    self._say(f"{count}/{engines} engines registered")
                    seen = count
                if count >= engines:
                    return
                time.sleep(0.1)
        raise PoiseError(f"only {max(seen, 0)}/{engines} engines registered after {self.settings.ready_timeout_s:.0f}s; "
                         f"see the logs in {self.run_dir / 'logs'}")

    def _write_state(self) -> None:
        assert self.nats is not None and self.etcd is not None
        state = {"gateway_url": self.gateway_url, "monitor_url": self.monitor_url, "nats_url": self.nats.plain_url,
                 "etcd_url": self.etcd.plain_url, "namespace": self.settings.namespace, "model": self.settings.model,
                 "run_dir": str(self.run_dir), "engines": self.engines, "bootstrap_ports": self.bootstrap_ports,
                 "planner_policy": self.settings.planner_policy, "dispatch_policy": self.settings.dispatch_policy,
                 "engine_args": self.settings.engine_args(), "gateway_policy_args": self.settings.gateway_policy_args(),
                 # What `poise admin` and `poise bench` log in with (these files are readable by this user only).
                 "auth": self.credentials is not None, "api_key": self.api_key,
                 "credentials_file": str((self.run_dir / "credentials.json").resolve()) if self.credentials else None}
        text = json.dumps(state, indent=2)
        _write_private(self.run_dir / "stack.json", text)
        _write_private(self.state_dir / "current.json", text)
        if self._lock is not None:
            self._lock.describe(gateway=self.gateway_url, run_dir=str(self.run_dir))

    @property
    def supervised(self) -> list[ManagedProcess]:
        """Every process of the stack, nats-server and etcd included: what ``poise up`` keeps running."""
        servers: list[ManagedProcess] = [s for s in (self.nats, self.etcd) if s is not None]
        return [*servers, *self.processes]

    def check_alive(self) -> list[str]:
        """Processes that died (a retired worker did not)."""
        return [p.name for p in self.supervised if not p.alive and not retired(p)]

    def stop(self) -> None:
        # Workers first so they deregister while etcd is still there; then the rest in reverse start order.
        workers = [p for p in self.processes if p.name.startswith("worker-")]
        others = [p for p in self.processes if not p.name.startswith("worker-")]
        for proc in workers:
            if proc.alive:
                proc.proc.terminate()
        for proc in workers:
            proc.stop(timeout_s=15)
        for proc in reversed(others):
            proc.stop()
        self.processes.clear()
        for server in (self.etcd, self.nats):
            if server is not None:
                server.stop()
        self.etcd = self.nats = None
        current = self.state_dir / "current.json"
        if current.exists() and self._lock is not None:  # only the lock's holder wrote it
            try:
                if json.loads(current.read_text()).get("run_dir") == str(self.run_dir):
                    current.unlink()
            except (OSError, ValueError):
                pass
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._say("stack stopped")


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by this user only (the state names the API key)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def planner_uses_local_connector(planner_args: list[str]) -> bool:
    """Whether the planner will start engines itself (``--connector local``, or POISE_PLANNER_CONNECTOR=local)."""
    for i, arg in enumerate(planner_args):
        if arg == "--connector" and i + 1 < len(planner_args):
            return planner_args[i + 1] == "local"
        if arg.startswith("--connector="):
            return arg.split("=", 1)[1] == "local"
    return os.environ.get("POISE_PLANNER_CONNECTOR") == "local"


def current_admin_credentials(nats_url: str | None = None) -> tuple[str, str] | None:
    """The admin NATS user and password of the stack `poise up` started here (None: none, or auth off).

    With ``nats_url``, only when that is the stack's NATS (another server never gets this password)."""
    current = read_current_stack() or {}
    path = current.get("credentials_file")
    if not path or (nats_url is not None and nats_url != current.get("nats_url")):
        return None
    try:
        return "admin", Credentials.read(Path(path)).nats_password("admin")
    except PoiseError:
        return None


def current_api_key(gateway_url: str) -> str | None:
    """The API key of the stack `poise up` started here, when ``gateway_url`` is its gateway."""
    current = read_current_stack() or {}
    if str(current.get("gateway_url", "")).rstrip("/") != gateway_url.rstrip("/"):
        return None
    key = current.get("api_key")
    return key if isinstance(key, str) and key else None


def read_current_stack() -> dict[str, str] | None:
    """The stack ``poise up`` last started here, if it is still up."""
    path = STATE_DIR / "current.json"
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None
