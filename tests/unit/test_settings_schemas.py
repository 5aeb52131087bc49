"""Every process's settings: documented fields, and the schemas in deploy/ kept in sync."""

from __future__ import annotations

import pytest

from services.cli.schemas import SCHEMA_DIR, SETTINGS, render
from shared.settings import parse_settings


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_field_is_described(name: str) -> None:
    undocumented = [f for f, info in SETTINGS[name].model_fields.items() if not info.description]
    assert not undocumented, f"{name}: fields without a description: {undocumented}"


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_committed_schema_is_current(name: str) -> None:
    path = SCHEMA_DIR / f"{name}.json"
    assert path.exists() and path.read_text() == render(SETTINGS[name]), (
        f"{path} is stale: run `python -m services.cli.schemas`")


def test_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.gateway.config import GatewaySettings

    monkeypatch.setenv("POISE_GATEWAY_PORT", "9001")
    monkeypatch.setenv("POISE_GATEWAY_RETRIES", "3")
    s = parse_settings(GatewaySettings, ["--port", "9002", "--api-keys", '["a", "b"]'])
    assert (s.port, s.retries, s.api_keys) == (9002, 3, ["a", "b"])


def test_bad_values_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    from services.gateway.config import GatewaySettings

    with pytest.raises(SystemExit):
        parse_settings(GatewaySettings, ["--port", "not-a-number"])
    assert "port" in capsys.readouterr().err
