#!/usr/bin/env python3
"""Checksummed two-way byte stream, for checking that a connection loses, repeats or
reorders nothing.

    stream.py server --bind IP:PORT [--count K] [--hold S] [--rate BYTES_PER_S]
                     [--check-names S] [--pause BYTES:SECONDS ...]
    stream.py client --connect IP:PORT --bytes N --seed S [--server-bytes M]
                     [--rate BYTES_PER_S] [--hold S] [--progress S] [--check-names S]

The client opens one connection and sends a 24-byte header (magic, the number of bytes the
server must send back, the seed for the server's data). Then both sides send at the same time,
each from its own thread, in writes of random size (1 B .. 256 KiB, drawn from the seed), and
read until end of stream; each side half-closes (shutdown SHUT_WR) when it has sent everything.
At the end each side prints one JSON line on stdout:

    {"role": "client", "sent_bytes": N, "sent_sha256": "...", "recv_bytes": M,
     "recv_sha256": "...", "seconds": T, "local": "ip:port", "peer": "ip:port", "pid": P}

The header is not counted. The server serves connections concurrently and exits after K of
them when --count is given (otherwise it runs until killed). Sockets are blocking: the test
harness, not the program, bounds how long anything may take.

When a call fails, the result also has "error" (what failed, with the exception) and
"errnos": the symbolic errno of every failed call that had one (e.g. ["ETIMEDOUT"]), and the
client exits with status 1.

--rate limits each side's sending (the server's applies to every connection it serves), so a
stream can be made to last long enough for something to happen in the middle of it.
--pause BYTES:SECONDS (server, repeatable) stops reading a connection for SECONDS once BYTES
of it were read, so the sender's buffers fill up while something happens.
--check-names S calls getsockname and getpeername every S seconds while the exchange runs;
the result then has "names_checked" (how many times) and "names_changed": every answer that
differed from the names at the start, or the error the call raised (empty when the program
saw the same names throughout).
"""

import argparse
import errno as errno_mod
import hashlib
import json
import os
import random
import socket
import subprocess
import struct
import sys
import threading
import time

MAGIC = b"VMISTRM1"
HEADER = struct.Struct("!8sQQ")
MAX_WRITE = 256 * 1024
SERVER_SEED_XOR = 0x9E3779B97F4A7C15


def parse_addr(text):
    host, _, port = text.rpartition(":")
    if not host or not port:
        raise argparse.ArgumentTypeError(f"expected IP:PORT, got {text!r}")
    return host, int(port)


