"""``python -m services.gateway``: run the gateway until SIGTERM/SIGINT."""

from __future__ import annotations

import sys

import uvicorn

from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.service import GatewayService
from shared.header_timeout import protocol_with_header_timeout
from shared.settings import configure_logging, parse_settings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(GatewaySettings, argv, prog="python -m services.gateway")
    configure_logging(settings.log_level, "gateway")
    app = create_app(GatewayService(settings))
    loop = "uvloop" if sys.platform != "win32" else "asyncio"
    # proxy_headers off: no X-Forwarded-* rewriting on the hot path (nothing here sits behind a proxy by default).
    # uvicorn reads headers without a bound: its httptools protocol with one (shared/header_timeout.py).
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", access_log=False, loop=loop,
                proxy_headers=False, server_header=False, http=protocol_with_header_timeout(settings.header_timeout_s),
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
