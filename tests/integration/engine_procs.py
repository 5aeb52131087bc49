"""engine_sim processes for integration tests: start on free loopback ports, wait until healthy, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.devservers import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    port: int
    bootstrap_port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_engine(tmp: Path, mode: str, *extra: str, time_scale: float | str = 1.0, name: str = "test",
                 bootstrap_timeout_s: float = 5.0) -> Engine:
    port, bport = free_port(), free_port()
    log = tmp / f"engine-{mode}-{port}.log"
    cmd = [sys.executable, "-m", "services.engine_sim", "--mode", mode, "--port", str(port), "--bootstrap-port",
           str(bport), "--time-scale", str(time_scale), "--instance-id", f"{name}-{mode}", "--bootstrap-timeout-s",
           str(bootstrap_timeout_s), *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Engine(proc, port, bport, log)


def wait_healthy(engines: list[Engine], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        while True:
            if engine.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {engine.proc.returncode}: {engine.log.read_text()}")
            try:
                if httpx.get(engine.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine on {engine.port} not healthy: {engine.log.read_text()}")
            time.sleep(0.05)


def stop(engines: list[Engine]) -> dict[int, int | None]:
    """SIGTERM every engine, then wait (kill after 10 s); returns each port's exit code."""
    for e in engines:
        if e.proc.poll() is None:
            e.proc.send_signal(signal.SIGTERM)
    codes: dict[int, int | None] = {}
    for e in engines:
        try:
            codes[e.port] = e.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            e.proc.kill()
            e.proc.wait()
            codes[e.port] = None
    return codes
