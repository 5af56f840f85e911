#!/usr/bin/env python3
"""A client that sends before its server accepts, then the two talk on (MPI ranks on one node
connect like this: each sends on its new connection before the other rank accepts it).

    late_accept.py server --bind IP:PORT [--accept-after S] [--busy-nested [--seconds S]
                          [--quiet-after S]]
    late_accept.py client --connect IP:PORT [--bytes N] [--seconds S] [--busy-nested]

The server listens, waits --accept-after seconds (default 0.5), accepts one connection and
sends back everything it reads until the end of stream.

With --busy-nested (both sides) each waits for input as UCX's progress engine does: in a
busy loop of zero-time-out waits on an epoll instance that is itself held by a second
instance, for errors only (UCX's progress thread holds its worker's instance so). After the
first bytes the server leads: for --seconds it sends a numbered 4 KiB message every 2 ms,
which the client checks and sends back, so the client waits for input first. The server
prints one JSON line: {"bells": B, "reads": R, "rounds": N, "bad": 0}, with the bytes that
reached its socket itself (TCP_INFO bytes_received) and the answers it read, both counted
from --quiet-after seconds after the accept to the end. Over the layer's shared memory
those bytes are wake-ups, which a loop that never sleeps does not need. The client connects, sends N bytes
(default 3000) at once, reads them back, then for --seconds sends a numbered 4 KiB message
every 2 ms and checks that it comes back. The client prints one JSON line:

    {"echoed": N, "same": true, "rounds": R, "bad": 0}   ("error" on failure)
"""

import argparse
import json
import os
import select
import socket
import struct
import sys
import time


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def recv_upto(sock, n):
    """Reads until n bytes came or the stream ended; never more than n (what follows is the
    next message's)."""
    got = b""
    while len(got) < n:
        chunk = sock.recv(min(65536, n - len(got)))
        if not chunk:
            break
        got += chunk
    return got


TCP_INFO_BYTES_RECEIVED = 128   # offset of tcpi_bytes_received in struct tcp_info


def bytes_received(sock):
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
    return struct.unpack_from("<Q", info, TCP_INFO_BYTES_RECEIVED)[0]


def message(n):
    return bytes((n + i) % 251 for i in range(4096))


def busy_nested(s, a):
    """Waits as UCX's progress engine does: zero-time-out waits on an epoll instance held by a
    second one for errors only. Echoes the client's first bytes, then leads: for --seconds
    sends a numbered 4 KiB message every 2 ms and checks the echo; then ends the stream."""
    rx = BusyNested(s)
    first = rx.recv_upto(a.bytes)
    s.sendall(first)
    quiet_at = time.monotonic() + a.quiet_after
    end = time.monotonic() + a.seconds
    base, reads, rounds, bad = None, 0, 0, 0
    while time.monotonic() < end:
        if base is None and time.monotonic() >= quiet_at:
            base = bytes_received(s)
        msg = message(rounds)
        s.sendall(msg)
        back = rx.recv_upto(len(msg))
        bad += back != msg
        reads += base is not None
        rounds += 1
        if len(back) < len(msg):
            break
        time.sleep(0.002)
    bells = bytes_received(s) - base if base is not None else -1
    s.shutdown(socket.SHUT_WR)
    rx.recv_upto(1)
    print(json.dumps({"bells": bells, "reads": reads, "rounds": rounds, "bad": bad}), flush=True)
    s.close()
    return 0


def server(a):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(parse_addr(a.bind))
    ls.listen(4)
    time.sleep(a.accept_after)
    s, _ = ls.accept()
    if a.busy_nested:
        return busy_nested(s, a)
    while True:
        m = s.recv(65536)
        if not m:
            break
        s.sendall(m)
    s.close()
    return 0


class BusyNested:
    """Receives as UCX's progress engine waits: zero-time-out waits on an epoll instance
    held by a second one for errors only (see busy_nested); gives up after 30 s."""

    def __init__(self, sock):
        self.sock = sock
        self.inner, self.outer = select.epoll(), select.epoll()
        self.outer.register(self.inner.fileno(), select.EPOLLERR)
        self.inner.register(sock.fileno(), select.EPOLLIN)

    def recv_upto(self, n):
        got, end = b"", time.monotonic() + 30
        self.sock.setblocking(False)
        try:
            while len(got) < n and time.monotonic() < end:
                if not self.inner.poll(0):
                    continue
                try:
                    # (No more than n: the server's next message may already be behind the
                    # echo, when this side is slow to read.)
                    chunk = self.sock.recv(min(65536, n - len(got)))
                except BlockingIOError:
                    continue
                if not chunk:
                    break
                got += chunk
        finally:
            self.sock.setblocking(True)
        return got


def client(a):
    out = {"echoed": 0, "same": False, "rounds": 0, "bad": 0}
    data = os.urandom(a.bytes)
    try:
        c = socket.create_connection(parse_addr(a.connect), timeout=30)
        recv_upto_ = BusyNested(c).recv_upto if a.busy_nested else (lambda n: recv_upto(c, n))
        c.sendall(data)
        back = recv_upto_(len(data))
        out["echoed"], out["same"] = len(back), back == data
        if a.busy_nested:
            # The server leads: each of its messages comes back.
            while True:
                msg = recv_upto_(4096)
                if not msg:
                    break
                out["bad"] += msg != message(out["rounds"])
                c.sendall(msg)
                out["rounds"] += 1
            c.close()
            print(json.dumps(out), flush=True)
            return 1 if out["bad"] or not out["same"] else 0
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            n = out["rounds"]
            msg = message(n)
            c.sendall(msg)
            out["bad"] += recv_upto_(len(msg)) != msg
            out["rounds"] = n + 1
            time.sleep(0.002)
        c.shutdown(socket.SHUT_WR)
        recv_upto(c, 1)
        c.close()
    except OSError as exc:
        out["error"] = repr(exc)
    print(json.dumps(out), flush=True)
    return 1 if "error" in out or out["bad"] or not out["same"] else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("--bind")
    ap.add_argument("--connect")
    ap.add_argument("--accept-after", type=float, default=0.5)
    ap.add_argument("--bytes", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--busy-nested", action="store_true")
    ap.add_argument("--quiet-after", type=float, default=2.0)
    a = ap.parse_args()
    sys.exit(server(a) if a.role == "server" else client(a))


if __name__ == "__main__":
    main()
