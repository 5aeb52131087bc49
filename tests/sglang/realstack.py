"""The stack `poise up --engines sglang-cpu` runs, for the real-SGLang tier: real SGLang 0.5.23 engines on this
CPU behind Poise's gateway, planner, monitor and migrator, with auth on. Helpers reach it as a user would: the
official ``openai`` client, ``poise admin`` (a subprocess, over NATS) and the engines' own HTTP API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.cli.stack import Stack, StackSettings
from services.worker.presets import SGLANG_CPU_MODEL, sglang_cpu_venv

MODEL = SGLANG_CPU_MODEL
REPO = Path(__file__).resolve().parents[2]


def require_sglang_cpu() -> None:
    """Skip the test when SGLang for CPU is not installed; fail instead where ``make test`` installed it
    (POISE_REQUIRE_SGLANG=1), so a broken install cannot pass as a skip."""
    unsupported = os.environ.get("POISE_SGLANG_UNSUPPORTED")
    if unsupported:
        pytest.skip(f"SGLang for CPU cannot run here: {unsupported}")
    venv = sglang_cpu_venv()
    missing = [p for p in (venv / "bin" / "python", venv / "models" / "smollm2-135m" / "config.json") if not p.exists()]
    if not missing:
        return
    reason = f"SGLang for CPU is not installed ({', '.join(map(str, missing))} missing): run make sglang-setup"
    if os.environ.get("POISE_REQUIRE_SGLANG") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@contextmanager
def real_stack(state: Path, **settings: Any) -> Iterator[Stack]:
    """A stack on sglang-cpu engines (static planner unless told otherwise), stopped on exit."""
    require_sglang_cpu()
    fields: dict[str, Any] = {"engines": "sglang-cpu", "gateway_port": 0, "monitor_port": 0, "state_dir": state,
                              "run_dir": state / "run", "planner_policy": "static", **settings}
    stack = Stack(StackSettings(**fields), progress=print)
    t0 = time.monotonic()
    stack.start()
    print(f"real-SGLang stack up in {time.monotonic() - t0:.1f}s")
    try:
        yield stack
    finally:
        stack.stop()


def client(stack: Stack, **kw: Any) -> openai.OpenAI:
    """The official client, pointed at Poise's gateway (no retries: a failure here must show)."""
    return openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=stack.api_key or "none", max_retries=0,
                         timeout=kw.pop("timeout", 300.0), **kw)


def engine_get(stack: Stack, instance_id: str, path: str) -> httpx.Response:
    """GET on an engine itself, with the stack's engine key (as the gateway and the sidecars send it)."""
    assert stack.credentials is not None and stack.credentials.engine_api_key
    headers = {"Authorization": f"Bearer {stack.credentials.engine_api_key}"}
    return httpx.get(stack.engines[instance_id] + path, headers=headers, timeout=10.0, trust_env=False)


def engine_loads(stack: Stack, instance_id: str) -> dict[str, Any]:
    """The engine's own ``/v1/loads`` rank 0 (with the disaggregation section)."""
    body = engine_get(stack, instance_id, "/v1/loads?include=core,disagg").json()
    return dict(body["loads"][0])


def engine_busy(stack: Stack, instance_id: str) -> bool:
    rank = engine_loads(stack, instance_id)
    disagg = rank.get("disaggregation") or {}
    queued = sum(v for k, v in disagg.items() if k.endswith("_queue_reqs") and isinstance(v, int))
    return bool(rank["num_running_reqs"] or rank["num_waiting_reqs"] or queued)


def admin(stack: Stack, *args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    """``poise admin ARGS`` against this stack, as the operator runs it."""
    assert stack.nats is not None and stack.credentials is not None
    cmd = [sys.executable, "-m", "services.cli", "admin", "--nats-url", stack.nats.plain_url,
           "--namespace", stack.settings.namespace, "--user", "admin", "--timeout-s", "10", *args]
    env = {**os.environ, "POISE_ADMIN_NATS_PASSWORD": stack.credentials.nats_password("admin")}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def instances(stack: Stack) -> dict[str, dict[str, Any]]:
    """The monitor's view (``poise admin status --json``): instance id -> {info, load}."""
    done = admin(stack, "status", "--json", timeout_s=60)
    assert done.returncode == 0, done.stderr
    return {i["info"]["instance_id"]: i for i in json.loads(done.stdout)["snapshot"]["instances"]}


def until(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    """Return once ``predicate()`` holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout_s:.0f}s")
        time.sleep(poll_s)


def serving(stack: Stack, roles: dict[str, str], timeout_s: float = 300.0) -> None:
    """Wait until every engine in ``roles`` is registered ready in that role (a restart takes a minute here)."""
    def ready() -> bool:
        try:
            seen = instances(stack)
        except (AssertionError, ValueError, subprocess.TimeoutExpired):
            return False
        return all(i in seen and seen[i]["info"]["role"] == r and seen[i]["info"]["status"] == "ready"
                   for i, r in roles.items())
    until(ready, timeout_s, f"engines ready as {roles}", poll_s=1.0)


def greedy(stack: Stack, prompt: str, max_tokens: int, **extra: Any) -> str:
    """A non-streamed greedy completion's text."""
    out = client(stack).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True, **extra})
    return out.choices[0].text


def decoding_on(stack: Stack) -> str:
    """The decode engine running the one request in flight (as its /v1/loads says: a snapshot SGLang publishes
    after each batch, so it is polled)."""
    busy: list[str] = []

    def one() -> bool:
        busy[:] = [i for i in ("d0", "d1") if engine_loads(stack, i)["num_running_reqs"]]
        return len(busy) == 1

    until(one, 20, "exactly one decode engine running the request")
    return busy[0]


class Streamed:
    """A greedy streamed completion read on a thread: its text so far, its id and where it decoded."""

    def __init__(self, stack: Stack, max_tokens: int, prompt: str = "Describe the sea in detail.") -> None:
        self.stack, self.max_tokens, self.prompt = stack, max_tokens, prompt
        self.parts: list[str] = []
        self.rid = ""
        self.finish: str | None = None
        self.usage: dict[str, int] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        headers = {"Authorization": f"Bearer {self.stack.api_key}"}
        try:
            with httpx.Client(timeout=300, trust_env=False, headers=headers) as h, \
                    h.stream("POST", self.stack.gateway_url + "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                self.rid = r.headers["x-request-id"]
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    for choice in event.get("choices") or []:
                        self.parts.append(choice["text"])
                        self.finish = choice.get("finish_reason") or self.finish
                    self.usage = event.get("usage") or self.usage
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def result(self, timeout_s: float = 300) -> Streamed:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not finish"
        if self.error is not None:
            raise self.error
        return self
