#!/usr/bin/env python3
"""A writer that ends its stream and leaves with `_exit`, as forked C servers often do.

    exit_stream.py server --bind IP:PORT --bytes N --go FILE
    exit_stream.py client --connect IP:PORT --bytes N

The server accepts one connection, sends N bytes of a known pattern, prints {"sent": N},
waits until FILE exists, then half-closes (shutdown SHUT_WR) and leaves at once with
os._exit(0): no exit handlers run. The client reads N bytes, prints {"got": N}, then reads
on until the end of stream and prints {"recv_bytes", "recv_sha256", "end": "eof"} or, if a
call fails, {"error": ...} with what it had.
"""

import argparse
import hashlib
import json
import os
import socket
import sys
import time


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def pattern(n):
    block = bytes(range(251)) * 300
    out = bytearray()
    while len(out) < n:
        out += block
    return bytes(out[:n])


def server(args):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(parse_addr(args.bind))
    ls.listen()
    c, _ = ls.accept()
    c.sendall(pattern(args.bytes))
    print(json.dumps({"sent": args.bytes}), flush=True)
    while not os.path.exists(args.go):
        time.sleep(0.005)
    c.shutdown(socket.SHUT_WR)
    os._exit(0)


def client(args):
    s = socket.create_connection(parse_addr(args.connect))
    h = hashlib.sha256()
    n = 0
    out = {}
    told = False
    try:
        while True:
            b = s.recv(65536)
            if not b:
                out["end"] = "eof"
                break
            h.update(b)
            n += len(b)
            if n >= args.bytes and not told:
                print(json.dumps({"got": n}), flush=True)
                told = True
    except OSError as exc:
        out["error"] = repr(exc)
    out.update(recv_bytes=n, recv_sha256=h.hexdigest())
    print(json.dumps(out), flush=True)
    return 1 if "error" in out else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("--bind")
    ap.add_argument("--connect")
    ap.add_argument("--bytes", type=int, default=1 << 20)
    ap.add_argument("--go")
    args = ap.parse_args()
    sys.exit(server(args) if args.role == "server" else client(args))


if __name__ == "__main__":
    main()
