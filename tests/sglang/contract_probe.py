"""The contract fixtures (tests/contract/fixtures/sglang-0.5.23/, read from the wheel's source) against a running
SGLang: the same requests the contract suite sends engine_sim, sent to a real prefill/decode pair, each answer
checked against the fixture's shape with no extensions or omissions allowed.

:func:`probe` returns ``{probe name: {"status", "answer", "mismatches"}}``. The real-SGLang tier asserts that
no probe has a mismatch left; ``python -m tests.sglang.contract_probe --prefill URL --decode URL --bootstrap-port
N [--api-key K] --out DIR`` writes the real answers (``DIR/<probe>.json``) and the mismatches
(``DIR/mismatches.json``): that is how the recorded fixtures in tests/contract/fixtures/sglang-0.5.23-cpu/ were
made."""

from __future__ import annotations

import argparse
import json
import random
import re
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.contract.shapes import check as check_shape
from tests.contract.shapes import fixture

METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)")


def _sse(response: httpx.Response) -> tuple[list[Any], list[str]]:
    """SSE payloads of a stream and what breaks SGLang's framing (``data: <json>\\n\\n`` events, [DONE] last)."""
    problems: list[str] = []
    text = response.text
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        problems.append(f"content-type {response.headers.get('content-type')!r}")
    if not text.endswith("\n\n"):
        problems.append("stream does not end with a blank line")
    events = text[:-2].split("\n\n") if text.endswith("\n\n") else text.split("\n\n")
    payloads = []
    for event in events:
        if not event.startswith("data: ") or "\n" in event:
            problems.append(f"not an SSE data event: {event[:80]!r}")
            continue
        payloads.append(event[len("data: "):])
    if not payloads or payloads[-1] != "[DONE]":
        problems.append("no data: [DONE] at the end")
    return [json.loads(p) for p in payloads if p != "[DONE]"], problems


class Pair:
    """A real prefill/decode pair reached directly (not through Poise)."""

    def __init__(self, prefill: str, decode: str, bootstrap_port: int, api_key: str | None = None) -> None:
        self.prefill, self.decode, self.bootstrap_port = prefill.rstrip("/"), decode.rstrip("/"), bootstrap_port
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=120.0, trust_env=False, headers=headers)

    def pd(self, path: str, body: dict[str, Any], decode_extra: dict[str, Any]) -> httpx.Response:
        """A request as Poise's gateway sends it: the same body, rid and bootstrap fields to both engines."""
        room = random.getrandbits(63)
        base = {**body, "rid": f"probe-{room}", "bootstrap_host": "127.0.0.1",
                "bootstrap_port": self.bootstrap_port, "bootstrap_room": room}
        leg = threading.Thread(target=lambda: self.http.post(self.prefill + path, json={**base, "stream": False}),
                               daemon=True)
        leg.start()
        try:
            return self.http.post(self.decode + path, json={**base, **decode_extra})
        finally:
            leg.join(120)


def probe(pair: Pair, **allowed: Any) -> dict[str, dict[str, Any]]:
    """``allowed``: ``extensions`` / ``omissions`` for :func:`check` (engine_sim's documented ones; none for
    SGLang)."""
    completions, chat, loads, info = (fixture(n) for n in ("openai_completions", "openai_chat_completions",
                                                              "v1_loads", "server_info"))
    out: dict[str, dict[str, Any]] = {}

    def check(value: Any, spec: Any, doc: str) -> list[str]:
        return check_shape(value, spec, doc, **allowed)

    def record(name: str, status: int, answer: Any, mismatches: list[str]) -> None:
        out[name] = {"status": status, "answer": answer, "mismatches": mismatches}

    text = {"model": "m", "prompt": "Tell me a story", "max_tokens": 8, "ignore_eos": True}
    r = pair.pd("/v1/completions", text, {"stream": False})
    record("completion", r.status_code, r.json(), check(r.json(), completions["response"]["shape"], "openai_completions"))
    r = pair.pd("/v1/completions", text, {"stream": True, "stream_options": {"include_usage": True,
                                                                             "continuous_usage_stats": True}})
    chunks, framing = _sse(r)
    problems = framing + [m for c in chunks[:-1] for m in check(c, completions["stream"]["chunk"], "openai_completions")]
    problems += check(chunks[-1], completions["stream"]["final_usage_chunk"]["shape"], "openai_completions") if chunks else []
    record("completion_stream", r.status_code, chunks, problems)
    messages = {"model": "m", "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 8,
                "ignore_eos": True}
    r = pair.pd("/v1/chat/completions", messages, {"stream": False})
    record("chat", r.status_code, r.json(), check(r.json(), chat["response"]["shape"], "openai_chat_completions"))
    r = pair.pd("/v1/chat/completions", messages, {"stream": True, "stream_options": {"include_usage": True}})
    chunks, framing = _sse(r)
    problems = framing + [m for c in chunks[:-1] for m in check(c, chat["stream"]["chunk"], "openai_chat_completions")]
    record("chat_stream", r.status_code, chunks, problems)
    for role, url in (("prefill", pair.prefill), ("decode", pair.decode)):
        r = pair.http.get(url + "/v1/loads", params={"include": "core,disagg"})
        record(f"v1_loads_{role}", r.status_code, r.json(), check(r.json(), loads["response"]["shape"], "v1_loads"))
        r = pair.http.get(url + "/server_info")
        record(f"server_info_{role}", r.status_code, r.json(), check(r.json(), info["response"]["shape"], "server_info"))
    r = pair.http.post(pair.decode + "/v1/completions", json={"model": "m", "prompt": "", "max_tokens": 4})
    record("error_empty_prompt", r.status_code, r.json(),
           check(r.json(), {"ref": "ErrorResponse"}, "errors") + ([] if r.status_code == 400 else [f"HTTP {r.status_code}"]))
    r = pair.http.post(pair.prefill + "/pd_role_switch", json={"new_role": "decode"})
    switch = fixture("pd_role_switch")
    record("role_switch_to_decode_without_graph_memory", r.status_code, r.json(),
           check(r.json(), switch["response"]["shape"], "pd_role_switch")
           + ([] if r.status_code == switch["response"]["status_on_failure"] else [f"HTTP {r.status_code}"]))
    names = sorted({m.group(1) for line in pair.http.get(pair.decode + "/metrics").text.splitlines()
                    if (m := METRIC_LINE.match(line)) and line.startswith("sglang:")})
    known = set(fixture("metrics")["metrics"])

    def family(sample: str) -> str:  # a histogram's or summary's sample name -> its family
        for suffix in ("_bucket", "_sum", "_count", "_created"):
            if sample.endswith(suffix) and sample.removesuffix(suffix) in known:
                return sample.removesuffix(suffix)
        return sample

    record("metrics_decode", 200, names, [f"{n} is not in metrics.json" for n in names if family(n) not in known])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--bootstrap-port", type=int, required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    results = probe(Pair(args.prefill, args.decode, args.bootstrap_port, args.api_key))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, result in results.items():
        (args.out / f"{name}.json").write_text(json.dumps(result["answer"], indent=1, sort_keys=True) + "\n")
    mismatches = {n: r["mismatches"] for n, r in results.items() if r["mismatches"]}
    (args.out / "mismatches.json").write_text(json.dumps(mismatches, indent=1) + "\n")
    print(json.dumps(mismatches, indent=1))


if __name__ == "__main__":
    main()
