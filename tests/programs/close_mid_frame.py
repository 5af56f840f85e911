#!/usr/bin/env python3
"""A program that closes right after a non-blocking send the kernel took only part of.

    close_mid_frame.py server --addr IP:PORT [--delay S]
    close_mid_frame.py client --addr IP:PORT [--chunk BYTES]

The client connects, makes its socket non-blocking, sends chunks of a fixed pattern until
the send says EAGAIN (the server reads nothing yet, so the sockets fill up and the last send
is taken in part), and closes at once. The server takes one connection, waits S seconds
(default 1), then reads to the end. Each prints one JSON line: the client {"sent",
"sha256"} (of the bytes its sends accepted), the server {"received", "sha256", "error"}.
A layer that ends the connection before the rest of a frame cut short by the full socket is
on the wire gives the server fewer bytes than were sent, or an error.
"""
import argparse
import hashlib
import json
import socket
import sys
import time


def addr_of(s):
    host, port = s.rsplit(":", 1)
    return host, int(port)


def pattern(n):
    return bytes((i * 31 + 7) % 251 for i in range(n))


def server(a):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(addr_of(a.addr))
    ls.listen(1)
    print("listening", file=sys.stderr, flush=True)
    c, _ = ls.accept()
    time.sleep(a.delay)
    c.settimeout(30)
    h, n, err = hashlib.sha256(), 0, None
    try:
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            h.update(b)
            n += len(b)
    except OSError as e:
        err = repr(e)
    print(json.dumps({"received": n, "sha256": h.hexdigest(), "error": err}), flush=True)


def client(a):
    s = socket.create_connection(addr_of(a.addr))
    s.setblocking(False)
    chunk = pattern(a.chunk)
    h, n = hashlib.sha256(), 0
    while True:
        try:
            k = s.send(chunk)
        except BlockingIOError:
            break
        h.update(chunk[:k])
        n += k
        if k < len(chunk):
            break
    s.close()
    print(json.dumps({"sent": n, "sha256": h.hexdigest()}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("--addr", required=True)
    ap.add_argument("--delay", type=float, default=1.0)
    ap.add_argument("--chunk", type=int, default=300000)
    a = ap.parse_args()
    server(a) if a.role == "server" else client(a)


if __name__ == "__main__":
    main()
