"""The one-copy rule for the engine model's shared pieces: the radix prefix cache and the prefix identity live
in shared/engine only, and everything else imports them from there (engine_sim, the simulator, the gateway's
dispatch), so the live engines and the simulated ones cannot drift apart."""

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
    users = ["services/engine_sim/kv.py", "services/engine_sim/protocol.py", "loadgen/sim/instance.py",
             "shared/policies/cache_aware.py", "services/gateway/flow.py"]
    for rel in users:
        tree = ast.parse((REPO / rel).read_text())
        sources = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "shared.engine" in sources, f"{rel} no longer imports the prefix cache from shared.engine"


def test_the_engine_model_pieces_import_no_io() -> None:
    code = ("import sys\nimport shared.engine\n"
            "print(','.join(m for m in ('asyncio', 'httpx', 'nats', 'fastapi') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == ""
