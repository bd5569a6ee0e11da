"""The processes' HTTP server (aiohttp): bounded connections and queued work, timeouts, 400 for anything malformed."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from lockstep.metrics import Metrics
from lockstep.web import HttpServer, Limits, json_response


@pytest.fixture
def server():
    release = threading.Event()
    srv = HttpServer(
        metrics=Metrics(),
        limits=Limits(
            max_connections=3,
            health_reserve=2,
            idle_timeout_s=0.5,
            body_timeout_s=0.5,
            max_body=1024,
            workers=1,
            max_waiting=0,
        ),
    )

    async def echo(request):
        return json_response(await srv.read_json(request))

    async def slow(request):
        return json_response({"waited": await srv.blocking(release.wait, 30)})

    async def bug(request):
        raise KeyError("secret detail")

    async def ok(request):
        return web.Response(text="ok")

    srv.post("/echo", echo)
    srv.get("/slow", slow)
    srv.get("/bug", bug)
    srv.get("/ok", ok)
    srv.get("/healthz", ok)
    srv.start()
    srv.release = release
    yield srv
    release.set()
    srv.stop()


def raw(srv, data: bytes, timeout=10.0) -> bytes:
    """Send bytes on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def status(resp: bytes) -> int:
    return int(resp.split(b" ", 2)[1])


def post(srv, body: bytes, headers=None):
    req = urllib.request.Request(
        srv.url + "/echo", data=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_json_object_is_echoed_and_anything_else_is_a_one_line_400(server):
    assert post(server, b'{"sql": "SELECT 1"}') == (200, {"sql": "SELECT 1"})
    for body in (b"[1, 2]", b'"text"', b"{broken", b"\xff\xfe"):
        code, answer = post(server, body)
        assert code == 400 and set(answer) == {"error"} and "\n" not in answer["error"], (body, answer)
    code, answer = post(server, b"{" + b" " * 2000 + b"}")
    assert code == 413  # over max_body
    resp = raw(server, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\nConnection: close\r\n\r\n{}")
    assert status(resp) == 400 and b"Traceback" not in resp
    resp = raw(server, b"GARBAGE\r\n\r\n")
    assert status(resp) == 400


def test_a_bug_is_a_500_that_tells_nothing_of_the_internals(server):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.url + "/bug", timeout=10)
    body = err.value.read().decode()
    assert err.value.code == 500 and "secret detail" not in body and "Traceback" not in body


def test_a_silent_or_slow_client_is_dropped(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:  # connects, never sends
        assert s.recv(100) == b""  # closed by the server (idle_timeout_s), not by our 10 s timeout
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:  # a body that never comes
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        resp = s.recv(65536)
    assert status(resp) == 408


def test_connections_beyond_the_bound_are_turned_away_and_the_server_recovers(server):
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3 + 2)]  # and the reserve
    try:
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:  # answered before it says anything
            assert status(s.recv(65536)) == 503
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while True:  # the server notices the closed connections
        try:
            with urllib.request.urlopen(server.url + "/ok", timeout=10) as r:
                assert r.status == 200
                break
        except urllib.error.HTTPError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert server.metrics.get("http_refused_total", reason="connections") >= 1


def test_health_is_answered_while_idle_clients_hold_every_connection(server):
    """Before: 66 idle connections made /healthz a 503 for 15 s per wave (health shared the connection limit)."""
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3)]
    try:
        time.sleep(0.1)
        assert status(raw(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 200
        assert status(raw(server, b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 503
    finally:
        for s in held:
            s.close()


def test_blocking_work_beyond_the_pool_is_a_503_busy(server):
    first = threading.Thread(target=lambda: urllib.request.urlopen(server.url + "/slow", timeout=30).read())
    first.start()
    deadline = time.monotonic() + 10
    while server._pending == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.url + "/slow", timeout=10)
    assert err.value.code == 503 and err.value.headers["Retry-After"] == "1"
    server.release.set()
    first.join(10)
    assert server.metrics.get("http_requests_total", path="/slow", code="200") == 1
    assert server.metrics.get("http_requests_total", path="/slow", code="503") == 1
