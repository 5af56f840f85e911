#!/usr/bin/env python3
"""A server that answers every connection with a message of its own and closes it at once,
before the client has read anything (an HTTP/1.0 server, a daemon that turns a client away
with a reason); with --empty it closes without a word; with --reset it closes with SO_LINGER
0 after its message, which resets the connection.

    say_and_close.py server --bind IP:PORT [--empty | --reset]
    say_and_close.py client --connect IP:PORT [--count N] [--empty | --reset]

The client makes N connections one after the other, reads each to its end, and prints one
JSON line: {"connections": N, "right": R, "errors": {"ConnectionResetError": 3, ...},
"wrong": [...]} where "right" counts the connections that gave exactly the server's message
(or nothing, with --empty) and then the end of stream, as natively; with --reset, the
message, then ECONNRESET (once), then the end of stream, as a socket reads a reset.
"""

import argparse
import json
import socket
import struct


def message(i):
    return b"closing connection %d: " % i + b"x" * (i % 97)


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def server(a):
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(parse_addr(a.bind))
    ls.listen(128)
    i = 0
    while True:
        c, _ = ls.accept()
        if not a.empty:
            c.sendall(message(i))
        if a.reset:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()
        i += 1


def client(a):
    out = {"connections": 0, "right": 0, "errors": {}, "wrong": []}
    for i in range(a.count):
        s = socket.create_connection(parse_addr(a.connect), timeout=10)
        got, seen = b"", []
        try:
            while True:
                try:
                    chunk = s.recv(4096)
                except ConnectionResetError:
                    seen.append("reset")
                    continue
                if not chunk:
                    break
                got += chunk
            want = b"" if a.empty else message(i)
            if got == want and seen == (["reset"] if a.reset else []):
                out["right"] += 1
            elif len(out["wrong"]) < 5:
                out["wrong"].append(repr(got[:80]) + " " + ",".join(seen))
        except OSError as e:
            name = e.__class__.__name__
            out["errors"][name] = out["errors"].get(name, 0) + 1
        s.close()
        out["connections"] += 1
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["server", "client"])
    ap.add_argument("--bind")
    ap.add_argument("--connect")
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--empty", action="store_true")
    ap.add_argument("--reset", action="store_true")
    a = ap.parse_args()
    server(a) if a.mode == "server" else client(a)


if __name__ == "__main__":
    main()
