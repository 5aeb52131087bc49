"""Monitor settings (env prefix ``POISE_MONITOR_``, or the matching ``--flags``)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import ControlPlaneSettings, settings_config


class MonitorSettings(ControlPlaneSettings):
    """Cluster telemetry: load reports and request events into snapshots, series and Prometheus metrics."""

    model_config = settings_config("POISE_MONITOR_")

    http_host: str = Field("127.0.0.1", description="Address of the /metrics HTTP server (0.0.0.0 to let a remote Prometheus scrape it).")
    http_port: int = Field(9100, ge=0, le=65535, description="Port of the /metrics HTTP server; 0 = no HTTP server.")
    series_interval_s: float = Field(5.0, gt=0.0, description="Length of one series interval, in seconds.")
    series_length: int = Field(720, ge=1, description="How many series intervals to keep (720 x 5 s = 1 hour).")
    stale_after_s: float = Field(2.0, gt=0.0, description="A load report older than this many seconds counts as stale: the instance is reported down in /metrics (the snapshot still carries the report with its age).")
