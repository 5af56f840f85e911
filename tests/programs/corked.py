#!/usr/bin/env python3
"""Request and corked response, as nginx serves a file with `tcp_nopush on`: the server turns
Nagle's algorithm off once, then answers each one-byte request by setting TCP_CORK, sending
the response, and clearing TCP_CORK. A kernel socket sends everything by the time the cork is
cleared; a layer whose wake-ups travel through the corked socket stalls 200 ms at a time.

    corked.py server --bind IP:PORT --bytes N
    corked.py client --connect IP:PORT --bytes N --rounds R [--gap S]

The server prints {"rounds", "cork_read", "nodelay_read"}: what getsockopt said for TCP_CORK
right after setting it, and for TCP_NODELAY after each response (the program set it to 0).
The client prints {"rounds", "round_ms" (each round's request-to-last-byte time), "ok"
(every response byte as expected)}; "error" on failure. --gap sleeps between rounds, so that
a test can act on the connection while it lasts.
"""

import argparse
import json
import socket
import time


def pattern(rnd, n):
    """Round rnd's response: n bytes that differ from round to round."""
    block = bytes((rnd * 131 + i * 7) & 0xFF for i in range(251))
    return (block * (n // len(block) + 1))[:n]


def recv_exactly(sock, n):
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def server(a):
    host, _, port = a.bind.rpartition(":")
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, int(port)))
    ls.listen(1)
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
    out = {"rounds": 0, "cork_read": [], "nodelay_read": []}
    while True:
        req = conn.recv(1)
        if req != b"r":
            break
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        out["cork_read"].append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK))
        conn.sendall(pattern(out["rounds"], a.bytes))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
        out["nodelay_read"].append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        out["rounds"] += 1
    conn.close()
    print(json.dumps(out), flush=True)


def client(a):
    host, _, port = a.connect.rpartition(":")
    out = {"rounds": 0, "round_ms": [], "ok": True}
    try:
        s = socket.create_connection((host, int(port)))
        for rnd in range(a.rounds):
            if rnd and a.gap:
                time.sleep(a.gap)
            t0 = time.monotonic()
            s.sendall(b"r")
            got = recv_exactly(s, a.bytes)
            out["round_ms"].append(round((time.monotonic() - t0) * 1000, 2))
            out["ok"] = out["ok"] and got == pattern(rnd, a.bytes)
            out["rounds"] += 1
        s.sendall(b"q")
        s.close()
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("--bind")
    ap.add_argument("--connect")
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--gap", type=float, default=0.0)
    a = ap.parse_args()
    (server if a.role == "server" else client)(a)


if __name__ == "__main__":
    main()
