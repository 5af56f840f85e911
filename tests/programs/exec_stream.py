#!/usr/bin/env python3
"""Bytes in flight when a connection changes hands across exec.

    exec_stream.py server --bind IP:PORT --before N --after M --seed S [--spawn fork|subprocess]
    exec_stream.py client --connect IP:PORT --pause SECONDS --total N+M --seed S
    exec_stream.py helper FD M SEED N    (started by the server, never by hand)

server: accepts one connection and sends N bytes of the stream (see `pattern`) while the
    client is not reading, so they wait in buffers, unacknowledged; then forks, and the
    child execs `exec_stream.py helper` with the socket inherited. The parent closes its
    copy and waits for the helper. Prints {"role": "server", "helper_status": ...}.

helper: prints {"role": "helper", "event": "started", "pid": ...} at once, then sends the
    next M bytes of the stream, shuts its side down and waits for the client's end of
    stream. Prints {"role": "helper", "sent_bytes": M, ...}.

client: connects, waits SECONDS without reading, then reads to the end of stream and
    prints {"ok": true, "recv_bytes": ..., "recv_sha256": ..., "want_sha256": ...} (ok is
    true when the bytes are exactly the N + M of the stream), exit status 1 otherwise.

The stream: bytes from random.Random(SEED), in 64 KiB blocks; the client knows N + M from
the end of stream and recomputes the digest it should see.
"""

import argparse
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import time

BLOCK = 64 << 10


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def emit(obj):
    print(json.dumps(obj), flush=True)


def pattern(seed, start, n):
    """Bytes start..start+n of the stream for `seed`."""
    rng = random.Random(seed)
    out = bytearray()
    pos = 0
    while pos < start + n:
        block = rng.randbytes(BLOCK)
        lo, hi = max(start, pos), min(start + n, pos + BLOCK)
        if lo < hi:
            out += block[lo - pos:hi - pos]
        pos += BLOCK
    return bytes(out)


def server(args):
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(parse_addr(args.bind))
    lsock.listen(1)
    conn, _ = lsock.accept()
    lsock.close()
    conn.sendall(pattern(args.seed, 0, args.before))
    fd = conn.fileno()
    os.set_inheritable(fd, True)
    argv = [sys.executable, os.path.abspath(__file__), "helper", str(fd), str(args.after),
            str(args.seed), str(args.before)]
    if args.spawn == "subprocess":
        # vfork + exec: the child shares this process's memory until its exec.
        child = subprocess.Popen(argv, pass_fds=(fd,))
        conn.close()
        code = child.wait()
    else:
        pid = os.fork()
        if pid == 0:
            os.execv(sys.executable, argv)
        conn.close()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
    emit({"role": "server", "sent_bytes": args.before, "helper_status": code})


def helper(fd, after, seed, start):
    emit({"role": "helper", "event": "started", "pid": os.getpid()})
    sock = socket.socket(fileno=fd)
    try:
        sock.sendall(pattern(seed, start, after))
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(BLOCK):
            pass
    except OSError as e:
        emit({"role": "helper", "error": f"{type(e).__name__}: {e}"})
        sys.exit(1)
    emit({"role": "helper", "sent_bytes": after})


def client(args):
    sock = socket.create_connection(parse_addr(args.connect), timeout=60)
    time.sleep(args.pause)
    h = hashlib.sha256()
    got = 0
    try:
        while True:
            b = sock.recv(BLOCK)
            if not b:
                break
            h.update(b)
            got += len(b)
    except OSError as e:
        emit({"ok": False, "error": f"{type(e).__name__}: {e}", "recv_bytes": got})
        sys.exit(1)
    sock.close()
    want = hashlib.sha256(pattern(args.seed, 0, got)).hexdigest()
    ok = got == args.total and h.hexdigest() == want
    emit({"ok": ok, "recv_bytes": got, "want_bytes": args.total, "recv_sha256": h.hexdigest(),
          "want_sha256": want})
    sys.exit(0 if ok else 1)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "helper":
        helper(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--bind", required=True)
    s.add_argument("--before", type=int, required=True)
    s.add_argument("--after", type=int, required=True)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--spawn", choices=["fork", "subprocess"], default="fork",
                   help="how the helper is started: fork + execv, or subprocess (vfork)")
    c = sub.add_parser("client")
    c.add_argument("--connect", required=True)
    c.add_argument("--pause", type=float, default=3.0)
    c.add_argument("--total", type=int, required=True)
    c.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    server(a) if a.role == "server" else client(a)


if __name__ == "__main__":
    main()
