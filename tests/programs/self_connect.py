#!/usr/bin/env python3
"""One thread connects to its own listener and sends before it accepts (UCX does this, and
many socketpair() stand-ins): a kernel socket takes the bytes before the peer accepts, and so
must a virtual connection.

    self_connect.py --bind IP:PORT [--bytes N] [--nonblocking]

Listens, connects, sends N bytes (default 1000; blocking sendall, or with --nonblocking a
non-blocking socket retried on EAGAIN), then accepts, reads them, answers them back and
reads the answer. Prints {"sent", "received", "echoed", "same", "eagain"}; "error" on failure.
"""

import argparse
import errno
import json
import os
import socket
import time


def recv_upto(sock, n):
    """Reads until n bytes came or the stream ended."""
    got = b""
    while len(got) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True)
    ap.add_argument("--bytes", type=int, default=1000)
    ap.add_argument("--nonblocking", action="store_true")
    a = ap.parse_args()
    host, _, port = a.bind.rpartition(":")
    out = {"sent": 0, "received": 0, "echoed": 0, "same": False, "eagain": 0}
    data = os.urandom(a.bytes)
    try:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((host, int(port)))
        ls.listen(4)
        c = socket.create_connection((host, int(port)), timeout=30)
        if a.nonblocking:
            c.setblocking(False)
            deadline = time.monotonic() + 20
            sent = 0
            while sent < len(data):
                try:
                    sent += c.send(data[sent:])
                except BlockingIOError as exc:
                    if exc.errno != errno.EAGAIN or time.monotonic() > deadline:
                        raise
                    out["eagain"] += 1
                    time.sleep(0.001)
            c.setblocking(True)
            c.settimeout(30)
        else:
            c.sendall(data)
        out["sent"] = len(data)
        s, _ = ls.accept()
        s.settimeout(30)
        got = recv_upto(s, len(data))
        out["received"] = len(got)
        s.sendall(got)
        back = recv_upto(c, len(data))
        out["echoed"] = len(back)
        out["same"] = got == data and back == data
        c.close()
        s.close()
    except OSError as exc:
        out["error"] = repr(exc)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
