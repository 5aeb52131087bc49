"""End to end: the whole stack as processes (real NATS, etcd, gateway, control plane, 2P+2D engine_sim),
a slice of the real Azure conversation trace replayed through it, and the report checked against the
per-request records. Auth is on, as `poise up` has it: every process runs as its own NATS user, etcd wants a
login, the gateway an API key."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadgen.metrics import percentile, summarize
from loadgen.replay import replay
from loadgen.report import write_report
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from services.cli.stack import Stack, StackSettings

pytestmark = pytest.mark.e2e
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("stack")
    # The static planner: these tests check the plumbing and the roles they set themselves, so no policy flip
    # may move an engine under them (the default poise planner would, under the replay's load).
    settings = StackSettings(prefill=2, decode=2, gateway_port=0, monitor_port=0, run_dir=run_dir, state_dir=run_dir / ".poise",
                             model=MODEL,
                             planner_policy="static")
    s = Stack(settings, progress=print)
    s.start()
    yield s
    s.stop()


def _auth(stack: Stack) -> dict[str, str]:
    assert stack.api_key
    return {"Authorization": f"Bearer {stack.api_key}"}


def test_trace_replay_completes_every_request(stack: Stack, tmp_path: Path) -> None:
    workload = load_trace("azure-conv").slice(0.0, None, 200)
    slo = slo_for("azure-conv")

    async def go():  # type: ignore[no-untyped-def]
        return await replay(workload, stack.gateway_url, model=MODEL, rate_scale=2.0, slo=slo, timeout_s=120,
                            api_key=stack.api_key)

    result = asyncio.run(go())
    records = result.records
    assert len(records) == 200
    failed = [r for r in records if r.status != "ok"]
    assert not failed, f"{len(failed)} failed, first: {failed[0].error}"
    for r in records:
        assert r.output_tokens_received == r.output_tokens_expected, r
        assert r.first_token_s is not None and r.first_token_s <= r.finished_s

    # The report must be what the records say, recomputed independently here.
    summary = summarize(records, slo, result.wall_s)
    ttfts = [r.first_token_s - r.sent_s for r in records]  # type: ignore[operator]
    assert summary.ttft_p50_s == pytest.approx(percentile(ttfts, 50))
    met = sum(1 for r in records if r.ttft_s <= slo.ttft_s and r.tpot_s <= slo.tpot_s)  # type: ignore[operator]
    assert summary.slo_attainment == pytest.approx(met / len(records))
    files = write_report(result, tmp_path, title="e2e", slo=slo)
    doc = json.loads(files.json.read_text())
    assert doc["summary"]["requests_total"] == 200 and len(doc["records"]) == 200
    assert files.png.stat().st_size > 10_000
    # The simulated H100 serves this slice comfortably: most requests meet Arrow's SLOs.
    assert summary.slo_attainment > 0.8


def test_malformed_requests_do_not_disturb_others(stack: Stack) -> None:
    async def go() -> tuple[list[int], list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=60, trust_env=False, headers=_auth(stack)) as client:
            url = stack.gateway_url + "/v1/completions"
            good = [client.post(url, json={"model": MODEL, "prompt": list(range(50 + i)), "max_tokens": 20,
                                           "ignore_eos": True}) for i in range(6)]
            bad = [
                client.post(url, content=b"{oops", headers={"content-type": "application/json"}),
                client.post(url, content=b"{oops"),  # no content type
                client.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": -1}),
                client.post(url, json={"model": "no-such-model", "prompt": "x"}),
                client.post(url, json={"model": MODEL, "messages": "hi"}),
            ]
            responses = await asyncio.gather(*good, *bad)
            return [r.status_code for r in responses[6:]], list(responses[:6])

    bad_status, good = asyncio.run(go())
    assert bad_status == [400, 415, 400, 404, 400]
    for r in good:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 20 and body["object"] == "text_completion"


def test_chat_stream_and_non_stream(stack: Stack) -> None:
    url = stack.gateway_url + "/v1/chat/completions"
    with httpx.Client(timeout=60, trust_env=False, headers=_auth(stack)) as client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 12, "ignore_eos": True}
        r = client.post(url, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["object"] == "chat.completion" and r.json()["usage"]["completion_tokens"] == 12
        chunks = []
        with client.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            chunks = [line for line in s.iter_lines() if line.startswith("data:")]
        assert chunks[-1] == "data: [DONE]"
        payloads = [json.loads(c[5:]) for c in chunks[:-1]]
        assert all(p["object"] == "chat.completion.chunk" for p in payloads)
        assert len({p["id"] for p in payloads}) == 1
        assert payloads[-1]["usage"]["completion_tokens"] == 12


def test_admin_status_lists_instances_over_nats(stack: Stack) -> None:
    assert stack.nats is not None
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "admin", "--nats-url", stack.nats.url, "status", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    roles = sorted(i["info"]["role"] for i in doc["snapshot"]["instances"])
    assert roles == ["decode", "decode", "prefill", "prefill"]
    assert doc["services"]["planner"]["status"]["policy"]


def test_poise_bench_replays_against_the_running_gateway(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "--gateway-url", stack.gateway_url, "--model", MODEL,
         "--trace", "azure-code", "--max-requests", "20", "--rate-scale", "4", "--out-dir", str(out)],
        capture_output=True, text=True, timeout=120,
        cwd=stack.run_dir,  # as in the directory `poise up` runs in: the API key is read from ./.poise/current.json
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((out / "report.json").read_text())
    assert doc["summary"]["requests_total"] == 20 and doc["summary"]["requests_failed"] == 0
    assert doc["summary"]["token_mismatches"] == 0


def test_admin_set_role_flips_an_engine_and_back(stack: Stack) -> None:
    assert stack.nats is not None

    def admin(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "services.cli", "admin", "--nats-url", stack.nats.url, *args],  # type: ignore[union-attr]
                              capture_output=True, text=True, timeout=150)

    def roles() -> dict[str, str]:
        doc = json.loads(admin("status", "--json").stdout)
        return {i["info"]["instance_id"]: i["info"]["role"] for i in doc["snapshot"]["instances"]}

    flipped = admin("set-role", "d1", "prefill")
    assert flipped.returncode == 0, flipped.stdout + flipped.stderr
    assert roles()["d1"] == "prefill"
    # The flipped engine now serves prefill legs: requests still complete with 3 prefill + 1 decode.
    with httpx.Client(timeout=60, trust_env=False, headers=_auth(stack)) as client:
        for i in range(4):
            r = client.post(stack.gateway_url + "/v1/completions",
                            json={"model": MODEL, "prompt": list(range(30 + i)), "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200, r.text
    back = admin("set-role", "d1", "decode")
    assert back.returncode == 0, back.stdout + back.stderr
    assert roles()["d1"] == "decode"


def test_gateway_and_monitor_export_prometheus_metrics(stack: Stack) -> None:
    """Requests of its own go through the histograms (no other test's replay is needed)."""
    def ttft_count(text: str) -> float:
        return float(next(line for line in text.splitlines()
                          if line.startswith("poise_gateway_ttft_seconds_count")).split()[-1])

    with httpx.Client(timeout=60, trust_env=False) as client:
        before = ttft_count(client.get(stack.gateway_url + "/metrics").text)
        body = {"model": MODEL, "prompt": list(range(32)), "max_tokens": 3, "stream": True}
        for _ in range(3):
            assert client.post(stack.gateway_url + "/v1/completions", json=body, headers=_auth(stack)).status_code == 200
        gateway = client.get(stack.gateway_url + "/metrics").text
        monitor = client.get(stack.monitor_url + "/metrics").text
    assert ttft_count(gateway) == before + 3
    assert "poise_gateway_tpot_seconds_bucket" in gateway
    assert 'poise_instance_running_reqs{instance="p0",role="prefill"}' in monitor


def test_the_stack_runs_with_auth_on(stack: Stack) -> None:
    """The gateway wants the key; credentials are private; NATS and etcd refuse strangers."""
    with httpx.Client(timeout=30, trust_env=False) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert client.post(stack.gateway_url + "/v1/completions", json=body).status_code == 401
        assert client.post(stack.gateway_url + "/v1/completions", json=body,
                           headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(stack.gateway_url + "/health").status_code == 200  # health needs no key
        # The engines want the stack's engine key (held by the gateway and the sidecars), as SGLang's --api-key:
        # another client cannot end a stream with /abort_request, nor read the engine's state.
        engine = stack.engines["d0"]
        for method, path in (("POST", "/abort_request"), ("GET", "/v1/loads"), ("POST", "/v1/completions")):
            r = client.request(method, engine + path, json={"rid": "x"})
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (path, r.text)
        assert client.get(engine + "/health").status_code == 200 and client.get(engine + "/metrics").status_code == 200
        assert stack.credentials is not None and stack.credentials.engine_api_key
        authorized = client.get(engine + "/v1/loads", headers={"Authorization": f"bearer {stack.credentials.engine_api_key}"})
        assert authorized.status_code == 200
    for name in ("credentials.json", "stack.json"):
        assert (stack.run_dir / name).stat().st_mode & 0o777 == 0o600
    assert stack.nats is not None and stack.etcd is not None
    conf = (stack.run_dir / "nats-auth.conf").read_text()
    assert '"worker-p0"' in conf and "allow_responses" in conf
    out = subprocess.run([sys.executable, "-m", "services.cli", "admin", "--nats-url", stack.nats.plain_url,
                          "--user", "gateway", "--password", "wrong", "status"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "refused" in out.stderr


def test_no_process_was_refused_a_publish_or_subscribe(stack: Stack) -> None:
    """After everything above (replay, bench, flips with drain by migration, admin): the permission matrix let
    every process do its job; nats-server refuses quietly, so the logs are where a missing permission shows."""
    logs = {p.name: p.log_path.read_text(errors="replace") for p in stack.processes}
    refused = {name: [line for line in text.splitlines() if "permissions violation" in line][:3]
               for name, text in logs.items() if "permissions violation" in text}
    assert refused == {}
