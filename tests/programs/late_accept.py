#!/usr/bin/env python3
"""A client that sends before its server accepts, then the two talk on (MPI ranks on one node
connect like this: each sends on its new connection before the other rank accepts it).

    late_accept.py server --bind IP:PORT [--accept-after S] [--busy-nested [--quiet-after S]]
    late_accept.py client --connect IP:PORT [--bytes N] [--seconds S]

The server listens, waits --accept-after seconds (default 0.5), accepts one connection and
sends back everything it reads until the end of stream.

With --busy-nested the server waits as UCX's progress engine does: in a busy loop of
zero-time-out waits on an epoll instance that is itself held by a second instance, for
errors only (UCX's progress thread holds its worker's instance so). It then prints one JSON
line: {"bells": B, "reads": R}, the bytes that reached its socket itself (TCP_INFO
bytes_received) and its reads, both counted from --quiet-after seconds after the accept to
the end. Over the layer's shared memory those bytes are wake-ups, which a loop that never
sleeps does not need. The client connects, sends N bytes
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
    got = b""
    while len(got) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


TCP_INFO_BYTES_RECEIVED = 128   # offset of tcpi_bytes_received in struct tcp_info


def bytes_received(sock):
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
    return struct.unpack_from("<Q", info, TCP_INFO_BYTES_RECEIVED)[0]


def busy_nested(s, quiet_after):
    """Echoes in a busy epoll loop on an instance nested in another for errors only."""
    inner, outer = select.epoll(), select.epoll()
    outer.register(inner.fileno(), select.EPOLLERR)
    inner.register(s.fileno(), select.EPOLLIN)
    s.setblocking(False)
    quiet_at = time.monotonic() + quiet_after
    base, reads, ended = None, 0, False
    while not ended:
        if base is None and time.monotonic() >= quiet_at:
            base = bytes_received(s)
        for _fd, _ev in inner.poll(0):
            while True:
                try:
                    m = s.recv(65536)
                except BlockingIOError:
                    break
                if not m:
                    ended = True
                    break
                reads += base is not None
                s.setblocking(True)
                s.sendall(m)
                s.setblocking(False)
    bells = bytes_received(s) - base if base is not None else -1
    print(json.dumps({"bells": bells, "reads": reads}), flush=True)
    inner.close()
    outer.close()
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
        return busy_nested(s, a.quiet_after)
    while True:
        m = s.recv(65536)
        if not m:
            break
        s.sendall(m)
    s.close()
    return 0


def client(a):
    out = {"echoed": 0, "same": False, "rounds": 0, "bad": 0}
    data = os.urandom(a.bytes)
    try:
        c = socket.create_connection(parse_addr(a.connect), timeout=30)
        c.sendall(data)
        back = recv_upto(c, len(data))
        out["echoed"], out["same"] = len(back), back == data
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            n = out["rounds"]
            msg = bytes((n + i) % 251 for i in range(4096))
            c.sendall(msg)
            out["bad"] += recv_upto(c, len(msg)) != msg
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
