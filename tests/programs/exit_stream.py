#!/usr/bin/env python3
"""A writer that ends its stream and its process at once, with bytes still on their way.

    exit_stream.py server --bind IP:PORT --first N --wait-file F --rest M [--exit _exit|exit]
    exit_stream.py client --connect IP:PORT --first N

The server accepts one connection, sends N bytes of a known pattern, waits until the file F
exists (the test breaks and repairs a network meanwhile), sends M bytes more, prints
{"role": "server", "sent_bytes", "sent_sha256"}, half-closes (shutdown(SHUT_WR)) and ends at
once: os._exit(0) (no destructors run), or sys.exit(0) with --exit exit. The client reads the
first N bytes, prints {"event": "first"}, then reads to the end of stream and prints
{"role": "client", "recv_bytes", "recv_sha256"}; an error is reported as "error".
"""

import argparse
import hashlib
import json
import os
import socket
import sys
import time

CHUNK = 1 << 16


def addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def pattern(off, n):
    return bytes((off + i) * 7 % 251 for i in range(n))


BLOCK = pattern(0, 251 * 261)  # a whole number of periods, longer than CHUNK


def piece(off, n):
    start = off % 251
    return BLOCK[start:start + n]


def say(d):
    print(json.dumps(d), flush=True)


def server(a):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(addr(a.bind))
    ls.listen(1)
    conn, _ = ls.accept()
    h = hashlib.sha256()
    sent = 0

    def send(n):
        nonlocal sent
        end = sent + n
        while sent < end:
            b = piece(sent, min(CHUNK, end - sent))
            conn.sendall(b)
            h.update(b)
            sent += len(b)

    send(a.first)
    while not os.path.exists(a.wait_file):
        time.sleep(0.02)
    send(a.rest)
    say({"role": "server", "sent_bytes": sent, "sent_sha256": h.hexdigest()})
    conn.shutdown(socket.SHUT_WR)
    if a.exit == "_exit":
        os._exit(0)
    sys.exit(0)


def client(a):
    s = socket.create_connection(addr(a.connect))
    h = hashlib.sha256()
    got = 0
    told = False
    try:
        while True:
            b = s.recv(1 << 16)
            if not b:
                break
            h.update(b)
            got += len(b)
            if not told and got >= a.first:
                say({"event": "first"})
                told = True
        say({"role": "client", "recv_bytes": got, "recv_sha256": h.hexdigest()})
    except OSError as e:
        say({"role": "client", "recv_bytes": got, "error": str(e)})
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("--bind")
    ap.add_argument("--connect")
    ap.add_argument("--first", type=int, default=1 << 20)
    ap.add_argument("--rest", type=int, default=32 << 20)
    ap.add_argument("--wait-file")
    ap.add_argument("--exit", choices=["_exit", "exit"], default="_exit")
    a = ap.parse_args()
    server(a) if a.role == "server" else client(a)


if __name__ == "__main__":
    main()
