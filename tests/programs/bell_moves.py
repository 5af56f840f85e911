#!/usr/bin/env python3
"""One connection (over shared memory under the layer) waited on in one way after another,
each wait long enough to sleep: the peer, a forked child, echoes every byte 2 ms after it
came. A wake-up that went where nobody waits any more shows as a wait that runs to its
time-out (2 s).

    bell_moves.py --bind IP:PORT

Phases, 20 round trips each: an epoll instance; select after that instance is closed; a new
instance; poll while the new instance still holds the connection; a blocking receive; then
the process execs itself (the connection inherited) and does select, then epoll, in the new
image. Prints {"ok", "rounds", "slowest_ms", "phases": {name: slowest ms}}.
"""

import argparse
import json
import os
import select
import socket
import sys
import time

ROUNDS = 20
TIMEOUT = 2.0


def echo(conn):
    """The child: answers every byte 2 ms later, until the end of stream."""
    while True:
        b = conn.recv(1)
        if not b:
            return
        time.sleep(0.002)
        conn.sendall(b)


def rounds(conn, name, wait, out):
    """`wait(conn)` returns once conn is readable (or raises on a time-out)."""
    print(f"phase: {name}", file=sys.stderr, flush=True)
    slowest = 0.0
    for i in range(ROUNDS):
        conn.sendall(b"x")
        t = time.monotonic()
        if not wait(conn):
            out["ok"] = False
            out.setdefault("stalled", []).append(f"{name} #{i}")
            slowest = max(slowest, TIMEOUT)
            conn.setblocking(True)
            conn.settimeout(TIMEOUT)
            try:
                conn.recv(1)
            except OSError:
                pass
            conn.settimeout(None)
            continue
        slowest = max(slowest, time.monotonic() - t)
        conn.setblocking(False)
        got = conn.recv(1)
        conn.setblocking(True)
        if got != b"x":
            out["ok"] = False
        out["rounds"] += 1
    out["phases"][name] = round(slowest * 1000, 2)


def with_select(conn):
    r, _, _ = select.select([conn], [], [], TIMEOUT)
    return bool(r)


def with_poll(conn):
    p = select.poll()
    p.register(conn, select.POLLIN)
    return bool(p.poll(TIMEOUT * 1000))


def with_blocking_recv(conn):
    conn.settimeout(TIMEOUT)
    try:
        b = conn.recv(1, socket.MSG_PEEK)
    except socket.timeout:
        return False
    finally:
        conn.settimeout(None)
    return b == b"x"


def epoll_waiter(ep):
    def wait(conn):
        return bool(ep.poll(TIMEOUT))
    return wait


def second_image(fd, out):
    conn = socket.socket(fileno=fd)
    rounds(conn, "select after exec", with_select, out)
    ep = select.epoll()
    ep.register(conn.fileno(), select.EPOLLIN)
    rounds(conn, "epoll after exec", epoll_waiter(ep), out)
    ep.close()
    conn.close()
    out["slowest_ms"] = max(out["phases"].values())
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind")
    ap.add_argument("--after-exec", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--so-far", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.after_exec >= 0:
        second_image(a.after_exec, json.loads(a.so_far))
        return
    host, _, port = a.bind.rpartition(":")
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, int(port)))
    ls.listen(1)
    if os.fork() == 0:
        ls.close()
        c = socket.create_connection((host, int(port)))
        echo(c)
        os._exit(0)
    conn, _ = ls.accept()
    ls.close()
    out = {"ok": True, "rounds": 0, "phases": {}}
    ep = select.epoll()
    ep.register(conn.fileno(), select.EPOLLIN)
    rounds(conn, "epoll", epoll_waiter(ep), out)
    ep.close()
    rounds(conn, "select after the instance closed", with_select, out)
    ep2 = select.epoll()
    ep2.register(conn.fileno(), select.EPOLLIN)
    rounds(conn, "a new instance", epoll_waiter(ep2), out)
    rounds(conn, "poll, the instance still holding it", with_poll, out)
    rounds(conn, "blocking receive", with_blocking_recv, out)
    rounds(conn, "the instance again", epoll_waiter(ep2), out)
    fd = conn.detach()
    os.set_inheritable(fd, True)
    os.execv(sys.executable, [sys.executable, __file__, "--after-exec", str(fd), "--so-far", json.dumps(out)])


if __name__ == "__main__":
    main()
