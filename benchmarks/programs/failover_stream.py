#!/usr/bin/env python3
"""One-way byte stream at full speed, for measuring how long a receiver stalls when a path fails.

    failover_stream.py recv --bind IP --port PORT [--mptcp] [--gap-ms MS] [--mark-ms MS]
    failover_stream.py send --connect IP --port PORT --seconds S [--mptcp] [--chunk BYTES]
                            [--info-every S] [--ballast-mb MB]

The receiver listens (backlog 1), prints {"event": "listening", ...} on stdout, accepts one
connection and reads it until end of stream with recv_into into a 256 KiB buffer, taking
time.monotonic() after every recv that returned data. Every gap between two consecutive
receives of at least --gap-ms (default 1 ms) is kept as [start, end] (monotonic seconds; the
clock is the same in every network namespace of the machine, so the caller can place a failure
it injected on the same time line). It checks the content (see below), hashes it, closes, and
prints one JSON line:

    {"event": "done", "role": "recv", "bytes": N, "sha256": "...", "first_t": T0,
     "last_t": T1, "recvs": R, "max_gap_ms": G, "gaps": [[start, end], ...],
     "marks": [[t, bytes], ...], "mismatch_at": null | OFFSET, "local": "ip:port",
     "peer": "ip:port", "error": null}

where marks samples the byte count at most every --mark-ms (default 10 ms), for rate plots.

The sender connects, prints {"event": "streaming", "t": T} and sends for S seconds, as fast as
the socket takes it, in writes of --chunk bytes (default 64 KiB), then half-closes (shutdown
SHUT_WR), reads until the receiver closes (so that the figures it prints are delivered bytes),
and prints

    {"event": "done", "role": "send", "bytes": N, "sha256": "...", "t_start": T,
     "t_stop": T, "t_end": T, "mptcp": [[t, subflows], ...] | null, "local": ..., "error": null}

With --mptcp both ends open IPPROTO_MPTCP (262) sockets and the sender samples MPTCP_INFO's
subflow count every --info-every seconds (default 0.25); otherwise they are plain TCP sockets,
which is what an LD_PRELOAD layer sees.

Content: the byte at stream offset i is P[i mod len(P)], P a fixed pseudo-random pattern of a
prime length, so lost, repeated or reordered data shows up at once (mismatch_at is the first
offset where the receiver saw a wrong byte) besides in the SHA-256 of the whole stream.

--ballast-mb makes the sender hold MB MiB of touched memory (its resident size grows by that
much), for measuring what a process's size costs when it is checkpointed and moved.

SIGTERM or SIGINT ends either side early: it still prints its "done" line, with "error" set.
Sockets are blocking; the caller bounds how long anything may take.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import struct
import sys
import time

IPPROTO_MPTCP = 262
SOL_MPTCP = 284
MPTCP_INFO = 1
PATTERN_LEN = 1_048_573  # prime, so the pattern does not line up with any power-of-two write
SEED = 0x5EED_F00D


class Stop(Exception):
    """SIGTERM / SIGINT: finish early, still report."""


def on_signal(signum, _frame):
    raise Stop(f"signal {signum}")


def pattern(extra: int) -> bytes:
    """The pattern, followed by its first `extra` bytes (so any window of `extra` is one slice)."""
    p = random.Random(SEED).randbytes(PATTERN_LEN)
    return p + p[:extra]


def make_socket(mptcp: bool) -> socket.socket:
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM, IPPROTO_MPTCP if mptcp else 0)


def addr(a) -> str:
    try:
        return f"{a[0]}:{a[1]}"
    except (TypeError, IndexError):
        return str(a)


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def mptcp_subflows(sock: socket.socket) -> int | None:
    """mptcpi_subflows (the first byte of struct mptcp_info): additional subflows, so the
    connection uses subflows + 1 paths. None if the socket fell back to TCP or has no info."""
    try:
        raw = sock.getsockopt(SOL_MPTCP, MPTCP_INFO, 64)
    except OSError:
        return None
    if not raw:
        return None
    return struct.unpack_from("B", raw, 0)[0]


def recv_main(a: argparse.Namespace) -> int:
    bufsize = 256 * 1024
    pat = pattern(bufsize)
    buf = bytearray(bufsize)
    view = memoryview(buf)
    gap_min = a.gap_ms / 1000.0
    mark_every = a.mark_ms / 1000.0
    res: dict = {"event": "done", "role": "recv", "bytes": 0, "sha256": None, "first_t": None,
                 "last_t": None, "recvs": 0, "max_gap_ms": 0.0, "gaps": [], "marks": [],
                 "mismatch_at": None, "local": None, "peer": None, "error": None}
    srv = make_socket(a.mptcp)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((a.bind, a.port))
    srv.listen(1)
    emit({"event": "listening", "addr": addr(srv.getsockname()), "mptcp": a.mptcp})
    h = hashlib.sha256()
    total = 0
    recvs = 0
    gaps: list[list[float]] = []
    marks: list[list[float]] = []
    next_mark = 0.0
    max_gap = 0.0
    first = last = None
    mismatch = None
    conn = None
    try:
        conn, peer = srv.accept()
        res["local"], res["peer"] = addr(conn.getsockname()), addr(peer)
        recv_into = conn.recv_into
        while True:
            n = recv_into(view, bufsize)
            t = time.monotonic()
            if n == 0:
                break
            if last is None:
                first = t
            else:
                g = t - last
                if g >= gap_min:
                    if len(gaps) < 100_000:
                        gaps.append([last, t])
                    if g > max_gap:
                        max_gap = g
            last = t
            recvs += 1
            chunk = view[:n]
            h.update(chunk)
            if mismatch is None:
                # bytes == bytes is a memcmp; comparing a memoryview goes byte by byte.
                off = total % PATTERN_LEN
                got, want = bytes(chunk), pat[off:off + n]
                if got != want:
                    mismatch = total + next(k for k in range(n) if got[k] != want[k])
            total += n
            if t >= next_mark and len(marks) < 100_000:
                marks.append([t, total])
                next_mark = t + mark_every
        if last is not None:
            marks.append([last, total])
    except Stop as e:
        res["error"] = f"stopped by {e} before end of stream"
    except OSError as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        if conn is not None:
            try:
                conn.close()
            except (OSError, Stop):
                pass
    res.update(bytes=total, sha256=h.hexdigest(), first_t=first, last_t=last, recvs=recvs,
               max_gap_ms=round(max_gap * 1000.0, 3), gaps=gaps, marks=marks,
               mismatch_at=mismatch)
    emit(res)
    return 0 if res["error"] is None and mismatch is None else 1


def send_main(a: argparse.Namespace) -> int:
    # Resident ballast: every page written (random bytes, so nothing compresses it away).
    ballast = bytearray(os.urandom(1 << 20)) * a.ballast_mb if a.ballast_mb > 0 else None
    chunk = a.chunk
    pat = pattern(chunk)
    view = memoryview(pat)
    res: dict = {"event": "done", "role": "send", "bytes": 0, "sha256": None, "t_start": None,
                 "t_stop": None, "t_end": None, "mptcp": None, "local": None, "error": None}
    h = hashlib.sha256()
    total = 0
    sock = make_socket(a.mptcp)
    infos: list[list] = []
    try:
        sock.connect((a.connect, a.port))
        res["local"] = addr(sock.getsockname())
        t0 = time.monotonic()
        res["t_start"] = t0
        emit({"event": "streaming", "t": t0, "local": res["local"]})
        stop_at = t0 + a.seconds
        next_info = t0
        send = sock.send
        off = 0
        while True:
            now = time.monotonic()
            if now >= stop_at:
                break
            if a.mptcp and now >= next_info:
                infos.append([now, mptcp_subflows(sock)])
                next_info = now + a.info_every
            n = send(view[off:off + chunk])
            h.update(view[off:off + n])
            total += n
            off = (off + n) % PATTERN_LEN
        res["t_stop"] = time.monotonic()
        if a.mptcp:
            infos.append([res["t_stop"], mptcp_subflows(sock)])
        sock.shutdown(socket.SHUT_WR)
        # Until the receiver closes: everything sent was then read.
        while sock.recv(65536):
            pass
        res["t_end"] = time.monotonic()
    except Stop as e:
        res["error"] = f"stopped by {e}"
    except OSError as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        try:
            sock.close()
        except (OSError, Stop):
            pass
    res.update(bytes=total, sha256=h.hexdigest(), mptcp=infos if a.mptcp else None)
    emit(res)
    return 0 if res["error"] is None else 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="role", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--bind", default="0.0.0.0")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--mptcp", action="store_true")
    r.add_argument("--gap-ms", type=float, default=1.0)
    r.add_argument("--mark-ms", type=float, default=10.0)
    s = sub.add_parser("send")
    s.add_argument("--connect", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--mptcp", action="store_true")
    s.add_argument("--chunk", type=int, default=64 * 1024)
    s.add_argument("--info-every", type=float, default=0.25)
    s.add_argument("--ballast-mb", type=int, default=0)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return recv_main(a) if a.role == "recv" else send_main(a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
