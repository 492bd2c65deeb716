"""Running the HTTP app under uvicorn, with limits on connections and on slow clients
(:class:`ConnectionLimits`, ``infer serve``'s flags of the same names).

uvicorn's own settings cover keep-alive (``timeout_keep_alive``), the listen backlog, the
largest header block (``h11_max_incomplete_event_size``) and a refusal threshold
(``limit_concurrency``). What they leave open is added here:

- a deadline for a request's headers (slowloris: a byte every few seconds keeps an
  uvicorn connection forever) and two for its body: a total one (a never-ending chunked
  body, a drip) and one between two reads (a body that stops arriving: a ``Content-Length``
  longer than what was sent, a chunked body cut before its last chunk), so that a stalled
  client gets its 408 in seconds while a slow but steady upload still goes through;
- a cap on open connections: a connection beyond it evicts the longest-idle one (no request
  in progress), or, when every connection is busy, gets a fast 503;
- the soft open-files limit raised to the hard one, and the cap kept below it;
- one log line per burst, not thousands, when ``accept()`` still runs out of descriptors
  (asyncio logs every retry of its accept loop, with a traceback);
- a graceful drain on SIGTERM / SIGINT (:class:`LimitedServer`): the listeners stay open,
  the app answers new API requests 503 and ``/ready`` 503 while the requests in flight
  finish, for ``drain_timeout_s`` at most (a second signal: no longer); then those left
  are ended (an error event), and uvicorn's own shutdown runs. The process then exits 0
  (uvicorn would re-raise the signal).

Responses written here (400, 408, 503) come before routing, in OpenAI's error schema; a
body's 408, written once the request's path is known, in its face's (Tinker's under
``/api/``).
TLS is uvicorn's (``ssl_certfile``, ...): asyncio decrypts below the protocol, so
:class:`GuardedH11Protocol` sees plain HTTP and its deadlines start after the handshake.
"""

import asyncio
import dataclasses
import http
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from adapters.http.errors import face_error_body, openai_error_body
from adapters.http.ownership import Draining
from domain.errors import InvalidParameterError

log = logging.getLogger("uvicorn.error")

# Descriptors kept free for everything that is not a client connection (model and
# checkpoint files, logs, the listening socket, pipes, torch's own).
FD_RESERVE = 128
# A refused connection gets this long to send its request (so that the 503 is read, not
# lost to a reset); at most this many wait at once, the oldest is dropped beyond.
REFUSE_GRACE_S = 1.0
MAX_REFUSING = 32
# Warnings that repeat under load (accept() out of descriptors, the connection cap) are
# folded into one line per interval.
LOG_INTERVAL_S = 10.0
# After the drain timeout, the requests ended get this long to send their error event;
# then uvicorn's shutdown waits this long at most for the connections left.
END_GRACE_S = 2.0


