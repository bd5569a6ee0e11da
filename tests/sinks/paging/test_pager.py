"""The pager's HTTP transport against a real local receiver: what a receiver answers beyond its status is not read."""

from __future__ import annotations

import socket
import threading

from lockstep.sinks.paging.pager import RESPONSE_MAX_BYTES, UrllibTransport


def test_a_receiver_announcing_gigabytes_is_read_only_up_to_the_bound():
    """Before: a 3 GB Content-Length took the sink to 2.9 GB.  The receiver here would send 3 GB; it is cut off."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent = [0]

    def receiver():
        con, _ = listener.accept()
        with con:
            con.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                data += con.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            while len(body) < length:
                body += con.recv(65536)
            con.sendall(b"HTTP/1.1 202 Accepted\r\nContent-Type: text/plain\r\nContent-Length: 3000000000\r\n\r\n")
            chunk = b"x" * (1 << 20)
            try:
                while sent[0] < 3_000_000_000:
                    con.sendall(chunk)
                    sent[0] += len(chunk)
            except OSError:
                pass  # the pager closed the connection

    t = threading.Thread(target=receiver, daemon=True)
    t.start()
    resp = UrllibTransport().post(
        f"http://127.0.0.1:{listener.getsockname()[1]}/", b"{}", {"Content-Type": "application/json"}, 10.0
    )
    t.join(30)
    listener.close()
    assert resp.status == 202
    assert not t.is_alive() and sent[0] < 64 << 20, sent[0]  # the kernel's buffers, not the announced 3 GB
    assert RESPONSE_MAX_BYTES <= 1 << 20
