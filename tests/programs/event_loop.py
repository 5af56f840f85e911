#!/usr/bin/env python3
"""An event loop, in one thread, that is both ends of several connections: it connects to its
own listener PAIRS times, then for ROUNDS rounds sends a request of SIZE bytes on every
client end, answers each request on its server end once it is whole, and reads the answers,
waiting only in its selector (epoll by default, poll with --wait poll).

    event_loop.py --bind IP:PORT --pairs N --rounds R --size S [--wait epoll|poll]
    event_loop.py --bind IP:PORT --pairs N --rounds R --size S --server-thread [--edge]

With --server-thread the server ends are served by a second thread, from its own epoll
instance (edge-triggered with --edge, reading until a short read as nginx does), while the main
thread sends each request with a blocking send and waits for its answer with a blocking
receive, 1 ms apart: the server's loop sleeps between requests, so every request needs a
wake-up, and a wake-up left behind in a socket must not hold back the next one.

With --wait poll0 (or epoll0) and --server-thread, the busy loop holds the client ends and
a second thread answers from its own epoll instance, so that most waits find nothing yet.

With --wait poll0 or epoll0 the loop also waits on the read end of a pipe of its own: every
third round it writes a byte there right after its requests, and the first wait after that
must report the pipe (what the thread itself did is seen at once, even when the layer
answers a zero-time-out wait from its rings alone); it counts its waits ("polls") and the
times the pipe was missed ("pipe_missed").

Prints {"messages", "bells", "ok", "stalls"}: the requests and answers exchanged, the bytes
that arrived in the kernel sockets themselves (TCP_INFO bytes_received, summed over every
socket; over the layer's shared memory those are its one-byte wake-ups, which an event loop
that never sleeps with bytes waiting should not need), whether every answer was the request
sent, and how many waits of 5 s ended with nothing (a lost wake-up).
"""

import argparse
import json
import os
import select
import selectors
import socket
import struct
import threading
import time

TCP_INFO_BYTES_RECEIVED = 128   # offset of tcpi_bytes_received in struct tcp_info


def bytes_received(sock):
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
    if len(info) < TCP_INFO_BYTES_RECEIVED + 8:
        return 0
    return struct.unpack_from("<Q", info, TCP_INFO_BYTES_RECEIVED)[0]


