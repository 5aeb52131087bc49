"""``python -m services.migrator --nats-url ... --etcd-url ... [--policy none]``"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from services.migrator.config import MigratorSettings
from services.migrator.service import MigratorService
from shared.runtime import run_service
from shared.settings import configure_logging, parse_settings


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(MigratorSettings, argv, prog="python -m services.migrator")
    configure_logging(settings.log_level, "migrator")
    return asyncio.run(run_service(MigratorService(settings)))


if __name__ == "__main__":
    sys.exit(main())
