"""What keeps one client from taking the server: the checks and bounds around the app.

- ``server_config``: uvicorn on h11 with ``GuardedH11Protocol`` (a request head must
  arrive within ``head_timeout`` seconds of the connection or of the previous answer, a
  body within ``body_timeout`` seconds of its head; slow clients get 408 and are closed),
  and a bound on open connections;
- ``HostCheck``: requests whose ``Host`` header names another host than the server's are
  refused (a page on another site that resolves its own name to 127.0.0.1, DNS
  rebinding, cannot reach the app);
- ``SecurityHeaders``: the page may not be framed by another site, sniffed into another
  type, or load anything from another origin (a content security policy);
- ``BodyLimit``: request bodies over the limit get 413, whether declared or streamed;
- ``Gate``: at most ``running`` callers inside a section at once and ``waiting`` queued;
  past that ``Busy`` (HTTP 503 with ``Retry-After``), so memory is bounded by design.

Cross-origin requests (CORS) are allowed only from origins named with ``--cors-origin``
(``serve.app``); by default no response carries an ``Access-Control-Allow-*`` header.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "BodyLimit",
    "Busy",
    "Gate",
    "GuardedH11Protocol",
    "HostCheck",
    "SecurityHeaders",
    "allowed_hosts",
    "server_config",
]

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


# ---------------------------------------------------------------- slow clients


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on what the client sends: the request head
    within ``head_timeout`` seconds (of the connection, or of the previous response on a
    kept-alive one), the whole body within ``body_timeout`` seconds of the head. Time the
    app spends answering is not bounded here. Subclass it (``guarded_protocol``) to set
    other deadlines."""

    head_timeout: float = 10.0
    body_timeout: float = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = ""
        self._heard = False
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._heard = True
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return  # still waiting for a complete head: its deadline runs on
        if cycle.more_body:
            if self._phase != "body":
                self._arm("body")
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._heard = False
            self._arm("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, phase: str) -> None:
        self._disarm()
        self._phase = phase
        seconds = self.head_timeout if phase == "head" else self.body_timeout
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, ""

    def _expire(self) -> None:
        self._deadline = None
        cycle = self.cycle
        reading = cycle is not None and not cycle.response_complete
        if reading and not cycle.more_body:
            return  # the request is in, the app is answering: not the client's delay
        if self.transport.is_closing():
            return
        if (self._heard or reading) and not (reading and cycle.response_started):
            what = "request body" if reading else "request head"
            body = json.dumps({"detail": f"the {what} did not arrive in time"}).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
        self.transport.close()


def guarded_protocol(head_timeout: float, body_timeout: float) -> type[GuardedH11Protocol]:
    """``GuardedH11Protocol`` with these deadlines (seconds)."""
    if head_timeout <= 0 or body_timeout <= 0:
        raise ValueError("timeouts must be positive")
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"head_timeout": float(head_timeout), "body_timeout": float(body_timeout)},
    )


