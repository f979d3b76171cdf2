"""The transport's limits on a real server: header floods get 431, slow clients are closed at their deadlines and
cannot lock a normal request out (twice the connection cap of them, or 1,500 under a 1,024-descriptor limit), a cap
full of requests being answered refuses the next connection with 503 and leaves those requests whole, and a slow
reader still gets its whole stream."""

from __future__ import annotations

import asyncio
import http.client
import json
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.api.server_process import Server

DEADLINES = ["--header-timeout", "2", "--body-idle-timeout", "1", "--body-timeout", "3"]
SLACK = 2.0  # seconds past a deadline that a close may take to be seen (timer, linger, the client's own loop)
BODY = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}).encode()
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


def _raw(port: int, data: bytes, timeout: float = 10) -> tuple[int, dict]:
    """Send `data` at once and read the answer: (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and stopped reading before all of it was sent
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _completion(url: str, **kw) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 8,
                                                  "temperature": 0} | kw, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny, "--max-num-seqs", "4", *DEADLINES)
    yield s
    s.stop()


def test_header_floods_get_431_and_the_server_answers(server):
    request = b"GET /health HTTP/1.1\r\nhost: x\r\n"
    flood = request + b"".join(b"x-%d: y\r\n" % i for i in range(10_000)) + b"\r\n"  # one write, 99 kB
    status, body = _raw(server.port, flood)
    assert status == 431 and body["error"]["code"] == "request_header_fields_too_large"
    assert body["error"]["param"] == "headers"
    many = request + b"".join(b"x-%d: y\r\n" % i for i in range(101)) + b"\r\n"  # 2 kB, one header too many
    assert _raw(server.port, many)[0] == 431
    one_big = request + b"cookie: " + b"a" * (40 << 10) + b"\r\n\r\n"
    assert _raw(server.port, one_big)[0] == 431
    status, body = _raw(server.port, b"NOT HTTP\r\n\r\n")
    assert status == 400 and body["error"]["code"] == "invalid_http"
    fine = request + b"".join(b"x-%d: y\r\n" % i for i in range(90)) + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(fine)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    assert _completion(server.url)["choices"][0]["text"]
    assert server.metric('specserve_http_connections_closed_total{reason="header_limit"}') == 3


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_header_floods_are_refused_before_they_are_parsed(server):
    """vLLM's CVE-2025-48956 is memory: h11 parses a whole head, however large, that arrives at once (600 such
    floods, 16 at a time, once took a server from 0.4 to 2.4 GB)."""
    flood = b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: y\r\n" % i for i in range(10_000)) + b"\r\n"

    async def floods(n):
        async def one():
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(flood)
            answer = await reader.read(100)
            writer.close()
            return answer[:12]
        answers = []
        for _ in range(n // 16):
            answers += await asyncio.gather(*(one() for _ in range(16)))
        return answers

    before = _rss_mib(server.proc.pid)
    assert set(asyncio.run(floods(640))) == {b"HTTP/1.1 431"}
    assert _rss_mib(server.proc.pid) - before < 64


def test_a_head_trickled_past_the_size_limit_gets_431(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        try:
            for i in range(40):  # 40 kB in 1 kB lines, never ending the head
                s.sendall(b"x-%d: %s\r\n" % (i, b"y" * 1000))
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 431")


async def _slow_client(port: int, kind: str) -> tuple[str, float, bytes]:
    """A client that never completes its request: (kind, seconds until the server closed it, what it answered)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    body_head = HEAD + b"content-length: 100000\r\n\r\n"

    async def send():
        try:
            if kind == "head":  # a header line every 0.5 s, no end
                writer.write(HEAD)
                for i in range(100):
                    await asyncio.sleep(0.5)
                    writer.write(b"x-%d: y\r\n" % i)
            elif kind == "body_idle":  # the head, one byte of a 100 kB body, then nothing
                writer.write(body_head + b"{")
            elif kind == "body_trickle":  # one byte every 0.3 s: never idle long, but never done
                writer.write(body_head)
                for _ in range(1000):
                    writer.write(b" ")
                    await asyncio.sleep(0.3)
            await asyncio.sleep(60)  # "silent": connected, says nothing
        except (ConnectionError, OSError):
            pass

    sender = asyncio.create_task(send())
    out = b""
    try:
        while chunk := await reader.read(65536):
            out += chunk
    except (ConnectionError, OSError):
        pass
    closed = time.monotonic() - start
    sender.cancel()
    writer.close()
    return kind, closed, out


KINDS = ("silent", "head", "body_idle", "body_trickle")
DEADLINE = {"silent": 2, "head": 2, "body_idle": 1, "body_trickle": 3}  # the server's flags above


