#!/usr/bin/env python3
"""What a connection's calls answer when its peer is slow, silent or gone, for comparing the
layer with native TCP call by call (both ends on one host: over the layer's shared memory).

    timeouts.py server --bind IP:PORT --case CASE
    timeouts.py client --connect IP:PORT --case CASE

Cases (the server serves one connection, the client makes it and prints one JSON line
{"case": CASE, "outcome": ...} whose outcome must be the same natively and under the layer):

    rcvtimeo       the server accepts only after 0.6 s and then sends; the client's receive
                   with SO_RCVTIMEO 0.15 s ends with EAGAIN before that ("EAGAIN")
    sndtimeo       the server accepts and never reads; the client, with SO_SNDTIMEO 0.2 s,
                   sends until a send ends with EAGAIN ("EAGAIN"; a reset or a send that never
                   blocks in 10 s is another outcome)
    unaccepted     the server's process ends without accepting; the client's receive ends
                   with a reset ("ECONNRESET"), within 10 s
    write_after_close
                   the server accepts and closes; once the client read the end, its first
                   send goes and its second fails ("end, sent, EPIPE")
    rdhup          the server sends a byte and shuts its sending side; poll (POLLIN |
                   POLLRDHUP) and epoll (EPOLLIN | EPOLLRDHUP) report both ("poll IN RDHUP,
                   epoll IN RDHUP"), before the client reads anything
"""

import argparse
import errno
import json
import os
import select
import socket
import struct
import time


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def server(a):
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(parse_addr(a.bind))
    ls.listen(8)
    print(json.dumps({"listening": True}), flush=True)
    if a.case == "unaccepted":
        time.sleep(1.0)
        os._exit(0)
    if a.case == "rcvtimeo":
        time.sleep(0.6)
    c, _ = ls.accept()
    if a.case == "rcvtimeo":
        c.sendall(b"late")
        time.sleep(1.0)
    elif a.case == "sndtimeo":
        time.sleep(12)
    elif a.case == "write_after_close":
        c.close()
        time.sleep(2)
    elif a.case == "rdhup":
        c.sendall(b"x")
        c.shutdown(socket.SHUT_WR)
        time.sleep(2)


def name_of(e):
    return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else e.__class__.__name__


def client(a):
    s = socket.create_connection(parse_addr(a.connect))
    t0 = time.monotonic()
    out = {"case": a.case}
    try:
        if a.case == "rcvtimeo":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 150000))
            try:
                s.recv(16)
                out["outcome"] = "data"
            except OSError as e:
                out["outcome"] = name_of(e)
        elif a.case == "sndtimeo":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 200000))
            out["outcome"] = "never blocked"
            while time.monotonic() - t0 < 10:
                try:
                    s.send(b"y" * 65536)
                except OSError as e:
                    out["outcome"] = name_of(e)
                    break
        elif a.case == "unaccepted":
            s.settimeout(10)
            try:
                r = s.recv(16)
                out["outcome"] = "end" if r == b"" else "data"
            except socket.timeout:
                out["outcome"] = "nothing in 10 s"
            except OSError as e:
                out["outcome"] = name_of(e)
        elif a.case == "write_after_close":
            said = ["end" if s.recv(16) == b"" else "data"]
            for _ in range(2):
                try:
                    s.send(b"z" * 100)
                    said.append("sent")
                except OSError as e:
                    said.append(name_of(e))
                time.sleep(0.2)
            out["outcome"] = ", ".join(said)
        elif a.case == "rdhup":
            time.sleep(0.3)
            p = select.poll()
            p.register(s, select.POLLIN | select.POLLRDHUP)
            pb = dict(p.poll(1000)).get(s.fileno(), 0)
            ep = select.epoll()
            ep.register(s.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
            eb = dict(ep.poll(1.0)).get(s.fileno(), 0)
            ep.close()

            def bits(v, pin, prdhup):
                return " ".join(n for n, b in (("IN", pin), ("RDHUP", prdhup)) if v & b)
            out["outcome"] = (f"poll {bits(pb, select.POLLIN, select.POLLRDHUP)}, "
                              f"epoll {bits(eb, select.EPOLLIN, select.EPOLLRDHUP)}")
    finally:
        out["seconds"] = round(time.monotonic() - t0, 2)
        print(json.dumps(out), flush=True)
        s.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["server", "client"])
    ap.add_argument("--bind")
    ap.add_argument("--connect")
    ap.add_argument("--case", required=True,
                    choices=["rcvtimeo", "sndtimeo", "unaccepted", "write_after_close", "rdhup"])
    a = ap.parse_args()
    server(a) if a.mode == "server" else client(a)


if __name__ == "__main__":
    main()
