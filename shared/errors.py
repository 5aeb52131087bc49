"""One error root for Poise, with typed subclasses that carry what a handler needs to answer."""

from __future__ import annotations


class PoiseError(Exception):
    """Root of every error Poise raises on purpose."""


class ConfigError(PoiseError, ValueError):
    """A setting or a profile file is invalid."""


class ProtocolError(PoiseError, ValueError):
    """A message on the bus or in the registry could not be decoded."""


class NoCapacity(PoiseError):
    """No prefill/decode pair can take the request right now.

    ``retryable`` distinguishes overload (HTTP 429: back off and retry) from an empty or unhealthy
    cluster (HTTP 503: nothing to route to).
    """

    def __init__(self, reason: str, *, retryable: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable


class EngineError(PoiseError):
    """An engine answered with an error or could not be reached."""

    def __init__(self, engine_id: str, message: str, *, status: int | None = None) -> None:
        super().__init__(f"engine {engine_id}: {message}")
        self.engine_id = engine_id
        self.status = status


class BusTimeout(PoiseError, TimeoutError):
    """A NATS request got no reply in time."""


class EngineTimeout(EngineError, TimeoutError):
    """An engine did not answer within the call's timeout."""
