#!/usr/bin/env python3
"""A client that sends before its server accepts, then the two talk on (MPI ranks on one node
connect like this: each sends on its new connection before the other rank accepts it).

    late_accept.py server --bind IP:PORT [--accept-after S]
    late_accept.py client --connect IP:PORT [--bytes N] [--seconds S]

The server listens, waits --accept-after seconds (default 0.5), accepts one connection and
sends back everything it reads until the end of stream. The client connects, sends N bytes
(default 3000) at once, reads them back, then for --seconds sends a numbered 4 KiB message
every 2 ms and checks that it comes back. The client prints one JSON line:

    {"echoed": N, "same": true, "rounds": R, "bad": 0}   ("error" on failure)
"""

import argparse
import json
import os
import socket
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


def server(a):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(parse_addr(a.bind))
    ls.listen(4)
    time.sleep(a.accept_after)
    s, _ = ls.accept()
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
    a = ap.parse_args()
    sys.exit(server(a) if a.role == "server" else client(a))


if __name__ == "__main__":
    main()