def request(pair, rnd, size):
    block = bytes(((pair * 37 + rnd * 11 + i) & 0xFF) for i in range(97))
    return (block * (size // len(block) + 1))[:size]


def serve(servers, size, edge, stop, out):
    """The server ends' loop: answers every whole request, reading until EAGAIN."""
    ep = select.epoll()
    flags = select.EPOLLIN | (select.EPOLLET if edge else 0)
    for i, s in enumerate(servers):
        s.setblocking(False)
        ep.register(s.fileno(), flags)
    by_fd = {s.fileno(): s for s in servers}
    got = {fd: b"" for fd in by_fd}
    while not stop.is_set():
        for fd, _ in ep.poll(2.0):
            s = by_fd[fd]
            while True:
                try:
                    chunk = s.recv(65536)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                got[fd] += chunk
                short = len(chunk) < 65536
                while len(got[fd]) >= size:
                    s.setblocking(True)
                    s.sendall(got[fd][:size])
                    s.setblocking(False)
                    got[fd] = got[fd][size:]
                    out["answers"] += 1
                if short:
                    # A short read took all there was (nginx stops there too, edge-triggered).
                    break
    ep.close()


def threaded(a, clients, servers, out):
    stop = threading.Event()
    side = {"answers": 0}
    t = threading.Thread(target=serve, args=(servers, a.size, a.edge, stop, side), daemon=True)
    t.start()
    for rnd in range(a.rounds):
        for p, c in enumerate(clients):
            req = request(p, rnd, a.size)
            c.settimeout(1)
            c.sendall(req)
            out["messages"] += 1
            try:
                got = b""
                while len(got) < a.size:
                    chunk = c.recv(a.size - len(got))
                    if not chunk:
                        break
                    got += chunk
            except socket.timeout:
                out["stalls"] += 1
                out["ok"] = False
                stop.set()
                return
            out["messages"] += 1
            out["ok"] = out["ok"] and got == req
        time.sleep(0.001)
    stop.set()
    t.join(5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--wait", choices=["epoll", "poll", "poll0", "epoll0"], default="epoll",
                    help="poll0, epoll0: a busy loop of zero-time-out waits (a progress "
                         "engine's: Open MPI polls, UCX waits on epoll)")
    ap.add_argument("--server-thread", action="store_true")
    ap.add_argument("--edge", action="store_true")
    ap.add_argument("--hold", type=float, default=0.3,
                    help="seconds the connections stay open at the end (for vmictl to see them)")
    a = ap.parse_args()
    host, _, port = a.bind.rpartition(":")
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, int(port)))
    ls.listen(a.pairs)
    clients, servers = [], []
    for _ in range(a.pairs):
        clients.append(socket.create_connection((host, int(port))))
        servers.append(ls.accept()[0])
    out = {"messages": 0, "bells": 0, "ok": True, "stalls": 0}
    busy = a.wait in ("poll0", "epoll0")
    if a.server_thread and not busy:
        threaded(a, clients, servers, out)
        out["bells"] = sum(bytes_received(s) for s in clients + servers)
        out["server_bells"] = sum(bytes_received(s) for s in servers)
        print(json.dumps(out), flush=True)
        return
    sel = selectors.EpollSelector() if a.wait.startswith("epoll") else selectors.PollSelector()
    stop = threading.Event()
    served, side = None, {"answers": 0}
    if busy and a.server_thread:
        # The server ends answer from a thread of their own: the busy loop's polls wait.
        served = threading.Thread(target=serve, args=(servers, a.size, False, stop, side),
                                  daemon=True)
        served.start()
    for i, s in enumerate(clients + ([] if served else servers)):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    n = a.pairs
    pipe_r = pipe_w = None
    if busy:
        pipe_r, pipe_w = os.pipe()
        os.set_blocking(pipe_r, False)
        sel.register(pipe_r, selectors.EVENT_READ, -1)
        out["polls"] = out["pipe_missed"] = 0
        out["wait_fd"] = sel.fileno() if a.wait == "epoll0" else -1
    for rnd in range(a.rounds):
        got = [b""] * (2 * n)
        for p, c in enumerate(clients):
            c.sendall(request(p, rnd, a.size))
            out["messages"] += 1
        piped = busy and rnd % 3 == 0
        if piped:
            os.write(pipe_w, b"x")
        answered = 0
        since = time.monotonic()
        while answered < n:
            events = sel.select(timeout=0 if busy else 5)
            if busy:
                out["polls"] += 1
                if piped and not any(key.data == -1 for key, _ in events):
                    out["pipe_missed"] += 1
                piped = False
            if not events and busy and time.monotonic() - since < 5:
                continue
            since = time.monotonic()
            if not events:
                out["stalls"] += 1
                if out["stalls"] > 3:
                    out["ok"] = False
                    print(json.dumps(out), flush=True)
                    return
                continue
            for key, _ in events:
                i = key.data
                if i == -1:
                    os.read(pipe_r, 64)
                    continue
                try:
                    chunk = key.fileobj.recv(65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    out["ok"] = False
                    continue
                got[i] += chunk
                if len(got[i]) < a.size:
                    continue
                if i >= n:
                    # A server end: the request is whole; answer it.
                    servers[i - n].sendall(got[i])
                    out["messages"] += 1
                    got[i] = b""
                else:
                    out["ok"] = out["ok"] and got[i] == request(i, rnd, a.size)
                    answered += 1
    stop.set()
    if served:
        served.join(5)
        out["messages"] += side["answers"]
    out["bells"] = sum(bytes_received(s) for s in clients + servers)
    time.sleep(a.hold)
    for s in clients + servers:
        s.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
