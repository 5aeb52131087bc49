"""``python -m services.planner --nats-url ... --etcd-url ... [--policy static]``"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from services.planner.config import PlannerSettings
from services.planner.service import PlannerService
from shared.runtime import run_service
from shared.settings import configure_logging, parse_settings


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(PlannerSettings, argv, prog="python -m services.planner")
    configure_logging(settings.log_level, "planner")
    return asyncio.run(run_service(PlannerService(settings)))


if __name__ == "__main__":
    sys.exit(main())
