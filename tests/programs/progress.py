#!/usr/bin/env python3
"""Request/response in the manner of an MPI progress engine, to count system calls.

    progress.py server --bind IP:PORT
    progress.py client --connect IP:PORT [--messages N] [--size S] [--hold S]

Every message is a 8-byte header (its body's length) and a body, written with one
`writev` of two buffers; the receiver sets its socket non-blocking, polls with a zero
time-out until it is readable (busy polling, as Open MPI's TCP transport does), then reads
with `readv` into two buffers (a header of 8 bytes and a body buffer of 4 KiB) until the
message is whole, stopping at EAGAIN. The server answers each message with one of the same
size. The client checks every byte, keeps the connection open --hold seconds more (for an
observer), and prints one JSON line:

    {"messages": N, "size": S, "bad": 0}
"""

import argparse
import json
import os
import select
import socket
import struct
import sys
import time

HEADER = 8


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def send_msg(s, body):
    os.writev(s.fileno(), [struct.pack("<Q", len(body)), body])


def recv_msg(s, p, body_buf):
    """Reads one message by readv into (header, body_buf); returns the body."""
    head = bytearray(HEADER)
    got_head, body, want = 0, bytearray(), None
    while want is None or len(body) < want:
        while not p.poll(0):
            pass
        try:
            if got_head < HEADER:
                n = os.readv(s.fileno(), [memoryview(head)[got_head:], body_buf])
                if n == 0:
                    raise ConnectionError("end of stream in a message")
                k = min(n, HEADER - got_head)
                got_head += k
                body += body_buf[: n - k]
                if got_head == HEADER:
                    want = struct.unpack("<Q", head)[0]
            else:
                n = os.readv(s.fileno(), [body_buf])
                if n == 0:
                    raise ConnectionError("end of stream in a message")
                body += body_buf[:n]
        except BlockingIOError:
            continue
    return bytes(body)


def poller(s):
    s.setblocking(False)
    p = select.poll()
    p.register(s.fileno(), select.POLLIN)
    return p


def server(args):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(parse_addr(args.bind))
    ls.listen()
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    p = poller(c)
    buf = bytearray(4096)
    while True:
        try:
            body = recv_msg(c, p, buf)
        except ConnectionError:
            break
        c.setblocking(True)
        send_msg(c, body[::-1])
        c.setblocking(False)
    c.close()
    return 0


def client(args):
    s = socket.create_connection(parse_addr(args.connect))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    p = poller(s)
    buf = bytearray(4096)
    bad = 0
    for i in range(args.messages):
        body = bytes((i + j) % 251 for j in range(args.size))
        s.setblocking(True)
        send_msg(s, body)
        s.setblocking(False)
        back = recv_msg(s, p, buf)
        bad += back != body[::-1]
    time.sleep(args.hold)
    s.close()
    print(json.dumps({"messages": args.messages, "size": args.size, "bad": bad}), flush=True)
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("--bind")
    ap.add_argument("--connect")
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--hold", type=float, default=0)
    args = ap.parse_args()
    sys.exit(server(args) if args.role == "server" else client(args))


if __name__ == "__main__":
    main()