async def _flood_then_request(port: int, url: str, n: int) -> tuple[list, dict, float]:
    clients = [asyncio.create_task(_slow_client(port, KINDS[i % 4])) for i in range(n)]
    await asyncio.sleep(0.5)  # all connected and waiting
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 8,
                                                        "temperature": 0})
    took = time.monotonic() - start
    assert r.status_code == 200, r.text
    return await asyncio.gather(*clients), r.json(), took


def test_twice_the_cap_of_slow_clients_cannot_lock_out_a_normal_request(tiny):
    s = Server(tiny, "--max-connections", "20", *DEADLINES)
    try:
        expected = _completion(s.url)["choices"][0]["text"]
        results, answer, took = asyncio.run(_flood_then_request(s.port, s.url, 40))
        assert answer["choices"][0]["text"] == expected
        assert took < 2.0  # answered before any slow client's deadline freed a place: the evictions did
        shed = 0
        for kind, closed, out in results:
            assert closed <= DEADLINE[kind] + 0.5 + SLACK, (kind, closed)
            if closed < 0.9:  # shed to make room: a 503, or quietly if the server had read nothing from it yet
                shed += 1
                assert out in (b"",) or out.startswith(b"HTTP/1.1 503"), (kind, out[:40])
            elif kind != "silent":  # the rest at their deadlines, and a client that said something hears why
                assert out.startswith(b"HTTP/1.1 408"), (kind, out[:40])
        assert shed >= 20  # 40 against a cap of 20, then the normal request
        assert s.metric("specserve_http_connections") <= 2  # only the metrics scrape's own, and a keep-alive
    finally:
        s.stop()


async def _stream(url: str, max_tokens: int, pause: float = 0.0) -> tuple[str, bool]:
    """A streamed greedy completion; `pause` seconds between reads of the response (a slow reader)."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, done = [], False
    async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if pause:
                await asyncio.sleep(pause)
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text), done


class _SmallWindow(http.client.HTTPConnection):
    """A client whose socket buffers 4 kB: while it does not read, the server's writes to it wait."""

    def connect(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(60)
        self.sock.connect((self.host, self.port))


def _held_stream(port: int, held: threading.Event, n: int, max_tokens: int) -> dict[int, str]:
    """A streamed greedy completion of n choices read only once `held` is set: the choices' texts."""
    conn = _SmallWindow("127.0.0.1", port)
    # top logprobs make the answer far larger (~1 MB) than the socket buffers between the two, so that it is not
    # done (only written to the kernel) while nobody reads it
    body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "n": n, "stream": True, "logprobs": 5}
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    held.wait(30)
    texts: dict[int, str] = {}
    for line in r.read().decode().splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    conn.close()
    return texts


def test_a_cap_full_of_answers_refuses_with_503_and_keeps_them_whole(tiny):
    s = Server(tiny, "--max-connections", "2", "--num-speculative-tokens", "0", *DEADLINES)
    try:
        expected = _completion(s.url, max_tokens=240, ignore_eos=True)["choices"][0]["text"]
        held = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(_held_stream, s.port, held, 16, 240) for _ in range(2)]
            time.sleep(1.0)  # both answers under way, stuck behind their readers' full windows
            start = time.monotonic()
            status, body = _raw(s.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            took = time.monotonic() - start
            held.set()
            texts = [f.result() for f in streams]
        assert status == 503 and body["error"]["code"] == "too_many_connections" and took < 1.5
        assert texts == [dict.fromkeys(range(16), expected)] * 2
        assert s.metric('specserve_http_connections_closed_total{reason="refused"}') == 1
    finally:
        s.stop()


def test_a_slow_reader_gets_its_whole_stream(server):
    expected = _completion(server.url, max_tokens=200, ignore_eos=True)["choices"][0]["text"]
    start = time.monotonic()
    text, done = asyncio.run(_stream(server.url, 200, pause=0.025))
    assert time.monotonic() - start > 3  # longer than every read deadline of the server
    assert done and text == expected


def test_slow_clients_under_a_1024_descriptor_limit(tiny):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2000:
        pytest.skip(f"this process may open {hard} descriptors; the test's clients need 1,600")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    s = Server(tiny, *DEADLINES, nofile=1024)  # default cap: 1024 - 256
    try:
        results, answer, took = asyncio.run(_flood_then_request(s.port, s.url, 1500))
        assert answer["choices"][0]["text"]
        # the normal request and the 1,500 may wait behind the accept queue while asyncio backs off from EMFILE
        for kind, closed, _ in results:
            assert closed <= DEADLINE[kind] + 0.5 + SLACK + 3, (kind, closed)
        assert _completion(s.url)["choices"][0]["text"]
        assert s.proc.poll() is None
    finally:
        s.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
