#!/usr/bin/env python3
"""One thread connects to its own listener and sends before it accepts (UCX does this, and
many socketpair() stand-ins): a kernel socket takes the bytes before the peer accepts, and so
must a virtual connection.

    self_connect.py --bind IP:PORT [--bytes N] [--nonblocking] [--fork --then-seconds S]

Listens, connects, sends N bytes (default 1000; blocking sendall, or with --nonblocking a
non-blocking socket retried on EAGAIN), then accepts, reads them, answers them back and
reads the answer. Prints {"sent", "received", "echoed", "same", "eagain", "send_ms"} (send_ms:
how long the sends before the accept took); "error" on failure.

With --fork the accepting end is a child process forked after the send (which closes its copy
of the connecting end: the process held both ends of one connection, and now each holds one),
which sends back everything it reads; the connecting end then goes on for --then-seconds,
sending a numbered 4 KiB message every 2 ms and checking it comes back ("rounds", "bad").
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


def forked(a, ls, c, data, out):
    """The rest of main, the accepting end in a child process."""
    out.update(rounds=0, bad=0)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            c.close()
            s, _ = ls.accept()
            ls.close()
            while True:
                m = s.recv(65536)
                if not m:
                    break
                s.sendall(m)
            s.close()
        except OSError:
            code = 1
        os._exit(code)
    ls.close()
    try:
        back = recv_upto(c, len(data))
        out["received"] = out["echoed"] = len(back)
        out["same"] = back == data
        end = time.monotonic() + a.then_seconds
        while time.monotonic() < end:
            n = out["rounds"]
            msg = bytes((n + i) % 251 for i in range(4096))
            c.sendall(msg)
            out["bad"] += recv_upto(c, len(msg)) != msg
            out["rounds"] = n + 1
            time.sleep(0.002)
        c.shutdown(socket.SHUT_WR)
        recv_upto(c, 1)
        c.close()
    except OSError as exc:
        out["error"] = repr(exc)
    _, status = os.waitpid(pid, 0)
    if status != 0 and "error" not in out:
        out["error"] = f"the accepting child ended with status {status}"
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True)
    ap.add_argument("--bytes", type=int, default=1000)
    ap.add_argument("--nonblocking", action="store_true")
    ap.add_argument("--fork", action="store_true")
    ap.add_argument("--then-seconds", type=float, default=0)
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
        began = time.monotonic()
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
        out["send_ms"] = round((time.monotonic() - began) * 1000, 2)
        if a.fork:
            return forked(a, ls, c, data, out)
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
