"""The HTTP transport's own limits, below the request body: header count and size, read deadlines for a request's
head and body, and a cap on open connections that sheds connections still waiting on their client (oldest first)
before it refuses a new one with 503. uvicorn's h11 protocol parses; this subclass watches its states."""

from __future__ import annotations

import asyncio
import errno
import functools
import re
import resource
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.config.schema import ServerConfig
from specserve.server.errors import APIError

# the default cap keeps this many descriptors (at least) for model files, the metrics scrape, logs and the accept
# queue's burst: asyncio accepts a whole backlog of sockets before their protocols run and can shed any
DESCRIPTOR_RESERVE = 256
# ... and stops here however high the limit: each waiting connection holds up to max_header_bytes of a head
DEFAULT_MAX_CONNECTIONS = 4096
ACCEPT_BURST = 16  # connections accepted per event-loop turn: accepted sockets wait a turn or two for their protocol
SHED_AFTER = 0.05  # seconds a connection waits on its client before it may be shed: a connection accepted a moment
# ago has had no chance to be read (a normal client's head is usually in its first read); newcomers are refused instead
LINGER_SECONDS = 2.0  # a refused or timed-out connection is drained this long, so its client reads the answer
MAX_LINGERING = 64  # beyond this many draining at once, close at once (the answer may be lost to a reset)

HEAD, BODY, IDLE, SERVING, CLOSING = "head", "body", "idle", "serving", "closing"
_HEAD_END = re.compile(rb"\n\r?\n")  # where a request head ends, as h11 finds it


@dataclass(frozen=True)
class TransportLimits:
    max_connections: int
    max_header_count: int
    max_header_bytes: int
    header_timeout: float  # seconds from a head's first byte (a new connection: from its accept) to its end
    body_idle_timeout: float  # seconds between two reads of a request body
    body_timeout: float  # seconds from a head's end to its body's end
    keep_alive_timeout: float  # seconds an idle connection is kept between requests

    @classmethod
    def from_config(cls, server: ServerConfig, descriptor_limit: int) -> TransportLimits:
        cap = server.max_connections or default_max_connections(descriptor_limit)
        return cls(cap, server.max_header_count, server.max_header_bytes, server.header_timeout,
                   server.body_idle_timeout, server.body_timeout, server.keep_alive_timeout)


def raise_descriptor_limit() -> int:
    """Raise the soft limit on open descriptors to the hard one (each connection holds one); return the soft limit
    now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a sandbox may refuse; the old limit stays and the cap follows it
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections(descriptor_limit: int) -> int:
    reserve = max(DESCRIPTOR_RESERVE, descriptor_limit // 8)
    return max(16, min(DEFAULT_MAX_CONNECTIONS, descriptor_limit - reserve))


def error_bytes(status: int, message: str, code: str, type: str = "invalid_request_error",
                param: str | None = None, extra: str = "") -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's shape, written straight to a socket that is about to close."""
    body = APIError(status, message, type=type, param=param, code=code).json_bytes()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n")
    return head.encode("ascii") + body


