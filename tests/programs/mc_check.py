#!/usr/bin/env python3
"""Stores values in memcached and reads them back over its text protocol, checking every
byte (values of 1 B to 512 KiB, several connections at once, pipelined commands).

    mc_check.py --server IP:PORT [--conns N] [--rounds R] [--seconds S]

Each of N connections (threads) sets R keys of its own with random values of many sizes, in
batches of pipelined `set` commands, reads them back with `get` (several keys per command,
and each on its own), and checks each value; with --seconds it goes on doing so until then.
Prints one JSON line: {"sets": ..., "gets": ..., "bytes": ..., "bad": 0} ("error" on failure).
"""

import argparse
import json
import os
import random
import socket
import threading
import time

SIZES = [1, 7, 100, 1000, 1400, 4096, 9000, 65536, 100_000, 512 * 1024]


class Conn:
    def __init__(self, addr):
        self.s = socket.create_connection(addr, timeout=30)
        self.buf = b""

    def line(self):
        while b"\r\n" not in self.buf:
            chunk = self.s.recv(1 << 20)
            if not chunk:
                raise ConnectionError("end of stream")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def exact(self, n):
        while len(self.buf) < n:
            chunk = self.s.recv(1 << 20)
            if not chunk:
                raise ConnectionError("end of stream")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def set_many(self, items):
        self.s.sendall(b"".join(b"set %s 0 0 %d\r\n%s\r\n" % (k, len(v), v) for k, v in items))
        for _ in items:
            r = self.line()
            if r != b"STORED":
                raise ValueError(f"set answered {r!r}")

    def get_many(self, keys):
        self.s.sendall(b"get " + b" ".join(keys) + b"\r\n")
        got = {}
        while True:
            head = self.line()
            if head == b"END":
                return got
            parts = head.split()
            if len(parts) != 4 or parts[0] != b"VALUE":
                raise ValueError(f"get answered {head!r}")
            got[parts[1]] = self.exact(int(parts[3]))
            if self.exact(2) != b"\r\n":
                raise ValueError("a value not followed by CRLF")


def worker(addr, n, rounds, until, out, lock):
    rng = random.Random(n)
    c = Conn(addr)
    sets = gets = nbytes = bad = 0
    r = 0
    while r < rounds or time.monotonic() < until:
        items = []
        for i in range(8):
            size = rng.choice(SIZES)
            items.append((b"k%d-%d-%d" % (n, r, i), os.urandom(size)))
        c.set_many(items)
        sets += len(items)
        want = dict(items)
        got = c.get_many(list(want))
        got.update(c.get_many([items[0][0]]))
        gets += len(items) + 1
        for k, v in want.items():
            nbytes += len(v)
            bad += got.get(k) != v
        r += 1
    c.s.close()
    with lock:
        out["sets"] += sets
        out["gets"] += gets
        out["bytes"] += nbytes
        out["bad"] += bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=0)
    a = ap.parse_args()
    host, _, port = a.server.rpartition(":")
    addr = (host, int(port))
    out = {"sets": 0, "gets": 0, "bytes": 0, "bad": 0}
    lock = threading.Lock()
    errors = []
    until = time.monotonic() + a.seconds

    def run(n):
        try:
            worker(addr, n, a.rounds, until, out, lock)
        except (OSError, ValueError) as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(n,)) for n in range(a.conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        out["error"] = errors[0]
    print(json.dumps(out), flush=True)
    return 1 if errors or out["bad"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
