"""Policies must stay pure: importing them may not pull in any I/O library."""

from __future__ import annotations

import subprocess
import sys

BLOCKED = ["asyncio", "nats", "aetcd", "httpx", "fastapi", "grpc", "uvicorn"]


def test_policies_import_no_io_libraries() -> None:
    code = (
        "import sys\n"
        "import shared.policies, shared.policies.dispatch, shared.latency\n"
        f"bad = [m for m in {BLOCKED!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"shared.policies imported I/O modules: {out}"
