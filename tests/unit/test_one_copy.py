"""The one-copy rule for the engine model: its scheduler (``shared.engine.model``), the radix prefix cache and
the prefix identity live in shared/engine only, and everything else imports them from there (engine_sim and
the simulator run the same scheduler; the gateway's dispatch hashes prompts the same way), so the live
engines and the simulated ones cannot drift apart."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOME = REPO / "shared" / "engine"
SOURCES = [p for d in ("services", "shared", "loadgen", "tests") for p in (REPO / d).rglob("*.py")]


def test_no_second_radix_cache_or_prefix_hash_outside_shared_engine() -> None:
    twins = []
    for path in SOURCES:
        if HOME in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and ("Radix" in node.name or node.name.endswith("PrefixCache")):
                twins.append(f"{path.relative_to(REPO)}: class {node.name}")
            if isinstance(node, ast.FunctionDef) and node.name in ("token_blocks", "text_blocks", "prompt_blocks"):
                twins.append(f"{path.relative_to(REPO)}: def {node.name}")
    assert not twins, f"a second copy of the engine model's prefix cache: {twins}"


def test_the_users_import_the_cache_from_shared_engine() -> None:
    users = ["services/engine_sim/protocol.py", "loadgen/sim/instance.py",
             "shared/policies/cache_aware.py", "services/gateway/flow.py"]
    for rel in users:
        tree = ast.parse((REPO / rel).read_text())
        sources = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert any(m and (m == "shared.engine" or m.startswith("shared.engine.")) for m in sources), (
            f"{rel} no longer imports the prefix cache from shared.engine")


MODEL = REPO / "shared" / "engine" / "model.py"
MODEL_NAMES = {"EngineModel", "EngineRequest", "Step", "Applied", "Phase", "retraction_order"}
# The scheduler's rules, by the names the model gives them: a function of one of these names elsewhere is a twin.
SCHEDULER_RULES = {"admit_prealloc", "_prefill_parts", "_fits_prompt", "_mixed_step", "_decode_batch", "_grow",
                   "_ensure_growth", "_resume_retracted", "_join_ready", "_retract", "_advance_prefill",
                   "preemption_point", "_decode_reserve"}


def test_the_engine_model_is_imported_from_its_one_module() -> None:
    """Its names come from shared.engine.model and nowhere else (no re-export, no second definition)."""
    wrong = []
    for path in SOURCES:
        if path == MODEL or path == Path(__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module != "shared.engine.model":
                names = {a.name for a in node.names} & {"EngineModel", "EngineRequest"}
                if names and node.module and not node.module.startswith("shared.engine.model"):
                    wrong.append(f"{path.relative_to(REPO)}: from {node.module} import {sorted(names)}")
            if isinstance(node, ast.ClassDef) and node.name in ("EngineModel", "EngineRequest"):
                wrong.append(f"{path.relative_to(REPO)}: class {node.name}")
    assert not wrong, f"the engine model from somewhere else than shared/engine/model.py: {wrong}"
    assert "shared.engine.model" not in (HOME / "__init__.py").read_text(), "shared.engine must not re-export the model"


def test_both_engines_run_the_one_scheduler_and_write_none_of_its_rules() -> None:
    for adapter in ("services/engine_sim/engine.py", "loadgen/sim/instance.py"):
        tree = ast.parse((REPO / adapter).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "shared.engine.model"
                    for a in n.names}
        assert "EngineModel" in imported or "Step" in imported, f"{adapter} does not run shared.engine.model"
    twins = []
    for path in SOURCES:
        if path == MODEL or "tests" in path.relative_to(REPO).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name in SCHEDULER_RULES:
                twins.append(f"{path.relative_to(REPO)}: def {node.name}")
            if isinstance(node, ast.Name) and node.id == "retraction_key" and path.name != "retraction.py":
                twins.append(f"{path.relative_to(REPO)}: uses retraction_key (the model's retraction_order is the one)")
    assert not twins, f"a second copy of the engine model's scheduling rules: {twins}"


def test_the_engine_and_gateway_models_import_no_io() -> None:
    code = ("import sys\nimport shared.engine\nimport shared.engine.model\nimport shared.gateway.model\n"
            "print(','.join(m for m in ('asyncio', 'httpx', 'nats', 'fastapi') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == ""


def _engine_sim_imports() -> dict[str, set[str]]:
    """engine_sim's modules and the engine_sim modules each imports, type-checking imports included (the
    package's __init__ only re-exports, so it is left out)."""
    pkg = REPO / "services" / "engine_sim"
    names = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        deps: set[str] = set()
        for node in ast.walk(ast.parse((pkg / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "services.engine_sim":
                deps |= {a.name for a in node.names if a.name in names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("services.engine_sim."):
                deps.add(node.module.rsplit(".", 1)[1])
        graph[name] = deps - {name}
    return graph


def test_engine_sims_modules_import_each_other_without_a_cycle() -> None:
    """The engine is one class whose concerns live in helper modules (batching, transfer, reports, ...); those
    take the engine as a Protocol (engine_state.py, handoff.RoomHooks, role_switch.Switchable) rather than import
    engine.py, which imports them."""
    graph = _engine_sim_imports()
    assert graph["batching"] and "engine" in graph["main"]  # the graph is read
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError(f"import cycle in services/engine_sim: {' -> '.join(path[path.index(name):] + [name])}")
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


LATE_BINDING = REPO / "shared" / "policies" / "late_binding.py"
# The held queue's rule, by the names LateBinding gives its parts: called from anywhere but the pump, they
# would make a second pump.
PUMP_PARTS = {"overdue", "decode_room", "free_slots", "release"}


GATEWAY_MODEL = REPO / "shared" / "gateway" / "model.py"


def test_the_gateway_and_the_simulator_admit_through_the_one_gateway_model() -> None:
    """Admission (placement, the held queue, give-ups) is one pure model, ``shared.gateway.model.GatewayModel``:
    the live gateway and the simulator each build one and drive it, and only the model runs the held queue's
    pump (``LateBinding.pump``) or its parts."""
    for adapter, builder in (("services/gateway/admission.py", "services/gateway/service.py"),
                             ("loadgen/sim/cluster.py", "loadgen/sim/cluster.py")):
        assert "GatewayModel" in _calls(builder), f"{builder} does not build the gateway model"
        assert {"admit", "pump"} & _calls(adapter), f"{adapter} does not drive the gateway model"
    twins = []
    for path in SOURCES:
        if path in (LATE_BINDING, GATEWAY_MODEL) or "tests" in path.relative_to(REPO).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = ast.unparse(node.func.value).lower().replace("lb", "binding")
            if "ledger" in owner:
                continue  # the in-flight ledger has a release of its own (shared/policies/inflight.py)
            if node.func.attr in PUMP_PARTS | {"pump"} and "binding" in owner:
                twins.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node.func)}")
    assert not twins, f"the held queue's rule outside the gateway model: {twins}"


INFLIGHT = REPO / "shared" / "policies" / "inflight.py"


def test_the_gateway_and_the_simulator_keep_the_one_inflight_ledger() -> None:
    """The dispatcher's in-flight counts (``EngineView.inflight_*``) come from ``InflightLedger`` live and
    simulated: both build one, and no other module adds up in-flight tokens itself."""
    for adapter in ("services/gateway/cluster.py", "loadgen/sim/cluster.py"):
        assert "InflightLedger" in _calls(adapter), f"{adapter} does not keep the in-flight ledger"
    twins = []
    for path in SOURCES:
        if path == INFLIGHT or "tests" in path.relative_to(REPO).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute) and (
                    node.target.attr in ("tokens_sq", "pending_sq", "pending_tokens") or "inflight" in node.target.attr):
                twins.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not twins, f"in-flight work counted outside the ledger: {twins}"


def _calls(rel: str) -> set[str]:
    tree = ast.parse((REPO / rel).read_text())
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name | ast.Attribute)}


def test_the_engines_report_and_the_dispatchers_view_their_load_by_one_function_each() -> None:
    """An engine's load numbers come from ``shared.engine.load.engine_load`` (engine_sim's reports and the
    simulator's engines), its load report from ``shared.load_view.load_report`` (the sidecar and the simulator)
    and the dispatcher's view of it from ``shared.load_view.engine_view`` (the gateway and the simulator); no
    other module builds an ``EngineView``."""
    for rel, needed in (("services/engine_sim/reports.py", {"engine_load"}),
                        ("loadgen/sim/instance.py", {"engine_load", "load_report", "engine_view"}),
                        ("services/worker/load_report.py", {"load_report"}),
                        ("services/gateway/cluster.py", {"engine_view"})):
        assert needed <= _calls(rel), f"{rel} does not call {sorted(needed - _calls(rel))}"
    twins = []
    for path in SOURCES:
        rel = path.relative_to(REPO)
        if "tests" in rel.parts or rel.as_posix() in ("shared/load_view.py", "shared/policies/views.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "EngineView":
                twins.append(f"{rel}:{node.lineno}: EngineView(...)")
    assert not twins, f"an engine view built outside shared/load_view.py: {twins}"
