"""``python -m services.worker --instance-id p0 --role prefill --engine-kind sim --nats-url ... --etcd-url ...``"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from services.worker.config import WorkerSettings
from services.worker.sidecar import WorkerService
from shared.runtime import run_service
from shared.settings import configure_logging, parse_settings


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(WorkerSettings, argv, prog="python -m services.worker")
    configure_logging(settings.log_level, f"worker[{settings.instance_id}]")
    if settings.log_level.upper() != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /v1/loads poll (4 Hz) is noise
    service = WorkerService(settings)
    # A retire (admin verb) sets exit_requested: the process then stops exactly as on SIGTERM. So does a
    # supervisor that gave up on a crashing engine, which must not look like a clean exit to whoever runs us.
    code = asyncio.run(run_service(service, stop_event=service.exit_requested))
    if service.fatal_error is not None:
        print(f"worker {settings.instance_id}: {service.fatal_error}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
