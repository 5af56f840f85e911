#!/usr/bin/env python3
"""Checks that every "readable" a wait reports is true: a recv right after it gives data or
the end, never EAGAIN, as on a native TCP socket (some programs depend on it).

    honest_ready.py server --addr IP:PORT [--slow]
    honest_ready.py client --addr IP:PORT --wait epoll|epoll-et|epoll-oneshot|poll|select
                           [--mib N] [--pause-after MIB --pause S]

The client sends N MiB (default 64) of a pattern on a non-blocking socket, waiting for
room and for readability with the chosen primitive (readable is always asked for, as MPI
progress engines do), then shuts its sending side. The server reads everything (with
--slow: 1 ms of sleep per 64 KiB, so a shared-memory ring fills and the writer is woken
for room), then answers with one JSON line of the byte count and SHA-256, and closes. So
while the client sends, nothing but the layer's own frames (acknowledgements, bells) comes
its way. With --pause-after the client stops sending for --pause seconds after that many
MiB (an operator moves the connection meanwhile).

The client prints one JSON line: {"role", "wait", "sent", "readable_reports",
"spurious", "answer_ok"}; "spurious" counts reports whose first recv said EAGAIN. The server
prints {"role", "received", "sha256"}.
"""
import argparse
import hashlib
import json
import os
import select
import socket
import sys
import time

CHUNK = 64 * 1024


def pattern(i):
    return bytes([(i * 31 + k) % 253 for k in range(256)]) * (CHUNK // 256)


def serve(addr, slow):
    host, port = addr.rsplit(":", 1)
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, int(port)))
    ls.listen(1)
    print(json.dumps({"role": "server", "listening": addr}), flush=True)
    c, _ = ls.accept()
    h = hashlib.sha256()
    n = 0
    while True:
        b = c.recv(CHUNK)
        if not b:
            break
        h.update(b)
        n += len(b)
        if slow and n % CHUNK < len(b):
            time.sleep(0.001)
    out = {"role": "server", "received": n, "sha256": h.hexdigest()}
    c.sendall((json.dumps(out) + "\n").encode())
    c.close()
    print(json.dumps(out), flush=True)


class Waiter:
    """One wait primitive over one socket: wait(want_write) -> (readable, writable)."""

    def __init__(self, kind, fd):
        self.kind, self.fd = kind, fd
        if kind.startswith("epoll"):
            self.ep = select.epoll()
            self.flags = {"epoll": 0, "epoll-et": select.EPOLLET,
                          "epoll-oneshot": select.EPOLLONESHOT}[kind]
            self.mask = None
        elif kind == "poll":
            self.p = select.poll()
            self.p.register(fd, select.POLLIN)
            self.mask = select.POLLIN

    def wait(self, want_write):
        if self.kind.startswith("epoll"):
            mask = select.EPOLLIN | (select.EPOLLOUT if want_write else 0) | self.flags
            if self.mask is None:
                self.ep.register(self.fd, mask)
            elif mask != self.mask or self.flags == select.EPOLLONESHOT:
                self.ep.modify(self.fd, mask)
            self.mask = mask
            ev = self.ep.poll(5.0)
            bits = ev[0][1] if ev else 0
            return bool(bits & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR)), \
                bool(bits & select.EPOLLOUT)
        if self.kind == "poll":
            mask = select.POLLIN | (select.POLLOUT if want_write else 0)
            if mask != self.mask:
                self.p.modify(self.fd, mask)
                self.mask = mask
            ev = self.p.poll(5000)
            bits = ev[0][1] if ev else 0
            return bool(bits & (select.POLLIN | select.POLLHUP | select.POLLERR)), \
                bool(bits & select.POLLOUT)
        r, w, _ = select.select([self.fd], [self.fd] if want_write else [], [], 5.0)
        return bool(r), bool(w)


def client(addr, kind, mib, pause_after, pause):
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.setblocking(False)
    w = Waiter(kind, s.fileno())
    h = hashlib.sha256()
    total = mib * (1 << 20)
    sent, chunk_i, off = 0, 0, 0
    buf = pattern(0)
    reports = spurious = 0
    answer = b""
    shut = False
    paused = pause_after is None
    while True:
        if not paused and sent >= pause_after * (1 << 20):
            paused = True
            time.sleep(pause)
        want_write = sent < total
        if not want_write and not shut:
            s.shutdown(socket.SHUT_WR)
            shut = True
        readable, writable = w.wait(want_write)
        if readable:
            reports += 1
            first = True
            done = False
            while True:
                try:
                    b = s.recv(65536)
                except BlockingIOError:
                    if first:
                        spurious += 1
                    break
                first = False
                if not b:
                    done = True
                    break
                answer += b
                if kind != "epoll-et":
                    break
            if done:
                break
        if writable and sent < total:
            while sent < total:
                n = min(len(buf) - off, total - sent)
                try:
                    k = s.send(buf[off:off + n])
                except BlockingIOError:
                    break
                h.update(buf[off:off + k])
                sent += k
                off += k
                if off == len(buf):
                    chunk_i += 1
                    buf, off = pattern(chunk_i), 0
                if kind != "epoll-et":
                    break
    s.close()
    try:
        got = json.loads(answer.decode())
        ok = got["received"] == sent and got["sha256"] == h.hexdigest()
    except (ValueError, KeyError):
        ok = False
    print(json.dumps({"role": "client", "wait": kind, "sent": sent, "readable_reports": reports,
                      "spurious": spurious, "answer_ok": ok}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("--addr", required=True)
    ap.add_argument("--wait", default="epoll",
                    choices=["epoll", "epoll-et", "epoll-oneshot", "poll", "select"])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--slow", action="store_true")
    ap.add_argument("--pause-after", type=int)
    ap.add_argument("--pause", type=float, default=0.0)
    a = ap.parse_args()
    if a.role == "server":
        serve(a.addr, a.slow)
    else:
        client(a.addr, a.wait, a.mib, a.pause_after, a.pause)
    return 0


if __name__ == "__main__":
    sys.exit(main())
