"""engine_sim's control-plane endpoints against SGLang 0.5.23's shapes (fixtures in fixtures/sglang-0.5.23/):
health, /server_info, /model_info and /v1/models, /v1/loads (JSON sections, include, dp_rank, Prometheus
format), /metrics families and labels, the bootstrap server's health, /abort_request and /flush_cache."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shared.engine_client import parse_loads, parse_server_info
from tests.contract.conftest import Engines
from tests.contract.extensions import (
    EXTENSIONS,
    LOADS_PROMETHEUS_EXTENSIONS,
    METRIC_EXTENSIONS,
    OMISSIONS,
)
from tests.contract.shapes import assert_shape, fixture, shape

SERVER_ARGS = set(fixture("cli_flags")["server_args_fields"])
# /server_info keys that are not server args: build_server_info + the http handler (fixture server_info.json).
SERVER_INFO_OWN = {"launch_command", "status", "max_total_num_tokens", "max_req_input_len", "startup_time",
                   "hicache_object_layout", "kv_event_sources", "kv_events", "internal_states", "version", "frontend"}
INTERNAL_STATE_OWN = {"world_size", "startup_time", "effective_max_running_requests_per_dp", "last_gen_throughput",
                      "memory_usage", "disaggregation_mode", "decode_cuda_graph_bs", "decode_cuda_graph_memory_gb"}


def _role(engines: Engines, role: str) -> Any:
    return {"null": engines.null, "prefill": engines.prefill, "decode": engines.decode}[role]


def test_health_endpoints(engines: Engines, client: httpx.Client) -> None:
    spec = fixture("health")["endpoints"]
    for engine in engines.all():
        for path in ("/health", "/health_generate", "/ready"):
            r = client.get(engine.url + path)
            assert (r.status_code, r.text) == (spec[f"GET {path}"]["ok"]["status"], spec[f"GET {path}"]["ok"]["body"])


def test_bootstrap_server_health(engines: Engines, client: httpx.Client) -> None:
    ok = fixture("bootstrap_server")["endpoints"]["GET /health"]["ok"]
    r = client.get(f"http://127.0.0.1:{engines.prefill.bootstrap_port}/health")
    assert (r.status_code, r.text) == (ok["status"], ok["body"])
    assert r.headers["content-type"].startswith(ok["content_type"])


def test_server_info(engines: Engines, client: httpx.Client) -> None:
    for engine, mode in ((engines.null, "null"), (engines.prefill, "prefill"), (engines.decode, "decode")):
        body = client.get(engine.url + "/server_info").json()
        assert_shape(body, {"ref": "ServerInfo"}, "server_info", extensions=EXTENSIONS, omissions=OMISSIONS)
        # Beyond the described keys, SGLang sends resolved server args only; engine_sim's others are extensions.
        stray = set(body) - SERVER_ARGS - SERVER_INFO_OWN - EXTENSIONS["ServerInfo"]
        assert not stray, f"/server_info keys that are neither ServerArgs fields nor listed extensions: {stray}"
        for state in body["internal_states"]:
            stray = set(state) - SERVER_ARGS - INTERNAL_STATE_OWN - EXTENSIONS["InternalState"]
            assert not stray, f"internal_states keys that are neither SGLang's nor listed extensions: {stray}"
        assert body["disaggregation_mode"] == body["internal_states"][0]["disaggregation_mode"] == mode
        # What Poise reads from it (shared/engine_client.py).
        info = parse_server_info(body)
        assert info.disaggregation_mode == mode and info.max_total_num_tokens and info.served_model_name
        assert info.disaggregation_bootstrap_port == (engine.bootstrap_port if mode != "decode" else
                                                      body["disaggregation_bootstrap_port"])
    body = client.get(engines.prefill_no_switch.url + "/get_server_info").json()  # the deprecated alias
    assert body["enable_pd_role_switch"] is False


def test_model_info_and_models(engines: Engines, client: httpx.Client) -> None:
    spec = fixture("model_info")["endpoints"]
    info = client.get(engines.null.url + "/model_info").json()
    assert_shape(info, spec["GET /model_info"]["shape"], "model_info")
    assert client.get(engines.null.url + "/get_model_info").json()["served_model_name"] == info["served_model_name"]
    models = client.get(engines.null.url + "/v1/models")
    assert models.status_code == 200
    assert_shape(models.json(), spec["GET /v1/models"]["shape"], "model_info")
    name = info["served_model_name"]
    assert [m["id"] for m in models.json()["data"]] == [name]
    card = client.get(engines.null.url + f"/v1/models/{name}")
    assert card.status_code == 200
    assert_shape(card.json(), spec["GET /v1/models/{served_model_name}"]["shape"], "model_info")
    missing = client.get(engines.null.url + "/v1/models/no-such-model")
    assert missing.status_code == spec["GET /v1/models/{other}"]["status"]
    assert_shape(missing.json(), spec["GET /v1/models/{other}"]["shape"], "model_info")


def test_v1_loads_json(engines: Engines, client: httpx.Client) -> None:
    spec = fixture("v1_loads")
    sections = spec["include"]["sections_by_name"]
    for role in ("null", "prefill", "decode"):
        engine = _role(engines, role)
        for include, expected in spec["include"]["cases"].items():
            params = {"include": include} if include else {}
            r = client.get(engine.url + "/v1/loads", params=params)
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            body = r.json()
            assert_shape(body, spec["response"]["shape"], "v1_loads", extensions=EXTENSIONS)
            assert len(body["loads"]) == 1
            rank = body["loads"][0]
            present = [k for k in sections.values() if k in rank]
            assert present == expected, (include, present)
            assert rank["dp_rank"] == 0
            if "disaggregation" in rank:
                assert rank["disaggregation"]["mode"] == role
        # What the sidecar asks for and how it reads it (shared/engine_client.py EngineClient.loads).
        loads = parse_loads(client.get(engine.url + "/v1/loads", params={"include": "core,disagg"}).json())
        assert loads.dp_ranks == 1 and loads.mode == role and loads.max_total_num_tokens > 0 and loads.idle
        out_of_range = client.get(engine.url + "/v1/loads", params={"dp_rank": 1}).json()
        assert out_of_range["loads"] == spec["dp_rank"]["out_of_range"]["loads"]


def test_v1_loads_bad_include_and_prometheus(engines: Engines, client: httpx.Client) -> None:
    spec = fixture("v1_loads")
    bad = client.get(engines.decode.url + "/v1/loads", params={"include": "core,bogus"})
    intended = spec["invalid_include"]["intended"]
    assert bad.status_code == intended["status"]
    assert_shape(bad.json(), intended["shape"], "v1_loads")
    assert bad.json()["type"] == intended["type"] and bad.json()["message"].startswith(intended["message_prefix"])

    prom = spec["prometheus"]
    r = client.get(engines.decode.url + "/v1/loads", params={"format": "prometheus"})
    assert r.status_code == 200 and r.headers["content-type"] == prom["content_type"]
    names = set()
    for line in r.text.strip().splitlines():
        assert any(re.match(p, line) for p in prom["line_patterns"]), line
        if not line.startswith("#"):
            names.add(line.split("{")[0])
    core = {f"sglang_{k}" for k in shape("LoadSnapshot", "v1_loads")["fields"] if k not in ("dp_rank", "decode_moments")}
    disagg = {f"sglang_disagg_{k}" for k in shape("LoadSnapshot", "v1_loads")["more_fields"]["disaggregation"]["fields"]
              if k != "mode"}
    assert core | disagg <= names
    stray = {n for n in names if not re.match(r"sglang_(memory|queues|disagg|spec|lora)_", n)} - core \
        - LOADS_PROMETHEUS_EXTENSIONS
    assert not stray, stray


def test_metrics_families_and_labels(engines: Engines, client: httpx.Client) -> None:
    families = fixture("metrics")["metrics"]
    labels = fixture("metrics_labels")
    scheduler_required = set(labels["scheduler_labels"]["required"])
    allowed = scheduler_required | set(labels["scheduler_labels"]["optional"]) | {"is_streaming", "le", "quantile"}
    for engine, engine_type in ((engines.prefill, "dynamic"), (engines.prefill_no_switch, "prefill")):
        text = client.get(engine.url + "/metrics").text
        seen = set()
        for family in text_string_to_metric_families(text):
            if family.name in METRIC_EXTENSIONS or family.name.removesuffix("_created") in METRIC_EXTENSIONS:
                continue
            base = family.name.removesuffix("_created")
            if base != family.name and (base + "_total" in families or base in families):
                continue  # prometheus_client's *_created series of a counter or histogram (SGLang has them too)
            # prometheus_client strips a counter's _total suffix from the family name.
            name = family.name + "_total" if family.type == "counter" else family.name
            assert name in families, f"{name} is not an sglang 0.5.23 metric"
            assert family.type == families[name]["type"], (name, family.type, families[name])
            seen.add(name)
            # A family's own label beyond the collector's (sglang/srt/observability/metrics_collector.py:1934:
            # cached_tokens_total adds cache_source, device/host/storage).
            extra = {"cache_source"} if name == "sglang:cached_tokens_total" else set()
            for sample in family.samples:
                assert set(sample.labels) <= allowed | extra, (name, sample.labels)
                assert {"model_name", "engine_type"} <= set(sample.labels), (name, sample.labels)
                if "tp_rank" in sample.labels:
                    assert scheduler_required <= set(sample.labels) and sample.labels["engine_type"] == engine_type
        assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
                "sglang:num_prefill_bootstrap_queue_reqs", "sglang:time_to_first_token_seconds"} <= seen


def _long_stream(engines: Engines, rid: str, started: threading.Event, out: dict[str, Any]) -> None:
    """A chat stream on the colocated engine that would run for a minute; records its events."""
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8000, "ignore_eos": True,
            "stream": True, "rid": rid}
    events: list[str] = []
    with httpx.Client(timeout=60.0, trust_env=False) as c, \
            c.stream("POST", engines.null.url + "/v1/chat/completions", json=body) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line:
                events.append(line)
                started.set()
    out["events"] = events


def test_abort_request_and_flush_cache(engines: Engines, client: httpx.Client) -> None:
    abort_spec = fixture("abort_request")
    flush = fixture("flush_cache")["responses"]
    idle = client.post(engines.null.url + "/flush_cache")
    assert (idle.status_code, idle.text) == (flush["idle"]["status"], flush["idle"]["body"])
    assert "content-type" not in idle.headers
    negative = client.get(engines.null.url + "/flush_cache", params={"timeout": "-1"})
    assert negative.status_code == 400
    assert_shape(negative.json(), flush["timeout<0"]["shape"], "flush_cache")
    assert negative.json()["type"] == flush["timeout<0"]["type"]

    unknown = client.post(engines.null.url + "/abort_request", json={"rid": "no-such-request"})
    assert (unknown.status_code, unknown.text) == (abort_spec["semantics"]["unknown_rid"]["status"],
                                                   abort_spec["semantics"]["unknown_rid"]["body"])
    rid = f"contract-abort-{time.monotonic_ns()}"
    started, out = threading.Event(), {}
    reader = threading.Thread(target=_long_stream, args=(engines, rid, started, out), daemon=True)
    reader.start()
    assert started.wait(20), "the stream did not start"
    busy = client.post(engines.null.url + "/flush_cache")
    assert (busy.status_code, busy.text) == (flush["busy, timeout=0"]["status"], flush["busy, timeout=0"]["body"])
    busy = client.post(engines.null.url + "/flush_cache", params={"timeout": "0.2"})
    assert (busy.status_code, busy.text) == (flush["busy past timeout>0"]["status"],
                                             flush["busy past timeout>0"]["body"])

    r = client.post(engines.null.url + "/abort_request", json={"rid": rid, "abort_all": False})
    assert (r.status_code, r.text) == (abort_spec["response"]["status"], abort_spec["response"]["body"])
    reader.join(20)
    assert not reader.is_alive() and out["status"] == 200
    events = out["events"]
    assert events[-1] == "data: [DONE]"
    last = httpx.Response(200, content=events[-2][len("data: "):]).json()
    # A user abort is not an error: the stream ends with finish_reason "abort", then [DONE].
    assert "error" not in last and last["choices"][0]["finish_reason"] == "abort"
    assert_shape(last, {"ref": "StreamChunk"}, "openai_chat_completions")
