"""The transport's parts without a server: the default connection cap, the book's eviction order, the listener's
accept burst, the descriptor limit, and the limits' configuration."""

from __future__ import annotations

import asyncio
import resource
import socket

import pytest

from specserve.config.loader import build_config
from specserve.config.schema import ServerConfig
from specserve.server.transport import (
    ACCEPT_BURST,
    BoundedListener,
    ConnectionBook,
    HeadScan,
    TransportLimits,
    default_max_connections,
    error_bytes,
    raise_descriptor_limit,
)


def test_default_cap_leaves_descriptors_free():
    assert default_max_connections(1024) == 768
    assert default_max_connections(4096) == 3584
    assert default_max_connections(1 << 20) == 4096  # a ceiling however high the limit
    assert default_max_connections(200) == 16


def test_limits_from_config_and_flags():
    limits = TransportLimits.from_config(ServerConfig(), 1024)
    assert (limits.max_connections, limits.max_header_count, limits.max_header_bytes) == (768, 100, 32 << 10)
    assert TransportLimits.from_config(ServerConfig(max_connections=5), 1024).max_connections == 5
    from argparse import Namespace
    cfg = build_config(Namespace(max_header_bytes=64 << 10, header_timeout=3.0), {"SPECSERVE_MAX_CONNECTIONS": "9"})
    assert (cfg.server.max_header_bytes, cfg.server.header_timeout, cfg.server.max_connections) == (65536, 3.0, 9)
    assert build_config(None, {"SPECSERVE_MAX_HEADER_BYTES": "16KiB"}).server.max_header_bytes == 16384
    for field, bad in (("max_connections", 0), ("max_header_count", 0), ("max_header_bytes", 100),
                       ("header_timeout", 0), ("body_idle_timeout", -1), ("body_timeout", 0),
                       ("keep_alive_timeout", 0)):
        with pytest.raises(ValueError, match=field):
            ServerConfig(**{field: bad})


class _Transport:
    def __init__(self, unsent: int = 0):
        self.unsent = unsent

    def get_write_buffer_size(self) -> int:
        return self.unsent


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0  # every connection has waited a second longer than the one before it
        return self.now


class _Conn:
    """What the book asks of a connection: its transport's unsent bytes, and shed() (which ends it)."""

    def __init__(self, book: ConnectionBook, name: str, unsent: int = 0):
        self.book, self.name, self.transport, self.shed_count = book, name, _Transport(unsent), 0

    def shed(self) -> None:
        self.shed_count += 1
        self.book.closing(self, "evicted", linger=False)


def test_book_sheds_the_oldest_waiting_connection_never_a_served_one():
    book = ConnectionBook(TransportLimits(3, 100, 1 << 15, 1, 1, 1, 1), clock=_Clock())
    a, b, c, d, e = (_Conn(book, n) for n in "abcde")
    for conn in (a, b, c):
        assert book.admit(conn)
        book.sending(conn)
    book.serving(a)  # a's request arrived whole: being answered
    book.sending(b)  # b's head became a body: keeps its place
    assert book.admit(d) and b.shed_count == 1 and c.shed_count == 0 and a.shed_count == 0
    book.sending(d)
    assert book.admit(e) and c.shed_count == 1 and d.shed_count == 0
    assert (book.open, book.active, book.closed["evicted"]) == (5, 3, 2)
    book.lost(b, was_closing=True, was_lingering=False)
    assert (book.open, book.active) == (4, 3)


def test_book_refuses_when_none_may_be_shed():
    book = ConnectionBook(TransportLimits(2, 100, 1 << 15, 1, 1, 1, 1), clock=_Clock())
    served, flushing, new = _Conn(book, "served"), _Conn(book, "flushing", unsent=10), _Conn(book, "new")
    for conn in (served, flushing):
        book.admit(conn)
    book.serving(served)
    book.idle(flushing)  # idle between requests, but its last answer is still being written to a slow reader
    assert not book.admit(new)
    assert served.shed_count == flushing.shed_count == 0