class ConnectionBook:
    """The open connections of one server: how many are active (not closing), how many drain a last answer, and
    which wait on their client (a head or body still arriving; idle between requests), oldest first."""

    def __init__(self, limits: TransportLimits, on_close: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        self.open = 0  # every connection whose socket is still open
        self.active = 0  # ... less those closing
        self.lingering = 0
        self.closed: Counter[str] = Counter()  # reason -> connections the server ended before an answer
        # waiting on their client since (monotonic seconds), oldest first: still sending a request (shed first), and
        # idle between requests
        self._sending: OrderedDict[GuardedH11Protocol, float] = OrderedDict()
        self._idle: OrderedDict[GuardedH11Protocol, float] = OrderedDict()
        self._on_close = on_close

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """A new connection: True when it may stay, after shedding the oldest waiting ones beyond the cap; False when
        every other connection is being answered (the caller refuses it)."""
        self.open += 1
        self.active += 1
        while self.active > self.limits.max_connections:
            victim = self._victim()
            if victim is None:
                return False
            victim.shed()
        return True

    def _victim(self) -> GuardedH11Protocol | None:
        """The connection to shed: oldest first, a client still sending before an idle one (which has finished a
        request), none that began waiting less than SHED_AFTER ago; one still flushing an answer to its reader is
        being served, whatever its phase."""
        recent = self.clock() - SHED_AFTER
        for waiting in (self._sending, self._idle):
            for conn, since in waiting.items():
                if since > recent:
                    break
                if conn.transport.get_write_buffer_size() == 0:
                    return conn
        return None

    def sending(self, conn: GuardedH11Protocol) -> None:
        self._idle.pop(conn, None)
        self._sending.setdefault(conn, self.clock())  # a head that became a body keeps its place in the order

    def idle(self, conn: GuardedH11Protocol) -> None:
        self._sending.pop(conn, None)
        self._idle[conn] = self.clock()

    def serving(self, conn: GuardedH11Protocol) -> None:
        self._sending.pop(conn, None)
        self._idle.pop(conn, None)

    def closing(self, conn: GuardedH11Protocol, reason: str | None, linger: bool) -> bool:
        """`conn` stops counting against the cap; True when it may drain its answer (within the lingering budget)."""
        self.serving(conn)  # out of both orders
        self.active -= 1
        if reason is not None:
            self.closed[reason] += 1
            if self._on_close is not None:
                self._on_close(reason)
        if linger and self.lingering < MAX_LINGERING:
            self.lingering += 1
            return True
        return False

    def lost(self, conn: GuardedH11Protocol, was_closing: bool, was_lingering: bool) -> None:
        self.serving(conn)
        self.open -= 1
        if not was_closing:
            self.active -= 1
        if was_lingering:
            self.lingering -= 1


class HeadScan:
    """The bytes and header lines of one request head as its pieces arrive, up to its end, before a parser sees it."""

    def __init__(self):
        self.bytes = self.lines = 0
        self.done = False  # its end has arrived
        self._tail = b""  # the last bytes seen, where the head's end may begin

    def feed(self, data: bytes) -> int:
        """Count what `data` adds to the head (nothing once it is done); the number of header lines so far."""
        if not self.done:
            if not self.bytes:
                data = data.lstrip(b"\r\n")  # blank lines before a request line, which h11 skips
            window = self._tail + data
            end = _HEAD_END.search(window)
            self.done = end is not None
            part = data[:max(0, end.end() - len(self._tail))] if self.done else data
            self.bytes += len(part)
            self.lines += part.count(b"\n")
            self._tail = window[-2:]
        return max(0, self.lines - (2 if self.done else 1))  # less the request line (and the blank line)


class _LimitedH11(h11.Connection):
    """h11's server side with a bound on the request head: its size while incomplete (h11's own buffer limit, a 431)
    and, once parsed, its header count and size (for pipelined heads, which the protocol's scan does not see); the
    last error is kept for the answer."""

    def __init__(self, limits: TransportLimits):
        super().__init__(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.max_count, self.max_bytes = limits.max_header_count, limits.max_header_bytes
        self.error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.error = exc
            raise
        if isinstance(event, h11.Request):
            size = len(event.method) + len(event.target) + 12 + sum(len(n) + len(v) + 4 for n, v in event.headers)
            if len(event.headers) > self.max_count or size > self.max_bytes:
                self.error = h11.RemoteProtocolError("request headers over the limit", error_status_hint=431)
                raise self.error
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits of one ConnectionBook: deadlines while the client still sends, a place
    in the book's eviction order while it waits, a JSON answer (400, 408, 431, 503) before any close it causes."""

    def __init__(self, *args, book: ConnectionBook, **kwargs):
        super().__init__(*args, **kwargs)
        self.book, self.limits = book, book.limits
        self.conn = _LimitedH11(self.limits)
        self.phase = HEAD
        self._lingering = False
        self._head = HeadScan()  # the current request head, as it arrives
        self._phase_start = self._last_read = 0.0
        self._deadline: object | None = None  # the TimerHandle of the current phase's deadline

    # -- asyncio.Protocol ----------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if not self.book.admit(self):
            self.end("refused", error_bytes(503, "the server has too many open connections", "too_many_connections",
                                            type="service_unavailable", extra="retry-after: 1\r\n"))
            return
        self._enter(HEAD)

    def data_received(self, data: bytes) -> None:
        if self.phase == CLOSING:
            return  # draining: the answer is written, nothing more is read
        if self.phase == IDLE:
            self._enter(HEAD)  # a kept-alive connection's next request begins
        if self.phase == HEAD and self._scan_head(data):
            return self._refuse_head()  # before h11 parses it: a 10,000-header head costs no memory here
        self._last_read = time.monotonic()
        super().data_received(data)
        self._follow_parser()

    def _scan_head(self, data: bytes) -> bool:
        """True when `data` takes the head still arriving over a limit. h11 parses a head only once it is whole,
        and a whole one of any size if it came at once: this counts before it does."""
        headers = self._head.feed(data)
        return self._head.bytes > self.limits.max_header_bytes or headers > self.limits.max_header_count

    def _refuse_head(self) -> None:
        self.end("header_limit", error_bytes(
            431, f"the request head exceeds max_header_count ({self.limits.max_header_count} headers) or "
                 f"max_header_bytes ({self.limits.max_header_bytes} bytes)", "request_header_fields_too_large",
            param="headers"))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_parser()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.book.lost(self, self.phase == CLOSING, self._lingering)
        self.phase = CLOSING
        super().connection_lost(exc)

    def shutdown(self) -> None:  # the server stops: uvicorn's own, unless this connection is already ending
        if self.phase == CLOSING:
            self.transport.close()
        else:
            super().shutdown()

    def send_400_response(self, msg: str) -> None:  # h11 found the head invalid, or over a limit (431)
        error = self.conn.error
        if error is not None and error.error_status_hint == 431:  # a pipelined head, parsed from h11's buffer
            self._refuse_head()
        else:
            self.end("invalid_http", error_bytes(400, f"invalid HTTP request: {error or msg}", "invalid_http"))

    # -- phases --------------------------------------------------------------------------------------------------
    def _follow_parser(self) -> None:
        """Set the phase from h11's view of the client after it has handled what arrived."""
        if self.phase == CLOSING or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self.phase == SERVING:  # the answer is done; uvicorn's keep-alive timer runs
                pending = len(self.conn.trailing_data[0])  # a pipelined head partly received already
                self._enter(HEAD if pending else IDLE)
                self._head.bytes = pending  # not scanned: h11 has it (its bounds hold)
        elif state is h11.SEND_BODY:
            if self.phase != BODY:
                self._enter(BODY)
        elif state in (h11.DONE, h11.MUST_CLOSE) and self.phase != SERVING:
            self._enter(SERVING)

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self._phase_start = self._last_read = time.monotonic()
        if phase == HEAD:
            self._head = HeadScan()
        self._disarm()
        if phase in (HEAD, BODY):
            self.book.sending(self)
        elif phase == IDLE:
            self.book.idle(self)
        else:
            self.book.serving(self)
        if phase == HEAD:
            self._arm(self.limits.header_timeout)
        elif phase == BODY:
            self._arm(min(self.limits.body_idle_timeout, self.limits.body_timeout))

    def _arm(self, delay: float) -> None:
        self._deadline = self.loop.call_later(max(delay, 0.0), self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        now = time.monotonic()
        if self.phase == HEAD:
            if self._head.bytes == 0:  # said nothing: closed quietly, as an idle kept-alive connection is
                self.end("header_timeout", None)
            else:
                self.end("header_timeout", error_bytes(
                    408, f"the request head did not arrive within header_timeout ({self.limits.header_timeout:g} s)",
                    "request_timeout"))
        elif self.phase == BODY:
            if self.flow.read_paused:  # we stopped reading (the app is behind), not the client
                self._last_read = now
            idle_end = self._last_read + self.limits.body_idle_timeout
            total_end = self._phase_start + self.limits.body_timeout
            if now < min(idle_end, total_end):
                self._arm(min(idle_end, total_end) - now)
                return
            which = "body_timeout" if now >= total_end else "body_idle_timeout"
            seconds = self.limits.body_timeout if which == "body_timeout" else self.limits.body_idle_timeout
            answered = self.cycle is not None and self.cycle.response_started
            self.end("body_timeout", None if answered else error_bytes(
                408, f"the request body did not arrive within {which} ({seconds:g} s)", "request_timeout"))

    def shed(self) -> None:
        """Closed to make room: a client in the middle of a request hears why; an idle one is closed quietly."""
        quiet = self.phase == IDLE or (self.phase == HEAD and self._head.bytes == 0)
        self.end("evicted", None if quiet else error_bytes(
            503, "the server has too many open connections; this one was waiting on its client",
            "too_many_connections", type="service_unavailable", extra="retry-after: 1\r\n"))

    def end(self, reason: str | None, answer: bytes | None) -> None:
        """Close this connection on the server's initiative: write `answer` (if any), then drain what the client
        still sends for a moment, so that its socket does not reset before it has read the answer."""
        if self.phase == CLOSING:
            return
        self._disarm()
        self.phase = CLOSING
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() says http.disconnect; its sends are dropped
            self.cycle.message_event.set()
        transport = self.transport
        if transport.is_closing():
            self.book.closing(self, reason, linger=False)
            return
        self._lingering = self.book.closing(self, reason, linger=answer is not None and transport.can_write_eof())
        if answer is not None:
            transport.write(answer)
        if not self._lingering:  # close() would wait for a reader that may never read: abort what is unsent
            transport.close() if transport.get_write_buffer_size() == 0 else transport.abort()
            return
        transport.write_eof()
        self.flow.resume_reading()
        self._deadline = self.loop.call_later(LINGER_SECONDS, transport.abort)


class BoundedListener(socket.socket):
    """A listening socket that hands asyncio at most ACCEPT_BURST connections per event-loop turn. asyncio accepts a
    whole backlog in one turn, before any of their protocols runs (and so before the cap can shed anything): under a
    flood that ran the process out of descriptors, and then it logged one error per queued connection. Here the
    sockets accepted but not yet admitted stay within the descriptors the cap leaves free."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._taken = 0
        self._reset_due = False

    @classmethod
    def take(cls, sock: socket.socket) -> BoundedListener:
        """The same listening socket (its descriptor moves over), bound and ready as uvicorn made it."""
        return cls(sock.family, sock.type, sock.proto, fileno=sock.detach())

    def accept(self):
        if self._taken >= ACCEPT_BURST:
            raise BlockingIOError(errno.EAGAIN, "this turn's burst is taken")  # asyncio stops this turn's loop
        if not self._reset_due:
            asyncio.get_running_loop().call_soon(self._reset)  # runs at the start of the next turn
            self._reset_due = True
        try:
            conn = super().accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self._taken = ACCEPT_BURST  # asyncio backs off once (and logs once), not once per queued client
            raise
        self._taken += 1
        return conn

    def _reset(self) -> None:
        self._taken, self._reset_due = 0, False


def protocol_factory(book: ConnectionBook) -> Callable[..., GuardedH11Protocol]:
    """What uvicorn's `http=` takes: it calls it with config, server_state, app_state for each connection."""
    return functools.partial(GuardedH11Protocol, book=book)
