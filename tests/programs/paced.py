#!/usr/bin/env python3
"""Paced messages and their echo, for the tests of taps (profile, capture): the client
connects, waits until a file appears (the test's go-ahead, once it set up what watches the
connection), sends COUNT messages of SIZE bytes EVERY milliseconds apart, reads the echo of
all of them, and prints one JSON line: {"sent": N, "echoed": N, "sha256": HEX} (of the bytes
sent; the echo is checked to be the same). Message k is its number and a pattern, so the
stream's content is known in advance: `payload(count, size)`.

    paced.py server --bind IP:PORT
    paced.py client --connect IP:PORT --go FILE --count N --size BYTES --every MS
"""

import argparse
import hashlib
import json
import os
import socket
import sys
import time


def message(k, size):
    head = b"message %06d " % k
    return (head + b"abcdefghijklmnopqrstuvwxyz0123456789" * (size // 36 + 2))[:size]


def payload(count, size):
    return b"".join(message(k, size) for k in range(count))


def addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def server(a):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(addr(a.bind))
    ls.listen(4)
    c, _ = ls.accept()
    while True:
        b = c.recv(65536)
        if not b:
            break
        c.sendall(b)
    c.close()
    return 0


def client(a):
    s = socket.create_connection(addr(a.connect))
    deadline = time.monotonic() + 30
    while not os.path.exists(a.go):
        if time.monotonic() > deadline:
            print(json.dumps({"error": "no go-ahead"}), flush=True)
            return 1
        time.sleep(0.02)
    want = payload(a.count, a.size)
    for k in range(a.count):
        s.sendall(message(k, a.size))
        time.sleep(a.every / 1000)
    got = b""
    while len(got) < len(want):
        b = s.recv(65536)
        if not b:
            break
        got += b
    print(json.dumps({"sent": len(want), "echoed": len(got), "same": got == want,
                      "sha256": hashlib.sha256(want).hexdigest()}), flush=True)
    time.sleep(a.hold)
    s.close()
    return 0


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="role", required=True)
    sv = sub.add_parser("server")
    sv.add_argument("--bind", required=True)
    cl = sub.add_parser("client")
    cl.add_argument("--connect", required=True)
    cl.add_argument("--go", required=True)
    cl.add_argument("--count", type=int, default=50)
    cl.add_argument("--size", type=int, default=1000)
    cl.add_argument("--every", type=float, default=10)
    cl.add_argument("--hold", type=float, default=1)
    a = ap.parse_args()
    return server(a) if a.role == "server" else client(a)


if __name__ == "__main__":
    sys.exit(main())
