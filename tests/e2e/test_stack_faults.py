"""Faults against the stack `poise up` runs (real processes, auth on, 1P1D engine_sim): a killed sidecar or
gateway is restarted by the supervisor, a restarted sidecar adopts the engine its last run left serving (the
stream on it finishes untouched), `/health` says what the gateway can do, and a second stack in the same
state directory or on a busy port is refused without touching the first one's state."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from services.cli.stack import Stack, StackSettings
from services.cli.supervise import RestartPolicy, Supervisor
from shared.devservers import ManagedProcess
from shared.errors import PoiseError
from tests.integration.gateway_harness import streamed_tokens

pytestmark = pytest.mark.e2e
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("faults")
    settings = StackSettings(prefill=1, decode=1, gateway_port=0, monitor_port=0, state_dir=state, run_dir=state / "run",
                             model=MODEL, planner_policy="static")
    s = Stack(settings, progress=print)
    s.start()
    yield s
    s.stop()


def _proc(stack: Stack, name: str) -> ManagedProcess:
    return next(p for p in stack.supervised if p.name == name)


def _supervise_until(stack: Stack, done: Callable[[], bool], timeout_s: float = 60) -> Supervisor:
    sup = Supervisor(stack.supervised, RestartPolicy(backoff_s=0.2, backoff_max_s=1), say=print)
    deadline = time.monotonic() + timeout_s
    while not done():
        assert sup.poll() is None
        assert time.monotonic() < deadline, "the stack did not recover"
        time.sleep(0.1)
    return sup


def _health(stack: Stack) -> tuple[int, dict[str, object]]:
    try:
        r = httpx.get(stack.gateway_url + "/health", timeout=2, trust_env=False)
    except httpx.HTTPError:
        return 0, {}
    return r.status_code, r.json()


def _post(stack: Stack, max_tokens: int, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "prompt": list(range(64)), "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=120, trust_env=False, headers={"Authorization": f"Bearer {stack.api_key}"}) as client:
        r = client.post(stack.gateway_url + "/v1/completions", json=body)
        r.read()
        return r


def test_a_second_stack_is_refused_and_the_first_keeps_its_state(stack: Stack, tmp_path: Path) -> None:
    current = stack.state_dir / "current.json"
    before = current.read_text()
    with pytest.raises(PoiseError, match=f"already running from .*pid {os.getpid()}"):
        Stack(StackSettings(prefill=1, decode=1, gateway_port=0, monitor_port=0, state_dir=stack.state_dir,
                            run_dir=tmp_path / "second")).start()
    port = int(stack.gateway_url.rsplit(":", 1)[1])
    with pytest.raises(PoiseError, match=f"in use: gateway port 127.0.0.1:{port}"):
        Stack(StackSettings(prefill=1, decode=1, gateway_port=port, monitor_port=0, state_dir=tmp_path,
                            run_dir=tmp_path / "third")).start()
    assert current.read_text() == before and not (tmp_path / "current.json").exists()
    assert _health(stack)[0] == 200


def test_a_killed_sidecar_is_restarted_and_adopts_its_serving_engine(stack: Stack) -> None:
    status, body = _health(stack)
    assert status == 200 and body["status"] == "ok" and body["servable_models"] == [MODEL], body
    pid_file = stack.run_dir / "logs" / "engine-d0.pid"
    engine_pid = json.loads(pid_file.read_text())["pid"]
    worker = _proc(stack, "worker-d0")
    with ThreadPoolExecutor(1) as pool:
        # ~600 tokens at the H100 profile's pace: several seconds of decode on d0 while its sidecar is killed
        stream: Future[httpx.Response] = pool.submit(_post, stack, 600, True)
        deadline = time.monotonic() + 30
        assert stack.credentials is not None and stack.credentials.engine_api_key
        key = {"Authorization": f"Bearer {stack.credentials.engine_api_key}"}  # the engines want the stack's key
        while not httpx.get(stack.engines["d0"] + "/v1/loads", headers=key, trust_env=False).json()["loads"][0]["num_running_reqs"]:
            assert time.monotonic() < deadline, "the request never reached the decode engine"
            time.sleep(0.05)
        os.kill(worker.proc.pid, signal.SIGKILL)
        sup = _supervise_until(stack, lambda: worker.starts == 2 and worker.alive)
        response = stream.result(timeout=120)
    assert response.status_code == 200
    assert streamed_tokens(response.text) == 600 and response.text.rstrip().endswith("data: [DONE]")
    # The new sidecar took over the same engine process and registered it again.
    assert json.loads(pid_file.read_text())["pid"] == engine_pid
    assert "adopting engine pid" in (stack.run_dir / "logs" / "worker-d0.log").read_text(errors="replace")
    _supervise_until(stack, lambda: _health(stack)[1].get("servable_models") == [MODEL])
    assert sup.restarts == 1
    assert _post(stack, 8).status_code == 200


def test_a_killed_gateway_is_restarted_and_serves_again(stack: Stack) -> None:
    gateway = _proc(stack, "gateway")
    os.kill(gateway.proc.pid, signal.SIGKILL)
    _supervise_until(stack, lambda: gateway.starts == 2 and _health(stack)[0] == 200)
    assert _post(stack, 8).status_code == 200


def test_killed_nats_and_etcd_are_restarted_and_the_gateway_says_degraded_meanwhile(stack: Stack) -> None:
    for name in ("nats-server", "etcd"):
        server = _proc(stack, name)
        starts = server.starts
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        status, body = _health(stack)
        assert status == 200 and body["status"] in ("degraded", "ok"), body  # serving from its last view
        _supervise_until(stack, lambda s=server, n=starts: s.starts == n + 1 and _health(stack)[1].get("status") == "ok")
        assert _post(stack, 8).status_code == 200
