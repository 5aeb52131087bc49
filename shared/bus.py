"""The NATS adapter: typed publish/subscribe and request/reply over nats-py, with reconnects.

Services hold one :class:`Bus`. Messages are the structs of :mod:`shared.protocol`; a message that does
not decode is logged and dropped (one bad publisher must not stop a subscriber). nats-py reconnects by
itself once connected; :meth:`Bus.connect` also retries the *first* connection, so processes may start
before nats-server is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.protocol.parser import AUTHORIZATION_VIOLATION, PERMISSIONS_ERR

from shared.errors import BusTimeout, PoiseError, ProtocolError
from shared.protocol import decode, encode
from shared.security import redact_url

log = logging.getLogger(__name__)

M = TypeVar("M", bound=msgspec.Struct)
R = TypeVar("R", bound=msgspec.Struct)


class Bus:
    """One NATS connection of one process."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        user: str | None = None,
        password: str | None = None,
        connect_timeout_s: float = 30.0,
    ) -> None:
        self._servers = [u.strip() for u in url.split(",") if u.strip()]
        self._name = name
        self._user = user
        self._password = password
        self._connect_timeout_s = connect_timeout_s
        self._nc: NatsClient | None = None
        self._closing = False
        self.dropped_messages = 0  # messages that failed to decode or whose handler raised
        self._handler_tasks: set[asyncio.Task[None]] = set()  # concurrent request handlers in flight
        self.permission_errors: list[str] = []  # the latest "permissions violation" errors the server sent

    @property
    def nc(self) -> NatsClient:
        if self._nc is None:
            raise PoiseError("bus is not connected")
        return self._nc

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def connect(self) -> None:
        """Connect, retrying until ``connect_timeout_s``; credentials the server refuses fail at once."""
        nc = NatsClient()
        refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def on_error(exc: Exception) -> None:
            if not nc.is_connected and not refused.done() and _is_auth_error(exc):
                refused.set_result(exc)
            await self._on_error(exc)

        # nats-py retries the first connection by itself (max_reconnect_attempts=-1), for ever: bound it here.
        connecting = asyncio.ensure_future(nc.connect(
            servers=self._servers,
            name=self._name,
            user=self._user,
            password=self._password,
            connect_timeout=2,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # typed int, works with float
            error_cb=on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        ))
        waiters: set[asyncio.Future[Any]] = {connecting, refused}
        done, _ = await asyncio.wait(waiters, timeout=self._connect_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if connecting in done and connecting.exception() is None:
            self._nc = nc
            return
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await connecting
        with contextlib.suppress(Exception):
            await nc.close()
        where = redact_url(",".join(self._servers))
        if refused.done():
            who = f"user {self._user!r}" if self._user else "these credentials"
            raise PoiseError(f"NATS at {where} refused {who}: {refused.result()}")
        cause = connecting.exception() if connecting.done() and not connecting.cancelled() else None
        raise PoiseError(f"cannot connect to NATS at {where} within {self._connect_timeout_s:g}s"
                         + (f": {cause}" if cause else ""))

    async def close(self) -> None:
        for task in list(self._handler_tasks):
            task.cancel()
        self._closing = True
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            try:
                await nc.drain()
            except (TimeoutError, nats.errors.Error, OSError):
                await nc.close()

    async def publish(self, subject: str, message: msgspec.Struct) -> None:
        await self.nc.publish(subject, encode(message))

    async def subscribe(
        self,
        subject: str,
        message_type: type[M],
        handler: Callable[[M, str], Awaitable[None]],
        *,
        queue: str = "",
    ) -> Subscription:
        """Call ``handler(message, subject)`` for each message; bad messages are counted and dropped."""

        async def on_msg(msg: Msg) -> None:
            try:
                message = decode(msg.data, message_type)
                await handler(message, msg.subject)
            except ProtocolError as exc:
                self.dropped_messages += 1
                log.warning("dropped message on %s: %s", msg.subject, exc)
            except Exception:  # a handler bug must not kill the subscription
                self.dropped_messages += 1
                log.exception("handler for %s failed", msg.subject)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    async def request(self, subject: str, message: msgspec.Struct, reply_type: type[R], *, timeout_s: float = 2.0) -> R:
        try:
            msg = await self.nc.request(subject, encode(message), timeout=timeout_s)
        except NoRespondersError as exc:
            raise BusTimeout(f"no service answers on {subject}") from exc
        except (TimeoutError, NatsTimeout) as exc:
            raise BusTimeout(f"no reply on {subject} within {timeout_s:.1f}s") from exc
        return decode(msg.data, reply_type)

    async def gather(self, subject: str, message: msgspec.Struct, reply_type: type[R], *,
                     timeout_s: float = 0.5) -> list[R]:
        """Ask every responder on ``subject`` and collect the replies that arrive within ``timeout_s``.

        For questions to a set of replicas of unknown size (every gateway's in-flight requests); a reply
        that does not decode is dropped like a bad published message.
        """
        nc = self.nc
        inbox = nc.new_inbox()
        replies: list[R] = []

        async def on_reply(msg: Msg) -> None:
            try:
                replies.append(decode(msg.data, reply_type))
            except ProtocolError as exc:
                self.dropped_messages += 1
                log.warning("dropped reply on %s: %s", subject, exc)

        sub = await nc.subscribe(inbox, cb=on_reply)
        try:
            await nc.publish(subject, encode(message), reply=inbox)
            await asyncio.sleep(timeout_s)
        finally:
            await sub.unsubscribe()
        return replies

    async def serve(
        self,
        subject: str,
        request_type: type[M],
        handler: Callable[[M], Awaitable[msgspec.Struct]],
        *,
        error_reply: Callable[[str], msgspec.Struct],
        queue: str = "",
        concurrent: bool = False,
    ) -> Subscription:
        """Answer requests on ``subject``; failures are answered with ``error_reply(message)``.

        nats-py runs one subscription's callbacks one after another, so a slow handler (a drain that takes
        a minute) holds up every later request. ``concurrent=True`` answers each request in its own task;
        the handler then owns any serialisation it needs.
        """

        async def handle(msg: Msg) -> None:
            try:
                request = decode(msg.data, request_type)
                reply = await handler(request)
            except ProtocolError as exc:
                reply = error_reply(f"bad request: {exc}")
            except Exception as exc:
                log.exception("request handler for %s failed", subject)
                reply = error_reply(f"{type(exc).__name__}: {exc}")
            if msg.reply:
                try:
                    await msg.respond(encode(reply))
                except nats.errors.Error as exc:  # e.g. the connection closed while the handler ran
                    log.warning("could not answer on %s: %s", subject, exc)

        async def on_msg(msg: Msg) -> None:
            if not concurrent:
                await handle(msg)
                return
            task = asyncio.create_task(handle(msg), name=f"serve:{subject}")
            self._handler_tasks.add(task)
            task.add_done_callback(self._handler_tasks.discard)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    async def _on_error(self, exc: Exception) -> None:
        if PERMISSIONS_ERR in str(exc):  # the server refused a publish or subscribe of this user
            self.permission_errors.append(str(exc))
            del self.permission_errors[:-100]
        log.warning("nats error: %s", exc)

    async def _on_disconnected(self) -> None:
        if not self._closing:
            log.warning("nats disconnected; reconnecting")

    async def _on_reconnected(self) -> None:
        log.info("nats reconnected")


def _is_auth_error(exc: Exception) -> bool:
    return isinstance(exc, nats.errors.AuthorizationError) or AUTHORIZATION_VIOLATION.lower() in str(exc).lower()


def bus_from_settings(settings: Any, name: str) -> Bus:
    """Build a :class:`Bus` from a :class:`shared.settings.ControlPlaneSettings`."""
    return Bus(settings.nats_url, name=name, user=settings.nats_user, password=settings.nats_password)
