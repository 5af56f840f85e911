#!/usr/bin/env python3
"""A forking server whose child streams to the client while the parent keeps its copy of the
connection open, for checking that a connection shared by two processes survives a failover
(whichever process rebuilds the link, the other one takes the new link over).

    fork_stream.py server --bind IP:PORT [--seconds S]
    fork_stream.py client --connect IP:PORT

The server accepts one connection and forks; the child sends 64 KiB writes of a known pattern
for S seconds (default 5), half-closes and prints {"role": "child", "sent_bytes", "sent_sha256"};
the parent waits for the child, then closes its copy. The client reads to end of stream and
prints {"role": "client", "recv_bytes", "recv_sha256"}; any error is reported as "error".
"""

import argparse
import hashlib
import json
import os
import socket
import sys
import time


def addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def server(args):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(addr(args.bind))
    ls.listen()
    conn, _ = ls.accept()
    pid = os.fork()
    if pid == 0:
        out = {"role": "child", "pid": os.getpid()}
        h = hashlib.sha256()
        n = 0
        try:
            t0 = time.monotonic()
            i = 0
            while time.monotonic() - t0 < args.seconds:
                block = bytes([i % 251]) * 65536
                conn.sendall(block)
                h.update(block)
                n += len(block)
                i += 1
                time.sleep(0.002)
            conn.shutdown(socket.SHUT_WR)
        except OSError as exc:
            out["error"] = repr(exc)
        out.update(sent_bytes=n, sent_sha256=h.hexdigest())
        print(json.dumps(out), flush=True)
        os._exit(0 if "error" not in out else 1)
    _, status = os.waitpid(pid, 0)
    time.sleep(0.5)
    conn.close()
    return 0 if status == 0 else 1


def client(args):
    out = {"role": "client"}
    h = hashlib.sha256()
    n = 0
    try:
        s = socket.create_connection(addr(args.connect))
        while True:
            data = s.recv(65536)
            if not data:
                break
            h.update(data)
            n += len(data)
        s.close()
    except OSError as exc:
        out["error"] = repr(exc)
    out.update(recv_bytes=n, recv_sha256=h.hexdigest())
    print(json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("--bind")
    p.add_argument("--connect")
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    sys.exit(server(args) if args.role == "server" else client(args))


if __name__ == "__main__":
    main()