def parse_pause(text):
    at, _, secs = text.partition(":")
    try:
        return int(at), float(secs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BYTES:SECONDS, got {text!r}") from None


def fmt_addr(addr):
    return f"{addr[0]}:{addr[1]}"


def errno_name(exc):
    """Symbolic errno of an exception (None if it has none)."""
    code = getattr(exc, "errno", None)
    if not isinstance(code, int):
        return None
    return errno_mod.errorcode.get(code, str(code))


# With --text: words drawn from the seed instead of random bytes (data that compresses).
TEXT = False
WORDS = [b"the", b"layer", b"virtual", b"connection", b"frame", b"device", b"chain", b"of",
         b"stream", b"byte", b"link", b"node", b"agent", b"a", b"network", b"and", b"filter"]


def payload(rng, size):
    if not TEXT:
        return rng.randbytes(size)
    # (Each word and its space take at least 2 bytes.)
    return b" ".join(rng.choices(WORDS, k=size // 2 + 1))[:size]


def write_sizes(rng, total):
    """Yield write sizes 1..MAX_WRITE, log-uniform so that tiny and huge writes both occur."""
    left = total
    while left > 0:
        size = int(2 ** rng.uniform(0, 18))
        size = max(1, min(size, MAX_WRITE, left))
        yield size
        left -= size


class Sender:
    def __init__(self, sock, total, seed, rate=0.0, progress=0.0, role=""):
        self.sock = sock
        self.total = total
        self.seed = seed
        self.rate = rate
        self.progress = progress
        self.role = role
        self.sent = 0
        self.hash = hashlib.sha256()
        self.error = None
        self.errno = None

    def run(self):
        try:
            rng = random.Random(self.seed)
            start = time.monotonic()
            last_report = start
            for size in write_sizes(rng, self.total):
                chunk = payload(rng, size)
                if self.rate > 0:
                    due = start + (self.sent + size) / self.rate
                    delay = due - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                self.sock.sendall(chunk)
                self.hash.update(chunk)
                self.sent += size
                if self.progress > 0 and time.monotonic() - last_report >= self.progress:
                    last_report = time.monotonic()
                    print(json.dumps({"role": self.role, "progress_sent": self.sent}),
                          file=sys.stderr, flush=True)
            self.sock.shutdown(socket.SHUT_WR)
        except Exception as exc:  # reported in the JSON result
            self.error = f"send: {exc!r}"
            self.errno = errno_name(exc)


class Receiver:
    def __init__(self, sock, pauses=()):
        self.sock = sock
        self.received = 0
        self.hash = hashlib.sha256()
        self.error = None
        self.errno = None
        self.pauses = sorted(pauses)

    def run(self):
        try:
            while True:
                if self.pauses and self.received >= self.pauses[0][0]:
                    time.sleep(self.pauses.pop(0)[1])
                want = MAX_WRITE
                if self.pauses:
                    want = max(1, min(want, self.pauses[0][0] - self.received))
                data = self.sock.recv(want)
                if not data:
                    return
                self.hash.update(data)
                self.received += len(data)
        except Exception as exc:
            self.error = f"recv: {exc!r}"
            self.errno = errno_name(exc)


class NameChecker:
    """Calls getsockname and getpeername every `interval` seconds until stopped, and keeps
    every answer that differs from the names at the start (or the error the call raised)."""

    def __init__(self, sock, local, peer, interval):
        self.sock = sock
        self.expected = {"local": local, "peer": peer}
        self.interval = interval
        self.checked = 0
        self.changed = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(self.interval):
            try:
                now = {"local": fmt_addr(self.sock.getsockname()),
                       "peer": fmt_addr(self.sock.getpeername())}
            except OSError as exc:
                now = {"error": repr(exc)}
            self.checked += 1
            if now != self.expected and len(self.changed) < 20:
                now["after_seconds"] = round(self.checked * self.interval, 3)
                self.changed.append(now)


def exchange(sock, role, send_bytes, seed, rate=0.0, progress=0.0, check_names=0.0,
             pauses=()):
    """Send and receive at once; return the result dict."""
    start = time.monotonic()
    local, peer = fmt_addr(sock.getsockname()), fmt_addr(sock.getpeername())
    sender = Sender(sock, send_bytes, seed, rate, progress, role)
    receiver = Receiver(sock, pauses)
    threads = [threading.Thread(target=sender.run, daemon=True),
               threading.Thread(target=receiver.run, daemon=True)]
    names = None
    if check_names > 0:
        names = NameChecker(sock, local, peer, check_names)
        checker = threading.Thread(target=names.run, daemon=True)
        checker.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if names is not None:
        names.stop.set()
        checker.join()
    errors = [e for e in (sender.error, receiver.error) if e]
    result = {
        "role": role,
        "pid": os.getpid(),
        "sent_bytes": sender.sent,
        "sent_sha256": sender.hash.hexdigest(),
        "recv_bytes": receiver.received,
        "recv_sha256": receiver.hash.hexdigest(),
        "seconds": round(time.monotonic() - start, 6),
        "local": local,
        "peer": peer,
    }
    if names is not None:
        result["names_checked"] = names.checked
        result["names_changed"] = names.changed
    if errors:
        result["error"] = "; ".join(errors)
        result["errnos"] = [e for e in (sender.errno, receiver.errno) if e]
    return result


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            raise EOFError(f"connection closed after {len(buf)} of {n} header bytes")
        buf += data
    return buf


def serve_one(conn, hold, out_lock, rate=0.0, check_names=0.0, pauses=()):
    try:
        magic, back_bytes, seed = HEADER.unpack(recv_exact(conn, HEADER.size))
        if magic != MAGIC:
            raise ValueError(f"bad magic {magic!r}")
        result = exchange(conn, "server", back_bytes, seed ^ SERVER_SEED_XOR, rate,
                          check_names=check_names, pauses=pauses)
    except Exception as exc:
        result = {"role": "server", "pid": os.getpid(), "error": f"header: {exc!r}"}
        if errno_name(exc):
            result["errnos"] = [errno_name(exc)]
    if hold > 0:
        time.sleep(hold)
    conn.close()
    with out_lock:
        print(json.dumps(result), flush=True)


def server(args):
    host, port = args.bind
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((host, port))
    lsock.listen(128)
    out_lock = threading.Lock()
    workers = []
    served = 0
    while args.count == 0 or served < args.count:
        conn, _ = lsock.accept()
        served += 1
        t = threading.Thread(target=serve_one, args=(conn, args.hold, out_lock, args.rate,
                                                     args.check_names, args.pause),
                             daemon=True)
        t.start()
        workers.append(t)
    for t in workers:
        t.join()
    lsock.close()
    return 0


def spawner(every, stop, counts):
    """Runs `true` as a subprocess every `every` seconds until `stop` is set (Python's
    subprocess uses vfork + exec: the layer's exec hook runs in a child sharing our memory)."""
    while not stop.wait(every):
        r = subprocess.run(["true"], close_fds=True)
        counts["spawned"] += 1
        if r.returncode != 0:
            counts["spawn_errors"] += 1


def connect(addr, retry):
    """A connection to addr; refused ones are tried again every 5 ms for up to retry s."""
    deadline = time.monotonic() + retry
    tries = 0
    while True:
        tries += 1
        try:
            return socket.create_connection(addr), tries
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def client(args):
    sock, tries = connect(args.connect, args.retry)
    back = args.bytes if args.server_bytes is None else args.server_bytes
    sock.sendall(HEADER.pack(MAGIC, back, args.seed))
    stop, counts = threading.Event(), {"spawned": 0, "spawn_errors": 0}
    if args.spawn > 0:
        threading.Thread(target=spawner, args=(args.spawn, stop, counts), daemon=True).start()
    result = exchange(sock, "client", args.bytes, args.seed, args.rate, args.progress,
                      args.check_names)
    stop.set()
    if args.spawn > 0:
        result.update(counts)
    if args.retry > 0:
        result["tries"] = tries
    if hold := args.hold:
        time.sleep(hold)
    sock.close()
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server")
    s.add_argument("--bind", type=parse_addr, required=True)
    s.add_argument("--count", type=int, default=0, help="exit after this many connections")
    s.add_argument("--hold", type=float, default=0.0, help="seconds to keep each finished "
                   "connection open before closing it")
    s.add_argument("--rate", type=float, default=0.0,
                   help="limit sending on each connection to bytes/second")
    s.add_argument("--check-names", type=float, default=0.0, metavar="S",
                   help="check getsockname/getpeername every S seconds during the exchange")
    s.add_argument("--pause", type=parse_pause, action="append", default=[],
                   metavar="BYTES:SECONDS", help="stop reading for SECONDS after BYTES")
    c = sub.add_parser("client")
    c.add_argument("--connect", type=parse_addr, required=True)
    c.add_argument("--spawn", type=float, default=0.0, metavar="S",
                   help="run `true` as a subprocess every S seconds during the exchange")
    c.add_argument("--retry", type=float, default=0.0, metavar="S",
                   help="try a refused connect again every 5 ms for up to S seconds")
    c.add_argument("--bytes", type=int, required=True, help="bytes the client sends")
    c.add_argument("--server-bytes", type=int, default=None,
                   help="bytes the server sends back (default: same as --bytes)")
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--rate", type=float, default=0.0, help="limit sending to bytes/second")
    c.add_argument("--hold", type=float, default=0.0, help="seconds to keep the finished "
                   "connection open before closing it")
    c.add_argument("--progress", type=float, default=0.0,
                   help="print sent-byte progress to stderr every this many seconds")
    c.add_argument("--check-names", type=float, default=0.0, metavar="S",
                   help="check getsockname/getpeername every S seconds during the exchange")
    for q in (s, c):
        q.add_argument("--text", action="store_true",
                       help="send words (data that compresses) instead of random bytes")
    args = p.parse_args()
    global TEXT
    TEXT = args.text
    return server(args) if args.cmd == "server" else client(args)


if __name__ == "__main__":
    sys.exit(main())