@dataclass(frozen=True)
class ConnectionLimits:
    """What ``infer serve`` allows one client connection (the flags of the same names)."""

    max_connections: int = 1000
    timeout_keep_alive: int = 5
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    backlog: int = 2048
    h11_max_incomplete_event_size: int = 16 * 1024
    body_read_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "backlog", "h11_max_incomplete_event_size"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, "must be at least 1")
        for name in ("timeout_keep_alive", "header_timeout", "body_timeout", "body_read_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidParameterError(name, "must be greater than 0 (seconds)")


def raise_open_files_limit() -> int | None:
    """Raise the soft RLIMIT_NOFILE to the hard one; returns the soft limit now in force,
    None where there is none (unlimited, or a platform without it)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            log.warning("could not raise the open-files limit from %d to %d", soft, wanted)
    return soft


def connection_cap(wanted: int, open_files: int | None) -> int:
    """``wanted`` connections, fewer where the open-files limit leaves no room for them."""
    if open_files is None:
        return wanted
    return max(1, min(wanted, open_files - FD_RESERVE))


def _error_response(status: int, message: str, kind: str, retry_after: int | None = None) -> bytes:
    return _raw_response(status, openai_error_body(message, kind), retry_after)


def _raw_response(status: int, body: bytes, retry_after: int | None = None) -> bytes:
    """A JSON response closing the connection, as bytes on the wire."""
    head = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


HEADER_TIMEOUT = _error_response(408, "request headers not received in time", "timeout_error")
INVALID_HTTP = _error_response(400, "invalid HTTP request", "invalid_request_error")
TOO_MANY_CONNECTIONS = _error_response(
    503, "too many open connections; retry shortly", "overloaded_error", retry_after=1
)


class FoldedLog:
    """A warning that repeats under load (per connection, per accept attempt), logged once
    per ``interval_s`` with the number of repeats folded into it."""

    def __init__(
        self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._last: float | None = None
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        log.warning(message + more, *args)
        self._last, self._suppressed = now, 0


class AcceptErrorLog:
    """An event-loop exception handler that folds asyncio's repeated "socket.accept() out
    of system resource" reports (one per accept attempt, each with a traceback) into one
    line per interval; every other report goes to the loop's default handler."""

    def __init__(self, folded: FoldedLog | None = None) -> None:
        self.folded = folded or FoldedLog()

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
            return
        self.folded.warning("cannot accept connections: %s; retrying", context.get("exception"))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and a connection cap; ``limits`` comes
    from the subclass :func:`guarded_protocol` makes (one per server)."""

    limits: ClassVar[ConnectionLimits]
    # Insertion-ordered sets: connections with no request in progress, longest idle first;
    # connections refused (not counted as open) waiting for their 503.
    idle: ClassVar[dict["GuardedH11Protocol", None]]
    refusing: ClassVar[dict["GuardedH11Protocol", None]]
    at_cap: ClassVar[FoldedLog]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "headers", "body", "refused" or None (no deadline)
        # In the body phase (loop times): when the whole body is due, when bytes last came.
        self._body_due = self._last_read = 0.0

    # --- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._evict_idle():
            self._refuse()
            return
        self._track()

    def data_received(self, data: bytes) -> None:
        if self._phase == "refused":
            self._close_with(TOO_MANY_CONNECTIONS)
            return
        self._last_read = self.loop.time()
        super().data_received(data)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None, None)
        self._forget()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (or headers beyond ``h11_max_incomplete_event_size``): 400 in the
        error schema rather than uvicorn's plain text."""
        self._close_with(INVALID_HTTP)

    # --- deadlines ---------------------------------------------------------------------

    def _track(self) -> None:
        """Arm the deadline of the phase the request is in (once per phase)."""
        if self.transport.is_closing():
            self._set_deadline(None, None)
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # waiting for (the rest of) a request's headers
            if self._phase != "headers":
                self._set_deadline("headers", self.limits.header_timeout)
                self.idle.pop(self, None)
                self.idle[self] = None  # the newest idle one
            return
        self.idle.pop(self, None)
        if state is h11.SEND_BODY:
            if self._phase != "body":
                # One timer: at the earlier of the two body deadlines; when it fires, bytes
                # that came meanwhile push it on (see _body_deadline_passed).
                limits = self.limits
                self._last_read = self.loop.time()
                self._body_due = self._last_read + limits.body_timeout
                self._set_deadline("body", min(limits.body_timeout, limits.body_read_timeout))
        else:  # the request is in; the response is the app's business
            self._set_deadline(None, None)

    def _set_deadline(self, phase: str | None, seconds: float | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if seconds is not None:
            self._deadline = self.loop.call_later(seconds, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._phase == "refused":
            self._close_with(TOO_MANY_CONNECTIONS)
        elif self._phase == "body":
            self._body_deadline_passed()
        elif self.conn.trailing_data[0]:  # part of a request's headers came
            self._close_with(HEADER_TIMEOUT)
        else:  # an idle connection that never sent a request
            self._close_with(None)

    def _body_deadline_passed(self) -> None:
        """The body phase's timer: 408 (in the face's error format) when the whole body is
        overdue or nothing came for ``body_read_timeout``; else the timer again."""
        now, limits = self.loop.time(), self.limits
        if self.flow.read_paused:  # the app has not read what came: not the client's stall
            self._last_read = now
        due = min(self._body_due, self._last_read + limits.body_read_timeout)
        if now < due:
            self._deadline = self.loop.call_later(due - now, self._deadline_passed)
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:  # the app answered without the body
            self._close_with(None)
            return
        if now >= self._body_due:
            message = f"request body not received within {limits.body_timeout:g} s"
        else:
            message = f"request body stalled: no bytes for {limits.body_read_timeout:g} s"
        path = cycle.scope.get("path", "") if cycle is not None else ""
        body = face_error_body(path, message, "timeout_error")
        self._close_with(_raw_response(408, body))

    def _close_with(self, response: bytes | None) -> None:
        """Write ``response`` (if any), end the request the app may be waiting on, close."""
        self._set_deadline(None, None)
        self._forget()
        if response is not None and not self.transport.is_closing():
            self.transport.write(response)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() answers http.disconnect
            cycle.message_event.set()
        self.transport.close()

    # --- the connection cap ------------------------------------------------------------

    def _forget(self) -> None:
        self.idle.pop(self, None)
        self.refusing.pop(self, None)

    def _evict_idle(self) -> bool:
        """Close the longest-idle connection with no request in progress."""
        oldest = next((c for c in self.idle if not c.transport.is_closing()), None)
        if oldest is None:
            return False
        oldest._close_with(None)
        self.at_cap.warning(
            "%d connections open (--max-connections): closing the longest-idle ones",
            self.limits.max_connections,
        )
        return True

    def _refuse(self) -> None:
        """Every connection is busy: answer 503 once the request comes (or soon anyway).
        It does not count as open; a bounded number wait at once."""
        self.at_cap.warning(
            "%d connections open (--max-connections), all busy: new ones get 503",
            self.limits.max_connections,
        )
        self.connections.discard(self)
        if len(self.refusing) >= MAX_REFUSING:
            next(iter(self.refusing))._close_with(TOO_MANY_CONNECTIONS)
        self.refusing[self] = None
        self._set_deadline("refused", REFUSE_GRACE_S)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class for one server: :class:`GuardedH11Protocol` bound to ``limits``."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"limits": limits, "idle": {}, "refusing": {}, "at_cap": FoldedLog()},
    )


class LimitedServer(uvicorn.Server):
    """uvicorn's server, with the accept-error folding installed on its event loop and,
    given ``draining``, a graceful drain on SIGTERM / SIGINT (a second signal ends the
    requests still running at once; one after that is uvicorn's: stop now)."""

    def __init__(
        self,
        config: uvicorn.Config,
        draining: Draining | None = None,
        drain_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(config)
        self.draining, self.drain_timeout_s = draining, drain_timeout_s
        self._drain_since: float | None = None
        self._announced = self._ended = False

    async def startup(self, sockets: Any = None) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining is None or self._ended:
            super().handle_exit(sig, frame)
            return
        # A signal handler: only flags here; on_tick (every 0.1 s) does the rest. A second
        # signal runs the drain out now.
        now = time.monotonic()
        first = self._drain_since is None
        self._drain_since = now if first else now - self.drain_timeout_s
        self.draining.begin()

    async def on_tick(self, counter: int) -> bool:
        """True: leave the main loop for uvicorn's shutdown."""
        return await super().on_tick(counter) or self._drained()

    def _drained(self) -> bool:
        if self.draining is None or self._drain_since is None:
            return False
        if not self._announced:
            log.info(
                "draining: no new API requests; %d running, %g s to finish",
                self.draining.in_flight,
                self.drain_timeout_s,
            )
            self._announced = True
        if not self.draining.in_flight:
            return True
        late = time.monotonic() - self._drain_since - self.drain_timeout_s
        if late >= 0 and not self._ended:
            log.warning("drain over: ending the %d requests still running", self.draining.in_flight)
            self.draining.end_all()
            self._ended = True
        return late >= END_GRACE_S


def server_config(
    app: Any, host: str, port: int, limits: ConnectionLimits, **uvicorn_options: Any
) -> uvicorn.Config:
    """The uvicorn configuration for ``app`` under ``limits`` (its connection cap as given:
    :func:`run_server` lowers it to fit the open-files limit)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(limits),
        # uvicorn answers 503 (plain text) once open connections or request tasks reach
        # this: a backstop on request tasks, which can outlive their connection; twice the
        # cap, so that connections evicted in a burst (closing, still counted) never trip it.
        limit_concurrency=2 * limits.max_connections,
        timeout_keep_alive=limits.timeout_keep_alive,
        backlog=limits.backlog,
        h11_max_incomplete_event_size=limits.h11_max_incomplete_event_size,
        **uvicorn_options,
    )


def run_server(
    app: Any,
    host: str,
    port: int,
    limits: ConnectionLimits,
    log_level: str = "info",
    access_log: bool = True,
    *,
    draining: Draining | None = None,
    drain_timeout_s: float = 30.0,
    **tls: str,
) -> None:
    """Serve ``app`` until interrupted (with ``draining``, the app's drain state: drained
    first). When logging is configured (``configure_logging``) uvicorn's logs go through
    it; otherwise uvicorn configures its own. ``tls``: uvicorn's ``ssl_*`` options."""
    soft = raise_open_files_limit()
    cap = connection_cap(limits.max_connections, soft)
    if cap < limits.max_connections:
        log.warning(
            "--max-connections lowered from %d to %d: the open-files limit is %s (ulimit -n)",
            limits.max_connections,
            cap,
            soft,
        )
        limits = dataclasses.replace(limits, max_connections=cap)
    configured = bool(logging.getLogger().handlers)
    log_config = None if configured else uvicorn.config.LOGGING_CONFIG
    config = server_config(
        app,
        host,
        port,
        limits,
        log_level=log_level,
        access_log=access_log,
        log_config=log_config,
        timeout_graceful_shutdown=END_GRACE_S if draining is not None else None,
        **tls,
    )
    LimitedServer(config, draining, drain_timeout_s).run()
