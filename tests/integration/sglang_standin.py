"""A stand-in for an SGLang environment's Python, for the worker's supervision tests (no GPU, no sglang).

The worker runs ``<sglang_python> -c <version probe>`` and ``<sglang_python> -m sglang.launch_server <flags>``.
A wrapper script named as that interpreter runs this file with the same arguments:

- ``-c ...``: prints ``$STANDIN_SGLANG_VERSION`` (default 0.5.23), or exits 1 like a Python without sglang
  when it is ``missing``.
- ``-m sglang.launch_server --host H --port P ...``: one launch. ``$STANDIN_PLAN`` is a comma list of what
  successive launches do (the last item repeats), counted in ``$STANDIN_DIR/launches.jsonl`` (one line per
  launch: time and argv):
  - ``serve:S``: answer SGLang's ``/health``, ``/server_info`` and ``/v1/loads`` (0.5.23 shapes) for S
    seconds, then exit 1 as a crashed server does (``serve:inf``: until SIGTERM, then exit 0);
  - ``crash``: print an error and exit 1 at once, before answering anything.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def _flag(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def _launch_number(state: Path, argv: list[str]) -> int:
    state.mkdir(parents=True, exist_ok=True)
    path = state / "launches.jsonl"
    n = len(path.read_text().splitlines()) if path.exists() else 0
    with path.open("a") as f:
        f.write(json.dumps({"t": time.time(), "argv": argv}) + "\n")
    return n


def _serve(argv: list[str], seconds: float) -> int:
    host, port = _flag(argv, "--host", "127.0.0.1"), int(_flag(argv, "--port", "30000"))
    mode = _flag(argv, "--disaggregation-mode", "null")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
            elif path == "/server_info":
                self._json({"model_path": "standin", "served_model_name": "standin", "disaggregation_mode": mode,
                            "disaggregation_bootstrap_port": int(_flag(argv, "--disaggregation-bootstrap-port", "8998")),
                            "max_running_requests": None, "max_total_num_tokens": 4096, "status": "ready",
                            "internal_states": [{"disaggregation_mode": mode,
                                                 "effective_max_running_requests_per_dp": 16}],
                            "version": "0.5.23", "frontend": "python"})
            elif path == "/v1/loads":
                self._json({"timestamp": "2026-11-22T00:00:00+00:00", "version": "0.5.23", "accelerator": None,
                            "num_accelerators": 1, "loads": [{
                                "timestamp": time.time(), "dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0,
                                "num_waiting_uncached_tokens": 0, "num_used_tokens": 0, "num_total_tokens": 0,
                                "num_active_tokens": 0, "num_prealloc_ready_tokens": 0, "max_total_num_tokens": 4096,
                                "max_running_requests": 16, "token_usage": 0.0, "gen_throughput": 0.0,
                                "cache_hit_rate": 0.0, "utilization": 0.0, "total_prefill_uncached_tokens": 0,
                                "total_prefill_busy_us": 0, "decode_moments": None,
                                "disaggregation": {"mode": mode, "prefill_bootstrap_queue_reqs": 0,
                                                   "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                                                   "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                                                   "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}}]})
            else:
                self.send_response(404)
                self.send_header("content-length", "0")
                self.end_headers()

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"standin: serving on {host}:{port} as {mode} for {seconds}s", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if stop.wait(None if math.isinf(seconds) else seconds):
        server.shutdown()
        return 0  # asked to stop
    print("standin: scheduler died: simulated crash (CUDA error: an illegal memory access)", flush=True)
    return 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["-c"]:
        version = os.environ.get("STANDIN_SGLANG_VERSION", "0.5.23")
        if version == "missing":
            print("ModuleNotFoundError: No module named 'sglang'", file=sys.stderr)
            return 1
        print(version)
        return 0
    if argv[:2] != ["-m", "sglang.launch_server"]:
        print(f"standin: unexpected arguments {argv}", file=sys.stderr)
        return 2
    plan = os.environ.get("STANDIN_PLAN", "serve:inf").split(",")
    n = _launch_number(Path(os.environ["STANDIN_DIR"]), argv)
    step = plan[min(n, len(plan) - 1)]
    if step == "crash":
        print("standin: RuntimeError: CUDA out of memory while capturing graphs (simulated)", flush=True)
        return 1
    return _serve(argv[2:], float(step.split(":", 1)[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
