"""POST /pd_role_switch against SGLang 0.5.23 (fixtures/sglang-0.5.23/pd_role_switch.json): the body's exact
fields, 200/400, and the preconditions with their messages and ``safe_to_restore`` in SGLang's order."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from tests.contract.conftest import Engines
from tests.contract.shapes import assert_shape, fixture

SPEC = fixture("pd_role_switch")


def _switch(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = client.post(url + "/pd_role_switch", json=body)
    payload = r.json()
    if "success" in payload:
        assert_shape(payload, SPEC["response"]["shape"], "pd_role_switch")
        assert r.status_code == (SPEC["response"]["status_on_success"] if payload["success"] else
                                 SPEC["response"]["status_on_failure"])
    return r.status_code, payload


def _precondition(check: str) -> dict[str, Any]:
    return next(p for p in SPEC["preconditions"] if p["check"] == check)


def _mode(client: httpx.Client, url: str) -> str:
    return str(client.get(url + "/v1/loads", params={"include": "disagg"}).json()["loads"][0]["disaggregation"]["mode"])


def test_refusals_before_the_instance_is_touched(engines: Engines, client: httpx.Client) -> None:
    flag = SPEC["tokenizer"][0]
    status, body = _switch(client, engines.prefill_no_switch.url, {"new_role": "decode"})
    assert (status, body["message"], body["old_role"], body["new_role"], body["safe_to_restore"]) == \
        (400, flag["message"], "prefill", "decode", flag["safe_to_restore"])

    invalid = _precondition("new_role is prefill or decode")
    for request in ({"new_role": ""}, {}):
        status, body = _switch(client, engines.prefill.url, request)
        assert (status, body["success"], body["safe_to_restore"]) == (400, False, invalid["safe_to_restore"])
        assert body["message"] == invalid["message"].format(new_role="") and body["old_role"] == "prefill"

    # Outside PdRoleSwitchReqInput.new_role's Literal: pydantic refuses the body before the handler runs.
    r = client.post(engines.prefill.url + "/pd_role_switch", json={"new_role": "bogus"})
    assert r.status_code == 400
    assert_shape(r.json(), {"ref": "#errors.json/ErrorResponse"}, "pd_role_switch")
    assert r.json()["type"] == "Bad Request"

    not_pd = _precondition("PD mode")
    status, body = _switch(client, engines.null.url, {"new_role": "decode"})
    assert (status, body["message"], body["old_role"], body["safe_to_restore"]) == \
        (400, not_pd["message"], "null", not_pd["safe_to_restore"])


def test_busy_prepare_only_and_real_switches(engines: Engines, client: httpx.Client) -> None:
    url = engines.prefill.url
    # A prefill request whose decode peer never comes waits in the bootstrap queue: the instance is busy.
    rid = f"contract-switch-{time.monotonic_ns()}"
    answer: dict[str, Any] = {}

    def submit() -> None:
        with httpx.Client(timeout=60.0, trust_env=False) as c:
            answer["r"] = c.post(url + "/generate", json={"text": "hello", "rid": rid, "bootstrap_host": "127.0.0.1",
                                                           "bootstrap_port": 1, "bootstrap_room": 12345,
                                                           "sampling_params": {"max_new_tokens": 4}})

    waiter = threading.Thread(target=submit, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while client.get(url + "/v1/loads").json()["loads"][0]["disaggregation"]["prefill_bootstrap_queue_reqs"] == 0:
        assert time.monotonic() < deadline, "the prefill request never reached the bootstrap queue"
        time.sleep(0.02)
    busy = _precondition("fully idle")
    status, body = _switch(client, url, {"new_role": "decode"})
    assert (status, body["message"], body["safe_to_restore"]) == (400, busy["message"], busy["safe_to_restore"])
    assert client.post(url + "/abort_request", json={"rid": rid}).status_code == 200
    waiter.join(10)
    assert answer["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"

    # Same role: the scheduler says "already in target role", the tokenizer answers "ok".
    status, body = _switch(client, url, {"new_role": "prefill"})
    assert (status, body["success"], body["message"], body["safe_to_restore"]) == (200, True, "ok", False)
    # prepare_only: checked, not switched.
    ready = SPEC["tokenizer"][2]
    status, body = _switch(client, url, {"new_role": "decode", "prepare_only": True})
    assert (status, body["message"]) == (400, "decode_cuda_graph_memory_gb is required before capturing decode graphs")
    status, body = _switch(client, url, {"new_role": "decode", "prepare_only": True, "decode_cuda_graph_memory_gb": 0})
    assert (status, body["success"], body["message"], body["safe_to_restore"]) == \
        (200, True, ready["message"], ready["safe_to_restore"])
    assert _mode(client, url) == "prefill"
    # The real thing, and back.
    try:
        status, body = _switch(client, url, {"new_role": "decode", "decode_cuda_graph_memory_gb": 0})
        assert (status, body["success"], body["message"], body["old_role"], body["new_role"],
                body["safe_to_restore"]) == (200, True, "ok", "prefill", "decode", False)
        assert _mode(client, url) == "decode"
        info = client.get(url + "/server_info").json()
        # The top level is the launch configuration; the live role is in internal_states (and /v1/loads).
        assert (info["disaggregation_mode"], info["internal_states"][0]["disaggregation_mode"]) == ("prefill", "decode")
        assert client.get(url + "/model_info").json()["disaggregation_mode"] == "decode"
    finally:
        status, body = _switch(client, url, {"new_role": "prefill"})
    assert (status, body["old_role"], body["new_role"]) == (200, "decode", "prefill")
    assert _mode(client, url) == "prefill"
