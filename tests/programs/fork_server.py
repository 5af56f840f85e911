#!/usr/bin/env python3
"""A classic forking server: accept, fork, the child serves the connection.

    fork_server.py --bind IP:PORT --mode hash [--hold S]
    fork_server.py --bind IP:PORT --mode both [--hold S]

mode hash: the parent closes its copy of the connection at once; the child reads until the
    client half-closes, answers "<sha256 hex> <byte count>\\n", keeps the connection open
    --hold seconds, closes it and exits.
mode both: parent and child both write to the inherited connection. The child writes
    "child\\n" and exits; the parent waits for it (waitpid), waits --hold seconds more, then
    writes "parent\\n" and closes. The client must read exactly "child\\nparent\\n".

Runs until killed. Children are reaped as they exit.
"""

import argparse
import hashlib
import os
import socket
import sys
import time


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def child_hash(conn, hold):
    h = hashlib.sha256()
    n = 0
    while True:
        data = conn.recv(256 * 1024)
        if not data:
            break
        h.update(data)
        n += len(data)
    conn.sendall(f"{h.hexdigest()} {n}\n".encode())
    if hold > 0:
        time.sleep(hold)
    conn.close()


def serve(args):
    host, port = args.bind
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((host, port))
    lsock.listen(128)
    while True:
        conn, _ = lsock.accept()
        reap()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                lsock.close()
                if args.mode == "hash":
                    child_hash(conn, args.hold)
                else:
                    conn.sendall(b"child\n")
                    conn.close()
            except Exception as exc:
                print(f"fork_server child {os.getpid()}: {exc!r}", file=sys.stderr, flush=True)
                code = 1
            finally:
                os._exit(code)
        if args.mode == "hash":
            conn.close()
        else:
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                print(f"fork_server: child {pid} failed", file=sys.stderr, flush=True)
            if args.hold > 0:
                time.sleep(args.hold)
            conn.sendall(b"parent\n")
            conn.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bind", type=parse_addr, required=True)
    p.add_argument("--mode", choices=["hash", "both"], required=True)
    p.add_argument("--hold", type=float, default=0.0)
    args = p.parse_args()
    serve(args)


if __name__ == "__main__":
    sys.exit(main())
