#!/usr/bin/env python3
"""A server that answers every connection with a message of its own and closes it at once,
before the client has read anything (an HTTP/1.0 server, a daemon that turns a client away
with a reason); with --empty it closes without a word.

    say_and_close.py server --bind IP:PORT [--empty]
    say_and_close.py client --connect IP:PORT [--count N] [--empty]

The client makes N connections one after the other, reads each to its end, and prints one
JSON line: {"connections": N, "right": R, "errors": {"ConnectionResetError": 3, ...},
"wrong": [...]} where "right" counts the connections that gave exactly the server's message
(or nothing, with --empty) and then the end of stream, as natively.
"""

import argparse
import json
import socket


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
        c.close()
        i += 1


def client(a):
    out = {"connections": 0, "right": 0, "errors": {}, "wrong": []}
    for i in range(a.count):
        s = socket.create_connection(parse_addr(a.connect), timeout=10)
        got = b""
        try:
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            want = b"" if a.empty else message(i)
            if got == want:
                out["right"] += 1
            elif len(out["wrong"]) < 5:
                out["wrong"].append(repr(got[:80]))
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
    a = ap.parse_args()
    server(a) if a.mode == "server" else client(a)


if __name__ == "__main__":
    main()
