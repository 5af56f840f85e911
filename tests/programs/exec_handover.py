#!/usr/bin/env python3
"""A connection handed to another program across exec (inetd / socket-activation style).

    exec_handover.py server --bind IP:PORT --how fork_exec|subprocess
    exec_handover.py client --connect IP:PORT [--hold S]
    exec_handover.py helper FD          (started by the server, never by hand)

server: accepts one connection, reads GREETING and echoes it itself (so the stream offsets
    are not at zero when the connection changes hands), then starts `exec_handover.py helper
    FD` with the socket inherited, closes its own copy and waits for the helper. --how says
    how: fork_exec is os.fork() then os.execv() in the child; subprocess is
    subprocess.Popen(pass_fds=...). Prints {"role": "server", "helper_status": N, ...}.

helper: wraps descriptor FD with socket.socket(fileno=FD) and echoes until end of stream;
    prints {"role": "helper", "pid": ..., "received": N, "sent": N, "head_hex": "..."}
    (head_hex: the first bytes it read, to show raw frames if it ever sees any).

client: sends GREETING and checks the echo, then sends MESSAGES (sizes below) one at a time,
    checking each echo byte for byte with a 5 s limit, keeps the connection open --hold
    seconds and prints {"ok": true, "echoed": [...]} or the error (exit status 1).
"""

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

GREETING = b"before-exec\n"
SIZES = [1, 100, 5000, 70000, 300000]
STEP_TIMEOUT = 5.0


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def emit(obj):
    print(json.dumps(obj), flush=True)


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"end of stream after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def server(args):
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(args.bind)
    lsock.listen(4)
    conn, peer = lsock.accept()
    lsock.close()
    out = {"role": "server", "pid": os.getpid(), "peer": "%s:%d" % peer, "how": args.how}
    try:
        conn.sendall(recv_exact(conn, len(GREETING)))
    except (OSError, EOFError) as exc:
        out["error"] = f"greeting: {exc!r}"
        emit(out)
        return 1
    fd = conn.fileno()
    argv = [sys.executable, os.path.abspath(__file__), "helper", str(fd)]
    if args.how == "fork_exec":
        os.set_inheritable(fd, True)
        pid = os.fork()
        if pid == 0:
            try:
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        conn.close()
        _, status = os.waitpid(pid, 0)
        out["helper_status"] = os.waitstatus_to_exitcode(status)
    else:
        child = subprocess.Popen(argv, pass_fds=[fd])
        conn.close()
        out["helper_status"] = child.wait()
    out["helper_pid"] = pid if args.how == "fork_exec" else child.pid
    emit(out)
    return 0 if out["helper_status"] == 0 else 1


def helper(args):
    sock = socket.socket(fileno=args.fd)
    out = {"role": "helper", "pid": os.getpid(), "received": 0, "sent": 0, "head_hex": ""}
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            if len(out["head_hex"]) < 96:
                out["head_hex"] += data[:48 - len(out["head_hex"]) // 2].hex()
            out["received"] += len(data)
            sock.sendall(data)
            out["sent"] += len(data)
    except OSError as exc:
        out["error"] = repr(exc)
    sock.close()
    emit(out)
    return 0 if "error" not in out else 1


def client(args):
    rng = random.Random(5)
    sock = socket.create_connection(args.connect, timeout=STEP_TIMEOUT)
    out = {"role": "client", "local": "%s:%d" % sock.getsockname(), "echoed": []}
    try:
        sock.sendall(GREETING)
        echo = recv_exact(sock, len(GREETING))
        if echo != GREETING:
            raise AssertionError(f"greeting echoed as {echo!r}")
        for size in SIZES:
            msg = rng.randbytes(size)
            threading.Thread(target=sock.sendall, args=(msg,), daemon=True).start()
            try:
                echo = recv_exact(sock, size)
            except socket.timeout:
                raise AssertionError(f"no complete echo of the {size}-byte message within "
                                     f"{STEP_TIMEOUT} s") from None
            if echo != msg:
                first = next((i for i in range(size) if echo[i] != msg[i]), size)
                raise AssertionError(f"the echo of the {size}-byte message differs from byte "
                                     f"{first} (got {echo[first:first + 24].hex()})")
            out["echoed"].append(size)
        time.sleep(args.hold)
    except (OSError, EOFError, AssertionError) as exc:
        out["error"] = f"after echoes of {out['echoed']}: {exc!r}"
    sock.close()
    out["ok"] = "error" not in out
    emit(out)
    return 0 if out["ok"] else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("server")
    s.add_argument("--bind", type=parse_addr, required=True)
    s.add_argument("--how", choices=["fork_exec", "subprocess"], required=True)
    h = sub.add_parser("helper")
    h.add_argument("fd", type=int)
    c = sub.add_parser("client")
    c.add_argument("--connect", type=parse_addr, required=True)
    c.add_argument("--hold", type=float, default=0.5)
    args = p.parse_args()
    return {"server": server, "helper": helper, "client": client}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
