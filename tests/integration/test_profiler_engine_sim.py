"""``poise profile`` against a real engine_sim process running a known profile: the fit recovers it.

The engine runs the built-in ``llama-3.1-8b-h100`` profile at time scale 4 (every modelled time x4: engine_sim's
steps end within about a millisecond of their modelled time, its event loop's timer being whole milliseconds,
and that has to be small next to an 8 ms launch overhead; the profiler divides the scale out) with 2048-token
prefill chunks (prompts of a few thousand tokens cross several chunk boundaries, which is what tells the
per-pass overhead apart). All six timing coefficients must come back within 5%: the prefill overhead,
per-token and per-token² terms (TTFT) and the decode overhead, per-sequence and per-context-token terms
(TPOT). About 50 s here, nearly all of it the engine's modelled time (it sleeps, so a busy machine does not
slow it down; the fits leave out what a stall stretched).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from services.profiler.cli import cmd_profile
from services.profiler.profile_doc import MEASURED_FIELDS
from shared.errors import PoiseError
from shared.latency import DEFAULT_PROFILE, LatencyModel, load_profile
from tests.integration.engine_procs import Engine, free_port, start_engine, stop, wait_healthy

TIME_SCALE = 4.0
CHUNK = 2048
TOLERANCE = 0.05
PROFILE_ARGS = ["--max-prefill-tokens", str(4 * CHUNK + 64), "--prefill-repeats", "3", "--batch-sizes", "[1, 16, 256]",
                "--decode-context-tokens", "32768", "--decode-max-prompt", "8192", "--decode-steps", "40"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    tmp = tmp_path_factory.mktemp("profiler")
    started = start_engine(tmp, "null", "--profile", DEFAULT_PROFILE, "--chunked-prefill-size", str(CHUNK),
                           time_scale=TIME_SCALE, name="profiler")
    try:
        wait_healthy([started])
        yield started
    finally:
        stop([started])


def test_profile_recovers_the_engines_coefficients(engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "fitted.json"
    assert cmd_profile(["--engine", engine.url, "--out", str(out), *PROFILE_ARGS]) == 0

    truth = load_profile(DEFAULT_PROFILE)
    fitted = load_profile(out)  # what engine_sim, the planner, the gateway and the simulator do with it
    LatencyModel(fitted).decode_step_time_s(64, 64 * 1500)
    errors = {f: getattr(fitted, f) / getattr(truth, f) - 1 for f in MEASURED_FIELDS}
    print("\nrecovery error vs", DEFAULT_PROFILE, {f: f"{e:+.2%}" for f, e in errors.items()})
    assert all(abs(e) <= TOLERANCE for e in errors.values()), errors

    # Fields the engine reports come from /server_info; the rest from the profile it emulates.
    assert fitted.chunked_prefill_size == CHUNK and fitted.kv_capacity_tokens == truth.kv_capacity_tokens
    assert fitted.kv_bytes_per_token == truth.kv_bytes_per_token
    doc = json.loads(out.read_text())["profiling"]
    assert doc["time_scale"] == TIME_SCALE and doc["engine_url"] == engine.url
    assert doc["fields"]["decode_s_per_seq"] == "measured" and doc["fields"]["role_switch_s"].startswith("base:")
    # The decode steps are timed on the host's clock: beside a CPU-heavy job on 2 cores their fit read 0.978
    # while every coefficient stayed within TOLERANCE (checked above), so the bar is the fit's shape, not its noise.
    assert doc["prefill"]["fit"]["stats"]["r2"] > 0.999 and doc["decode"]["fit"]["stats"]["r2"] > 0.95
    assert doc["server_info"]["engine"] == "poise-engine-sim"
    assert {s["context_source"] for s in doc["decode"]["samples"]} == {"num_used_tokens"}
    assert out.with_suffix(".md").read_text().startswith("# Latency profile")
    assert out.with_suffix(".png").stat().st_size > 10_000

    loads = httpx.get(engine.url + "/v1/loads").json()["loads"][0]  # every profiling request is gone
    assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 0 and loads["num_used_tokens"] == 0


def test_unreachable_engine_is_a_clear_error() -> None:
    with pytest.raises(PoiseError, match="cannot reach the engine"):
        cmd_profile(["--engine", f"http://127.0.0.1:{free_port()}"])


class _NotSGLang(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b'{"detail": "Not Found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_server_that_is_not_sglang_is_refused() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(PoiseError, match="does not look like an SGLang server"):
            cmd_profile(["--engine", f"http://127.0.0.1:{server.server_address[1]}"])
    finally:
        server.shutdown()
        server.server_close()


def test_an_engine_with_an_api_key_is_profiled_with_it(tmp_path: Path) -> None:
    """A production engine runs with ``--api-key``: without the key the profiler says what to pass; with it, the
    run measures, and the key given on the command line is not written into the profile."""
    key = "s3cret-engine-key"
    started = start_engine(tmp_path, "null", f"--api-key={key}", time_scale=TIME_SCALE, name="keyed")
    try:
        wait_healthy([started])
        with pytest.raises(PoiseError, match="--api-key"):
            cmd_profile(["--engine", started.url])
        out = tmp_path / "keyed.json"
        assert cmd_profile(["--engine", started.url, "--api-key", key, "--out", str(out), "--prefill-lengths",
                            "[16, 512, 2048]", "--prefill-repeats", "1", "--batch-sizes", "[1, 4]",
                            "--decode-context-tokens", "4096", "--decode-steps", "8", "--decode-segments", "1",
                            "--no-plot"]) == 0
        text = out.read_text()
        assert key not in text and "--api-key '***'" in json.loads(text)["profiling"]["command"]
        load_profile(out)
    finally:
        stop([started])
