"""The monitor: cluster telemetry (loads, request events) into snapshots, rolling series and Prometheus metrics."""