def test_book_sheds_clients_still_sending_before_idle_ones():
    book = ConnectionBook(TransportLimits(2, 100, 1 << 15, 1, 1, 1, 1), clock=_Clock())
    idle, sending, new, newer = (_Conn(book, n) for n in ("idle", "sending", "new", "newer"))
    book.admit(idle)
    book.idle(idle)  # finished a request first: the oldest
    book.admit(sending)
    book.sending(sending)
    assert book.admit(new) and sending.shed_count == 1 and idle.shed_count == 0
    book.serving(new)
    assert book.admit(newer) and idle.shed_count == 1


def test_book_never_sheds_a_connection_that_just_began_waiting():
    clock = _Clock()
    book = ConnectionBook(TransportLimits(1, 100, 1 << 15, 1, 1, 1, 1), clock=lambda: clock.now)
    old, new = _Conn(book, "old"), _Conn(book, "new")
    book.admit(old)
    book.sending(old)
    clock.now += 0.01  # accepted a moment ago: not read yet
    assert not book.admit(new) and old.shed_count == 0
    book.closing(new, "refused", linger=False)  # what the protocol does with a refused connection
    clock.now += 1.0
    assert book.admit(_Conn(book, "newer")) and old.shed_count == 1


def test_book_lingering_budget():
    book = ConnectionBook(TransportLimits(1000, 100, 1 << 15, 1, 1, 1, 1))
    conns = [_Conn(book, str(i)) for i in range(70)]
    for conn in conns:
        book.admit(conn)
    lingering = [book.closing(conn, "header_timeout", linger=True) for conn in conns]
    assert sum(lingering) == 64 and not any(lingering[64:])


def test_listener_hands_out_a_burst_per_loop_turn():
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen(64)
    listener = BoundedListener.take(plain)
    clients = [socket.create_connection(listener.getsockname()) for _ in range(ACCEPT_BURST + 4)]

    async def turns():
        counts = []
        for _ in range(2):
            n = 0
            try:
                while True:
                    listener.accept()[0].close()
                    n += 1
            except BlockingIOError:
                counts.append(n)
            await asyncio.sleep(0)  # the next turn
        return counts

    try:
        listener.setblocking(False)
        assert asyncio.run(turns()) == [ACCEPT_BURST, 4]
    finally:
        for c in clients:
            c.close()
        listener.close()


def test_raise_descriptor_limit_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 64:
        pytest.skip("no finite hard limit to raise to")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard // 2, hard))
        assert raise_descriptor_limit() == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_error_bytes_is_a_whole_response_in_openai_shape():
    raw = error_bytes(431, "too many", "request_header_fields_too_large", param="headers")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert f"content-length: {len(body)}".encode() in head and b"connection: close" in head
    assert body == (b'{"error": {"message": "too many", "type": "invalid_request_error", "param": "headers", '
                    b'"code": "request_header_fields_too_large"}}')


HEADS = [b"GET / HTTP/1.1\r\nhost: x\r\na: b\r\n\r\n{\"body\": 1}", b"GET / HTTP/1.1\nhost: x\n\nGET / HTTP/1.1\r\n",
         b"\r\n\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n", b"GET / HTTP/1.1\r\nhost: x\r\nb: c\r\n"]
# (bytes up to the head's end, header lines); the last head is not complete
COUNTS = [(len(b"GET / HTTP/1.1\r\nhost: x\r\na: b\r\n\r\n"), 2), (len(b"GET / HTTP/1.1\nhost: x\n\n"), 1),
          (len(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"), 1), (len(HEADS[3]), 2)]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_head_scan_counts_a_head_in_any_pieces(piece):
    for head, (size, headers) in zip(HEADS, COUNTS):
        scan = HeadScan()
        for i in range(0, len(head), piece):
            got = scan.feed(head[i:i + piece])
        assert (scan.bytes, got) == (size, headers), (head, piece)


def test_head_scan_counts_a_flood_before_its_end():
    scan = HeadScan()
    assert scan.feed(b"GET / HTTP/1.1\r\n" + b"x: y\r\n" * 150) == 150  # no end yet: every line counts
