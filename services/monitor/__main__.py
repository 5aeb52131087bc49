"""``python -m services.monitor --nats-url ... --etcd-url ... [--http-port 9100]``"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from services.monitor.config import MonitorSettings
from services.monitor.service import MonitorService
from shared.runtime import run_service
from shared.settings import configure_logging, parse_settings


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(MonitorSettings, argv, prog="python -m services.monitor")
    configure_logging(settings.log_level, "monitor")
    return asyncio.run(run_service(MonitorService(settings)))


if __name__ == "__main__":
    sys.exit(main())
