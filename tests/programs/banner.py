#!/usr/bin/env python3
"""Server-speaks-first protocol (like SSH, SMTP or a database greeting), then echo.

    banner.py server --bind IP:PORT
    banner.py client --connect IP:PORT [--rounds 20] [--seed S] [--hold S]

The server sends BANNER the moment it accepts a connection, before reading anything, then
echoes what it receives until end of stream. The client connects, sends nothing until it has
the whole banner, times how long it took, checks it byte for byte, then runs --rounds echo
round trips, keeps the connection open --hold seconds, and prints one JSON line:

    {"banner_ok": true, "banner_seconds": 0.0003, "echo_ok": true, "rounds": 20}

and exits 1 if anything differed. The client gives up waiting for the banner after 10 s.
"""

import argparse
import json
import random
import socket
import sys
import threading
import time

BANNER = b"220 vmi-banner.test ESMTP service ready; greeting sent before any request\r\n"
BANNER_WAIT = 10.0


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def serve_conn(conn):
    try:
        conn.sendall(BANNER)
        while True:
            data = conn.recv(65536)
            if not data:
                break
            conn.sendall(data)
    except OSError as exc:
        print(f"banner server: {exc!r}", file=sys.stderr, flush=True)
    finally:
        conn.close()


def server(args):
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(args.bind)
    lsock.listen(128)
    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=serve_conn, args=(conn,), daemon=True).start()


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            break
        buf += data
    return buf


def client(args):
    result = {"banner_ok": False, "echo_ok": False, "rounds": 0}
    sock = socket.create_connection(args.connect)
    connected = time.monotonic()
    sock.settimeout(BANNER_WAIT)
    try:
        banner = recv_exact(sock, len(BANNER))
        result["banner_seconds"] = round(time.monotonic() - connected, 6)
        result["banner_ok"] = banner == BANNER
        if not result["banner_ok"]:
            result["banner_received"] = banner.decode("latin-1")
        rng = random.Random(args.seed)
        echo_ok = True
        for _ in range(args.rounds):
            msg = rng.randbytes(rng.randint(1, 8192))
            sock.sendall(msg)
            if recv_exact(sock, len(msg)) != msg:
                echo_ok = False
                break
            result["rounds"] += 1
        result["echo_ok"] = echo_ok
        if args.hold > 0:
            time.sleep(args.hold)
        sock.shutdown(socket.SHUT_WR)
        rest = recv_exact(sock, 1)
        if rest:
            result["echo_ok"] = False
            result["trailing"] = rest.decode("latin-1")
    except OSError as exc:
        result["error"] = repr(exc)
    sock.close()
    print(json.dumps(result), flush=True)
    return 0 if result["banner_ok"] and result["echo_ok"] and "error" not in result else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server")
    s.add_argument("--bind", type=parse_addr, required=True)
    c = sub.add_parser("client")
    c.add_argument("--connect", type=parse_addr, required=True)
    c.add_argument("--rounds", type=int, default=20)
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--hold", type=float, default=0.0)
    args = p.parse_args()
    return server(args) if args.cmd == "server" else client(args)


if __name__ == "__main__":
    sys.exit(main())
