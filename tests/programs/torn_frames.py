#!/usr/bin/env python3
"""A reader that takes each message exactly, while its socket's queue often ends inside the
next one: every readable report must still be followed by data (or the end) for `recv`,
never EAGAIN, as on a native socket.

    torn_frames.py server --addr IP:PORT [--messages N] [--seed S] [--rcvbuf B]
    torn_frames.py client --addr IP:PORT [--messages N] [--seed S] [--mss M]

The client sends N messages of 1 to 200 bytes (sizes from the seed; one `send` each) of a
pattern, then shuts its sending side. With `--mss` it sets `TCP_MAXSEG` before it connects:
segments of 88 bytes cut the stream every few dozen bytes, so the server's queue ends at
arbitrary offsets of it, and the server, which keeps up, meets those ends. The server knows
the sizes (same seed) and reads as a message-passing library does: it waits for input with
`epoll` (level-triggered, non-blocking socket) and asks `recv` for exactly the rest of the
current message, one call per report.

Natively every byte that makes the socket readable is the program's. Under the layer each
message travels in a frame, and a queue that ends inside the next frame's header (or right
after it) holds nothing for the program once the current message is read: a report then
would be followed by EAGAIN (UCX, under MPICH, follows a null pointer on such an EAGAIN in
the middle of a message).

The server prints one JSON line: {"role", "received", "sha256", "readable_reports",
"spurious", "in_order"}; the client {"role", "sent", "sha256"}.
"""
import argparse
import hashlib
import json
import random
import select
import socket
import sys


def sizes(seed, n):
    rng = random.Random(seed)
    return [rng.randint(1, 200) for _ in range(n)]


def pattern(n, at):
    return bytes((at + k) * 7 % 251 for k in range(n))


def serve(addr, messages, seed, rcvbuf):
    host, port = addr.rsplit(":", 1)
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # (On the listener: an accepted socket takes its buffer sizes from it, before its window
    # is first announced.)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    ls.bind((host, int(port)))
    ls.listen(1)
    print(json.dumps({"role": "server", "listening": addr}), flush=True)
    s, _ = ls.accept()
    s.setblocking(False)
    ep = select.epoll()
    ep.register(s.fileno(), select.EPOLLIN)
    h = hashlib.sha256()
    received = reports = spurious = 0
    in_order = True
    todo = sizes(seed, messages)
    at = 0       # message being read
    left = todo[0] if todo else 0
    while True:
        if not ep.poll(5.0):
            continue
        reports += 1
        want = left if at < len(todo) else 4096
        try:
            b = s.recv(want)
        except BlockingIOError:
            spurious += 1
            continue
        if not b:
            break
        in_order = in_order and b == pattern(len(b), received)
        h.update(b)
        received += len(b)
        if at < len(todo):
            left -= len(b)
            if left == 0:
                at += 1
                left = todo[at] if at < len(todo) else 0
    print(json.dumps({"role": "server", "received": received, "sha256": h.hexdigest(),
                      "readable_reports": reports, "spurious": spurious,
                      "in_order": in_order}), flush=True)
    s.close()


def client(addr, messages, seed, mss):
    host, port = addr.rsplit(":", 1)
    s = socket.socket()
    if mss:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss)
    s.connect((host, int(port)))
    h = hashlib.sha256()
    sent = 0
    for n in sizes(seed, messages):
        m = pattern(n, sent)
        s.sendall(m)
        h.update(m)
        sent += n
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    print(json.dumps({"role": "client", "sent": sent, "sha256": h.hexdigest()}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("--addr", required=True)
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rcvbuf", type=int, default=65536)
    p.add_argument("--mss", type=int, default=0)
    a = p.parse_args()
    if a.role == "server":
        serve(a.addr, a.messages, a.seed, a.rcvbuf)
    else:
        client(a.addr, a.messages, a.seed, a.mss)


if __name__ == "__main__":
    sys.exit(main())
