#!/usr/bin/env python3
"""Echo client that goes quiet in the middle: one echo, then nothing for a while, then more.

    idle_echo.py --connect IP:PORT --idle S [--bytes N]

Echoes 64 KiB through an echo server, prints {"event": "idle"}, makes no call on the
connection for S seconds (or until SIGUSR1), then echoes N more bytes (default 4 MiB) in 64 KiB pieces and checks
every byte that comes back. Prints one JSON line ({"echoed": bytes, "same": true|false} or
{"error": ...}) and exits 1 on any difference or error.
"""

import argparse
import json
import os
import signal
import socket
import sys
import time

CHUNK = 64 * 1024


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def echo(sock, data):
    sock.sendall(data)
    got = bytearray()
    while len(got) < len(data):
        b = sock.recv(len(data) - len(got))
        if not b:
            raise ConnectionError("the server closed the connection mid-echo")
        got += b
    return bytes(got) == data


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", type=parse_addr, required=True)
    p.add_argument("--idle", type=float, required=True)
    p.add_argument("--bytes", type=int, default=4 << 20)
    a = p.parse_args()
    out = {"echoed": 0, "same": True}
    try:
        sock = socket.create_connection(a.connect, timeout=60)
        out["same"] &= echo(sock, os.urandom(CHUNK))
        out["echoed"] += CHUNK
        go = []
        signal.signal(signal.SIGUSR1, lambda *_: go.append(1))
        print(json.dumps({"event": "idle"}), flush=True)
        end = time.monotonic() + a.idle
        while not go and time.monotonic() < end:
            time.sleep(0.01)
        t0 = time.monotonic()
        left = a.bytes
        while left > 0:
            n = min(CHUNK, left)
            out["same"] &= echo(sock, os.urandom(n))
            out["echoed"] += n
            left -= n
        out["seconds_after_idle"] = round(time.monotonic() - t0, 3)
        sock.close()
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)
    return 0 if out["same"] and "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
