#!/usr/bin/env python3
"""A forking server where one of the two processes streams to the client over the accepted
connection, for checking that a connection shared by two processes survives a failover
(whichever process rebuilds the link, the other one takes the new link over), and that one
whose other holder closed its copy does too.

    fork_stream.py server --bind IP:PORT [--seconds S] [--streamer child|parent] [--idle-closes]
                          [--streamer-waits W]
    fork_stream.py client --connect IP:PORT

The server accepts one connection and forks; the streamer (the child unless --streamer parent)
sends 64 KiB writes of a known pattern for S seconds (default 5), half-closes and prints
{"role": "child"|"parent", "sent_bytes", "sent_sha256"}; the other process keeps its copy of
the connection open until the child is done, then closes it. The client reads to end of stream
and prints {"role": "client", "recv_bytes", "recv_sha256"}; any error is reported as "error".

--idle-closes: the process that does not stream closes its copy right after fork (the classic
    forking server, or a child closing what it inherited) and prints {"role": ..., "event":
    "closed"}; it makes no other call on the connection.
--streamer-waits W: the streamer sleeps W seconds before its first call on the connection (it
    does not touch it at all meanwhile).
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


def stream(conn, role, args):
    """Sends the pattern for args.seconds, half-closes; the JSON result line."""
    out = {"role": role, "pid": os.getpid()}
    h = hashlib.sha256()
    n = 0
    time.sleep(args.streamer_waits)
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
    return out


def server(args):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(addr(args.bind))
    ls.listen()
    conn, _ = ls.accept()
    pid = os.fork()
    me = "child" if pid == 0 else "parent"
    if me == args.streamer:
        out = stream(conn, me, args)
        print(json.dumps(out), flush=True)
        if pid == 0:
            os._exit(0 if "error" not in out else 1)
        _, status = os.waitpid(pid, 0)
        conn.close()
        return 0 if status == 0 and "error" not in out else 1
    if args.idle_closes:
        conn.close()
        print(json.dumps({"role": me, "event": "closed"}), flush=True)
    if pid == 0:
        # The idle child stays a while (its exit must not matter either way).
        time.sleep(args.streamer_waits + args.seconds)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if not args.idle_closes:
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
    p.add_argument("--streamer", choices=["child", "parent"], default="child")
    p.add_argument("--idle-closes", action="store_true")
    p.add_argument("--streamer-waits", type=float, default=0.0)
    args = p.parse_args()
    sys.exit(server(args) if args.role == "server" else client(args))


if __name__ == "__main__":
    main()