def server_config(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 7860,
    head_timeout: float = 10.0,
    body_timeout: float = 60.0,
    max_connections: int = 128,
    **options: Any,
) -> Any:
    """The uvicorn configuration the app is served with (``serve/app.py`` and the tests):
    the guarded h11 protocol, keep-alive 5 s, at most ``max_connections`` open connections
    (more get 503)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(head_timeout, body_timeout),
        timeout_keep_alive=5,
        limit_concurrency=max_connections,
        **options,
    )


# ---------------------------------------------------------------- host header


def allowed_hosts(bind: str, extra: Iterable[str] = ()) -> set[str]:
    """The host names a server bound to ``bind`` answers to: the loopback names, the bind
    address itself, and for a wildcard bind (0.0.0.0, ::) this machine's name and its
    addresses; plus ``extra`` ("*" allows any)."""
    names = {*LOOPBACK_NAMES, *(h.lower().strip("[]") for h in extra)}
    if bind in WILDCARDS:
        machine = {socket.gethostname(), socket.getfqdn()}
        for name in list(machine):
            with suppress(OSError):
                machine |= {info[4][0] for info in socket.getaddrinfo(name, None)}
        names |= {n.lower() for n in machine}
    else:
        names.add(bind.lower().strip("[]"))
    return names


def _hostname(header: str) -> str:
    """``example.org:7860`` -> ``example.org``; ``[::1]:7860`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheck:
    """ASGI middleware: 400 for a request whose ``Host`` is not in ``allowed``."""

    def __init__(self, app: ASGIApp, *, allowed: Iterable[str]):
        self.app = app
        self.allowed = {a.lower() for a in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and "*" not in self.allowed:
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if _hostname(header) not in self.allowed:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await json_response(
                    send,
                    400,
                    f"this server does not answer to the host {header!r}; start it with "
                    "--allowed-host NAME to serve under that name",
                )
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------- headers

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self' 'unsafe-inline' 'unsafe-eval'",  # Gradio's page builds itself
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data: blob:",
        "font-src 'self' data:",
        "media-src 'self' data: blob:",
        "worker-src 'self' blob:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = (
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
)


class SecurityHeaders:
    """ASGI middleware: ``SECURITY_HEADERS`` on every response (replacing any the app
    set)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self._names = {name for name, _ in SECURITY_HEADERS}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k not in self._names]
                message = {**message, "headers": kept + list(SECURITY_HEADERS)}
            await send(message)

        await self.app(scope, receive, with_headers)


# ---------------------------------------------------------------- body size


class BodyLimit:
    """ASGI middleware: request bodies to paths under ``prefix`` over ``limit`` bytes get
    413 JSON, by Content-Length up front or by counting a streamed (chunked) body; what
    the app answers after that is dropped."""

    def __init__(self, app: ASGIApp, *, limit: int, prefix: str = "/v1/"):
        self.app = app
        self.limit = limit
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        seen, started, refused = 0, False, False

        async def counting_receive() -> Message:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    if not started and not refused:
                        refused = True
                        await self._refuse(send)
                    raise _TooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 is the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        with suppress(_TooLarge):
            await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, send: Send) -> None:
        await json_response(
            send, 413, f"the request is larger than the {self.limit / 2**20:g} MiB limit"
        )


class _TooLarge(Exception):
    pass


async def json_response(
    send: Send, status: int, detail: str, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    """Send ``{"detail": detail}`` with ``status``."""
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------- concurrency


class Busy(RuntimeError):
    """A ``Gate`` is full; ``retry_after`` is a suggested wait in seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Gate:
    """At most ``running`` callers inside at once, at most ``waiting`` more queued for a
    place (each for at most ``wait`` seconds); a caller beyond that gets ``Busy`` at once.
    Thread-safe: the API's endpoints and the web app's events run on worker threads."""

    def __init__(self, name: str, *, running: int, waiting: int, wait: float = 120.0):
        if running < 1 or waiting < 0 or wait <= 0:
            raise ValueError(f"{name}: need running >= 1, waiting >= 0 and wait > 0")
        self.name, self.running, self.waiting, self.wait = name, running, waiting, wait
        self._slots = threading.Semaphore(running)
        self._lock = threading.Lock()
        self._admitted = 0
        self._last_left = -math.inf  # time.monotonic() when the last caller left

    @property
    def admitted(self) -> int:
        """Callers inside or queued now."""
        return self._admitted

    def quiet_for(self, seconds: float) -> bool:
        """Whether nobody is inside or queued and nobody has left for ``seconds``: a load
        of back-to-back requests leaves the gate empty only between them."""
        with self._lock:
            return self._admitted == 0 and time.monotonic() - self._last_left >= seconds

    def enter(self) -> AbstractContextManager[None]:
        """A place inside (waiting up to ``wait`` s in the queue), or ``Busy``."""
        return self._enter(
            self.running + self.waiting,
            f"the server is busy with {{admitted}} {self.name} requests; try again in a few "
            "seconds",
            retry_after=5,
        )

    def enter_if_idle(self) -> AbstractContextManager[None]:
        """Enter only when nobody is inside or waiting (``Busy`` at once otherwise): for
        background work that must never make a request wait longer than its own run."""
        return self._enter(1, f"{self.name} requests are running", retry_after=1)

    @contextmanager
    def _enter(self, limit: int, full: str, *, retry_after: int) -> Iterator[None]:
        """Admit the caller while fewer than ``limit`` are admitted (else ``Busy(full)``),
        then wait for a running slot."""
        with self._lock:
            if self._admitted >= limit:
                raise Busy(full.format(admitted=self._admitted), retry_after=retry_after)
            self._admitted += 1
        try:
            if not self._slots.acquire(timeout=self.wait):
                raise Busy(
                    f"no {self.name} slot became free within {self.wait:g} s; try again later",
                    retry_after=10,
                )
            try:
                yield
            finally:
                self._slots.release()
        finally:
            with self._lock:
                self._admitted -= 1
                self._last_left = time.monotonic()
