"""engine_sim's --api-key decides as SGLang's does (sglang/srt/utils/auth.py, NORMAL endpoints)."""

from __future__ import annotations

import pytest

from services.engine_sim.auth import allowed


@pytest.mark.parametrize(("method", "path", "header", "ok"), [
    ("POST", "/abort_request", "Bearer k3y", True),
    ("POST", "/abort_request", "bearer k3y", True),  # the scheme is case-insensitive
    ("POST", "/abort_request", "Bearer k3", False),
    ("POST", "/abort_request", "k3y", False),
    ("POST", "/abort_request", None, False),
    ("GET", "/v1/loads", "Basic k3y", False),
    ("GET", "/health", None, True),  # probes and scrapes need no secret
    ("GET", "/health_generate", None, True),
    ("GET", "/metrics", None, True),
    ("OPTIONS", "/v1/completions", None, True),
])
def test_bearer_key_everywhere_but_health_and_metrics(method: str, path: str, header: str | None, ok: bool) -> None:
    assert allowed(method, path, header, "k3y") is ok
