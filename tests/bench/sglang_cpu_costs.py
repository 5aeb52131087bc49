"""What the simulator assumes, measured on real SGLang 0.5.23 on this CPU (SmolLM2-135M-Instruct, the sglang-cpu
preset): an engine's start, a role switch through the planner (idle, and with an answer to drain), a restart into
and out of colocated serving, and a request moved between decode engines by recompute. Each is set beside the
constant the simulator charges for it.

    python -m tests.bench.sglang_cpu_costs [--repeats 3]     (~6 min on 2 cores; make sglang-setup first)

Writes tests/bench/results/sglang_cpu_costs.{json,md}."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadgen.sim.cluster import SimCosts
from services.cli.stack import Stack
from shared.latency import DEFAULT_PROFILE, load_profile
from tests.sglang.realstack import Streamed, admin, decoding_on, engine_get, real_stack, serving, until

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUT = {"p0": "prefill", "d0": "decode", "d1": "decode"}


def _timed_admin(stack: Stack, *args: str) -> tuple[float, str]:
    t0 = time.monotonic()
    done = admin(stack, *args, timeout_s=420)
    took = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"poise admin {' '.join(args)}: {done.stdout}{done.stderr}")
    return took, done.stdout.strip()


def _sidecar_seconds(reply: str) -> float:
    """The sidecar's own drain + switch + back-in-service time from a flip's reply ('a -> b in 0.50s: ...')."""
    match = re.search(r" in ([0-9.]+)s", reply)
    return float(match.group(1)) if match else float("nan")


def measure(repeats: int, say: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"repeats": repeats}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        with real_stack(Path(tmp), prefill=1, decode=2) as stack:
            out["stack_start_s"] = time.monotonic() - t0
            phases = {i: engine_get(stack, i, "/server_info").json().get("startup_time") for i in LAYOUT}
            out["engine_startup_phases_s"] = phases
            say(f"stack of 3 engines up in {out['stack_start_s']:.1f}s")
            idle: dict[str, list[float]] = {"to_prefill": [], "to_decode": []}
            idle_sidecar: dict[str, list[float]] = {"to_prefill": [], "to_decode": []}
            for _ in range(repeats):
                for instance, role, key in (("d1", "prefill", "to_prefill"), ("d1", "decode", "to_decode")):
                    took, reply = _timed_admin(stack, "flip", instance, "--to", role)
                    idle[key].append(took)
                    idle_sidecar[key].append(_sidecar_seconds(reply))
            out["role_switch_idle_s"] = idle
            out["role_switch_idle_sidecar_s"] = idle_sidecar
            say(f"idle role switches: {idle}")
            # with an answer to drain: the flip waits for it (SGLang switches only an idle engine)
            drained = []
            for _ in range(repeats):
                serving(stack, LAYOUT)
                answer = Streamed(stack, 60)
                busy = decoding_on(stack)
                took, reply = _timed_admin(stack, "flip", busy, "--to", "prefill")
                answer.result()
                drained.append({"flip_s": took, "sidecar_s": _sidecar_seconds(reply),
                                "answer_tokens": (answer.usage or {}).get("completion_tokens")})
                _timed_admin(stack, "flip", busy, "--to", "decode")
            out["role_switch_draining"] = drained
            say(f"draining role switches: {drained}")
            restarts = []
            for role_out, role_back in (("null", "decode"),):
                serving(stack, LAYOUT)
                into, reply_into = _timed_admin(stack, "flip", "d1", "--to", role_out)
                back, reply_back = _timed_admin(stack, "flip", "d1", "--to", role_back)
                restarts.append({"into_colocated_s": into, "back_to_decode_s": back,
                                 "sidecar_into_s": _sidecar_seconds(reply_into),
                                 "sidecar_back_s": _sidecar_seconds(reply_back)})
            out["colocated_restart"] = restarts
            say(f"colocated restarts: {restarts}")
            moves = []
            for _ in range(repeats):
                serving(stack, LAYOUT)
                answer = Streamed(stack, 80)
                until(lambda a=answer: len(a.parts) >= 20, 60, "20 tokens")  # type: ignore[misc]  # mypy cannot type a default-bound lambda
                source = decoding_on(stack)
                target = "d1" if source == "d0" else "d0"
                took, reply = _timed_admin(stack, "migrate", answer.rid, "--to", target)
                answer.result()
                gap = re.search(r"client gap ([0-9.]+)s", reply)
                moves.append({"command_s": took, "client_gap_s": float(gap.group(1)) if gap else None})
            out["recompute_move"] = moves
            say(f"recompute moves: {moves}")
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(data: dict[str, Any], command: str) -> str:
    profile = load_profile(DEFAULT_PROFILE)
    idle, sidecar = data["role_switch_idle_s"], data["role_switch_idle_sidecar_s"]
    phases = data["engine_startup_phases_s"]
    tok = [float(p["tokenizer_e2e"]) for p in phases.values() if isinstance(p, dict) and p.get("tokenizer_e2e")]
    drained = data["role_switch_draining"]
    restart = data["colocated_restart"][0]
    moves = data["recompute_move"]
    lines = [
        "# What the simulator assumes, measured on real SGLang (CPU)", "",
        f"`{command}` — SGLang 0.5.23, SmolLM2-135M-Instruct, sglang-cpu preset, 1 prefill + 2 decode engines on a "
        f"2-core machine, {data['repeats']} repeats. Medians; every sample in sglang_cpu_costs.json.", "",
        "| what | measured here | the simulator charges | carries over to a GPU node |",
        "|---|---|---|---|",
        f"| engine start (launch to serving) | stack of 3 engines up in {data['stack_start_s']:.0f} s; SGLang's own "
        f"`startup_time.tokenizer_e2e` {_median(tok):.0f} s | `SimCosts.start_s` {SimCosts().start_s:.0f} s | no: "
        "here mostly Python imports on a busy CPU; a GPU adds weight loading (GBs) and CUDA-graph capture |",
        f"| role switch, idle (prefill -> decode / decode -> prefill): `poise admin flip` to its reply; the "
        f"sidecar's drain + switch + back in service | {_median(idle['to_decode']):.2f} s / "
        f"{_median(idle['to_prefill']):.2f} s; sidecar {_median(sidecar['to_decode']):.2f} s / "
        f"{_median(sidecar['to_prefill']):.2f} s | profile `role_switch_s` "
        f"{profile.role_switch_s:g} s | partly: the drain/deregister/re-register path is the same; a GPU switch to "
        "decode also captures decode CUDA graphs (none here: `decode_cuda_graph_memory_gb` 0) |",
        f"| role switch of a decode engine with a 60-token answer running | "
        f"{_median([d['flip_s'] for d in drained]):.2f} s (answers finished: "
        f"{sum(1 for d in drained if d['answer_tokens'] == 60)}/{len(drained)}) | drain as simulated, then "
        f"`role_switch_s` | the drain scales with the answers left, at the engine's decode speed |",
        f"| restart into colocated serving / back to decode | {restart['into_colocated_s']:.0f} s / "
        f"{restart['back_to_decode_s']:.0f} s | `SimCosts.start_s` {SimCosts().start_s:.0f} s (a restart) | as the "
        "engine start |",
        f"| recompute move, client gap (no token) | {_median([m['client_gap_s'] for m in moves if m['client_gap_s']]):.2f} s "
        "| a recompute on the target (`shared.policies.migration_cost`: the prefill of prompt + generated tokens) | "
        "the gap is mostly the target's prefill and the new pair's bootstrap: far shorter on a GPU |",
        "",
        "The CPU numbers bound the control plane's share (NATS command, drain check, etcd re-registration), which is "
        "the same on a GPU node; the engine's share (imports, weights, graphs, prefill) is not.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    command = "python -m tests.bench.sglang_cpu_costs" + (f" --repeats {args.repeats}" if args.repeats != 3 else "")
    data = measure(args.repeats, lambda line: print(line, file=sys.stderr, flush=True))
    data["command"] = command
    write_results("sglang_cpu_costs", data, report(data, command))


def write_results(name: str, data: dict[str, Any], markdown: str) -> None:
    """``results/<name>.json`` (every sample, and the command) and ``results/<name>.md``, printed too."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
