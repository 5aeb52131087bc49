"""Process entry point: settings from flags/env, one uvicorn server for the API (the engine runs the
bootstrap server itself while it is a prefill engine), clean shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence

import uvicorn

from services.engine_sim.app import create_app
from services.engine_sim.config import EngineSimSettings
from services.engine_sim.engine import SimEngine
from shared.errors import ConfigError
from shared.settings import configure_logging, parse_settings

log = logging.getLogger("services.engine_sim")


def _loop_factory() -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    try:
        import uvloop
    except ImportError:
        return "asyncio", None
    return "uvloop", uvloop.new_event_loop


async def serve(settings: EngineSimSettings, loop_name: str = "asyncio") -> None:
    engine = SimEngine(settings)
    config = uvicorn.Config(
        create_app(engine),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        loop=loop_name,  # informational here: the loop is already running (main() picks uvloop if installed)
        lifespan="on",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,  # open streams get this long to finish after SIGTERM
        backlog=4096,
    )
    server = uvicorn.Server(config)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        bootstrap = f" bootstrap_port={engine.bootstrap_port}" if engine.bootstrap_port is not None else ""
        log.info(
            "engine_sim %s up: mode=%s port=%d%s profile=%s (%s on %s) time_scale=%g model=%s loop=%s",
            settings.instance_id, engine.mode, settings.port, bootstrap, engine.profile.name, engine.profile.model,
            engine.profile.gpu, settings.time_scale, settings.served_model_name, loop_name,
        )

    # Fault injection for tests and drills: SIGUSR1 freezes the scheduler (the HTTP server keeps answering,
    # /health stops answering 200, as SGLang's does for a hung scheduler); SIGUSR2 thaws it.
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, engine.freeze)
    loop.add_signal_handler(signal.SIGUSR2, engine.thaw)
    announcer = asyncio.create_task(announce())
    try:
        await server.serve()  # captures SIGINT/SIGTERM, drains, runs the lifespan shutdown (engine.stop)
    finally:
        announcer.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(EngineSimSettings, argv, prog="python -m services.engine_sim")
    configure_logging(settings.log_level, "engine_sim")
    loop_name, factory = _loop_factory()
    # uvicorn re-raises a captured signal after its graceful shutdown; with these handlers in place that
    # re-raise is a no-op, so a SIGTERM'd engine exits 0 after cleaning up instead of dying by the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(settings, loop_name))
    except ConfigError as exc:
        print(f"engine_sim: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"engine_sim: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
