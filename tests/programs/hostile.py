#!/usr/bin/env python3
"""A hostile peer on a virtual connection, the echo server it attacks, and a normal client.

    hostile.py server --bind IP:PORT
    hostile.py attack --connect IP:PORT --case CASE [--seed N] [--wait S]
    hostile.py probe --connect IP:PORT [--hold S]

server: a threaded echo server (run it under the layer). For every connection it prints
    JSON lines {"event": "accepted", "peer": ...} and, when the connection ends,
    {"event": "closed", "peer": ..., "received": N, "sent": N, "error": null | "repr"}:
    "error" is what the program itself observed (ConnectionResetError, ...), null for a clean
    end of stream. It keeps serving after any error.

attack: runs WITHOUT the layer but speaks the agent protocol itself, so that the server's
    layer takes the connection for a virtual one: Hello and Connect to the agent of its own
    network namespace (abstract Unix socket @vmi-agent), expects Virtual, connects from the
    announced port and sends what CASE says (see CASES). Then it reads for --wait seconds
    and prints one JSON line: the agent's answers, the GID it chose, its address, and how
    the connection ended ("eof", "reset" or "open" if nothing happened) with the bytes it
    received. Case "valid" speaks the frame protocol correctly instead and parses the
    server's framed answers.

probe: a normal echo client (run it under the layer): a few messages, each echoed byte for
    byte, then it keeps the connection open --hold seconds and prints {"ok": true, ...}.
"""

import argparse
import json
import os
import random
import socket
import struct
import sys
import threading
import time

# ---------------------------------------------------------------------------------------------
# Agent protocol (substrate/src/wire/agent.rs): u32 LE body length, then tag + fields.

HELLO, LISTEN, UNLISTEN, CONNECT, ACCEPT, VIRTUAL, PLAIN, OK, ERROR = range(1, 10)
TAG_NAMES = {1: "Hello", 2: "Listen", 3: "Unlisten", 4: "Connect", 5: "Accept", 6: "Virtual",
             7: "Plain", 8: "Ok", 9: "Error", 10: "Status", 11: "StatusReply", 77: "Welcome"}
AGENT_SOCKET = "\0vmi-agent"
WINDOW = 2 << 20


def enc_str(s):
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def enc_addr(ip, port):
    return bytes([4]) + socket.inet_aton(ip) + struct.pack("<H", port)


def enc_u128(v):
    return v.to_bytes(16, "little")


def agent_msg(tag, body=b""):
    payload = bytes([tag]) + body
    return struct.pack("<I", len(payload)) + payload


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"end of stream after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def agent_call(sock, tag, body=b""):
    sock.sendall(agent_msg(tag, body))
    (n,) = struct.unpack("<I", recv_exact(sock, 4))
    reply = recv_exact(sock, n)
    return reply[0], reply[1:]


# ---------------------------------------------------------------------------------------------
# Frames (substrate/src/wire/frame.rs): 24-byte header, little endian.

MAGIC = 0xA7
DATA, ACK, RESYNC = 1, 2, 3
HEADER = struct.Struct("<BBHIQQ")  # magic, kind, flags, len, seq, ack


def frame(kind, length, seq, ack, magic=MAGIC, flags=0):
    return HEADER.pack(magic, kind, flags, length, seq, ack)


def parse_header(b):
    magic, kind, flags, length, seq, ack = HEADER.unpack(b)
    return {"magic": magic, "kind": kind, "flags": flags, "len": length, "seq": seq, "ack": ack}


def case_bytes(case, rng):
    """What the hostile peer sends, and the first byte of it."""
    if case == "http_request_line":
        data = b"GET / HTTP/1.1\r\n"
    elif case == "http_request":
        data = b"GET /index.html HTTP/1.1\r\nHost: vmi.test\r\nAccept: */*\r\n\r\n"
    elif case == "bad_magic":
        data = frame(DATA, 5, 0, 0, magic=0x00) + b"hello"
    elif case == "out_of_order":
        data = frame(DATA, 5, 1000, 0) + b"hello"
    elif case == "bad_kind":
        data = frame(99, 5, 0, 0) + b"hello"
    elif case == "zero_len":
        data = frame(DATA, 0, 0, 0)
    elif case == "ack_beyond":
        data = frame(ACK, 0, 0, 1_000_000)
    elif case == "data_ack_beyond":
        data = frame(DATA, 5, 0, 1_000_000) + b"hello"
    elif case == "random":
        data = bytearray(rng.randbytes(64))
        if data[0] == MAGIC:
            data[0] ^= 0xFF
        data = bytes(data)
    else:
        raise SystemExit(f"unknown case {case!r}")
    return data


CASES = ["http_request_line", "http_request", "bad_magic", "out_of_order", "bad_kind",
         "zero_len", "ack_beyond", "data_ack_beyond", "random", "valid"]


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def emit(obj):
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------------------------------------
# server

def serve_conn(conn, peer):
    name = f"{peer[0]}:{peer[1]}"
    received = sent = 0
    error = None
    try:
        while True:
            data = conn.recv(65536)
            if not data:
                break
            received += len(data)
            conn.sendall(data)
            sent += len(data)
    except OSError as exc:
        error = repr(exc)
        print(f"hostile server: connection {name}: {exc!r}", file=sys.stderr, flush=True)
    finally:
        conn.close()
    emit({"event": "closed", "peer": name, "received": received, "sent": sent, "error": error})


def server(args):
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(args.bind)
    lsock.listen(64)
    while True:
        try:
            conn, peer = lsock.accept()
        except OSError as exc:
            print(f"hostile server: accept: {exc!r}", file=sys.stderr, flush=True)
            time.sleep(0.05)
            continue
        emit({"event": "accepted", "peer": f"{peer[0]}:{peer[1]}"})
        threading.Thread(target=serve_conn, args=(conn, peer), daemon=True).start()


# ---------------------------------------------------------------------------------------------
# attack

def read_until_end(sock, deadline, limit=1 << 16):
    """Reads until end of stream, a reset or the deadline: (outcome, bytes)."""
    got = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "open", got
        sock.settimeout(left)
        try:
            chunk = sock.recv(limit)
        except socket.timeout:
            return "open", got
        except ConnectionResetError:
            return "reset", got
        if not chunk:
            return "eof", got
        got += chunk


def read_frame(sock, deadline):
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    h = parse_header(recv_exact(sock, HEADER.size))
    payload = recv_exact(sock, h["len"]) if h["kind"] == DATA else b""
    return h, payload


def attack(args):
    rng = random.Random(args.seed)
    out = {"case": args.case}
    dst_ip, dst_port = args.connect
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    agent.settimeout(5)
    agent.connect(AGENT_SOCKET)
    tag, _ = agent_call(agent, HELLO, struct.pack("<I", os.getpid()) + enc_str("hostile"))
    out["hello_answer"] = TAG_NAMES.get(tag, tag)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    port = sock.getsockname()[1]
    gid = rng.getrandbits(128)
    secret = rng.getrandbits(128)
    out["gid"] = f"{gid:032x}"
    body = (enc_addr("0.0.0.0", port) + enc_addr(dst_ip, dst_port) + enc_u128(gid)
            + enc_u128(secret) + struct.pack("<Q", WINDOW)
            + enc_addr(dst_ip, dst_port)  # aim: the destination the program asked for
            + struct.pack("<I", 0))  # agents: none (a layer sends none)
    tag, rest = agent_call(agent, CONNECT, body)
    out["connect_answer"] = TAG_NAMES.get(tag, tag)
    if tag != VIRTUAL:
        emit(out)
        return 1
    out["server_window"] = struct.unpack("<Q", rest[32:40])[0]
    # The agent puts its cluster's id in the GID's top 16 bits (the rest is ours).
    issued = int.from_bytes(rest[0:16], "little")
    if issued & ((1 << 112) - 1) != gid & ((1 << 112) - 1):
        out["error"] = f"the agent answered GID {issued:032x} for ours {gid:032x}"
    out["gid"] = f"{issued:032x}"

    sock.settimeout(5)
    sock.connect((dst_ip, dst_port))
    out["local"] = "%s:%d" % sock.getsockname()
    t0 = time.monotonic()
    deadline = t0 + args.wait
    try:
        if args.case == "valid":
            out.update(valid_exchange(sock, deadline))
        else:
            data = case_bytes(args.case, rng)
            out["sent_hex"] = data.hex()
            out["first_byte"] = data[0]
            sock.sendall(data)
            outcome, got = read_until_end(sock, deadline)
            out["outcome"] = outcome
            out["received_hex"] = got.hex()
    except (OSError, EOFError) as exc:
        out["outcome"] = "error"
        out["error"] = repr(exc)
    out["seconds"] = round(time.monotonic() - t0, 3)
    sock.close()
    agent.close()
    emit(out)
    return 0


def valid_exchange(sock, deadline):
    """Correct frames: 'hello' then 'world!'; the echoes come back framed."""
    res = {"frames": []}
    sock.sendall(frame(DATA, 5, 0, 0) + b"hello")
    h, p = read_frame(sock, deadline)
    res["frames"].append({**h, "payload": p.decode(errors="replace")})
    # Acknowledge the server's 5 bytes; our stream continues at offset 5.
    sock.sendall(frame(DATA, 6, 5, 5) + b"world!")
    h, p = read_frame(sock, deadline)
    res["frames"].append({**h, "payload": p.decode(errors="replace")})
    sock.shutdown(socket.SHUT_WR)
    outcome, got = read_until_end(sock, deadline)
    res["outcome"] = outcome
    res["received_hex"] = got.hex()
    return res


# ---------------------------------------------------------------------------------------------
# probe

def probe(args):
    rng = random.Random(7)
    sizes = [1, 1000, 70000, 1 << 20]
    sock = socket.create_connection(args.connect, timeout=10)
    out = {"local": "%s:%d" % sock.getsockname(), "messages": 0, "bytes": 0}
    try:
        for size in sizes:
            msg = rng.randbytes(size)
            threading.Thread(target=sock.sendall, args=(msg,), daemon=True).start()
            echo = recv_exact(sock, size)
            if echo != msg:
                out["error"] = f"echo of {size} bytes differs"
                break
            out["messages"] += 1
            out["bytes"] += size
        time.sleep(args.hold)
    except (OSError, EOFError) as exc:
        out["error"] = repr(exc)
    sock.close()
    out["ok"] = "error" not in out
    emit(out)
    return 0 if out["ok"] else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("server")
    s.add_argument("--bind", type=parse_addr, required=True)
    a = sub.add_parser("attack")
    a.add_argument("--connect", type=parse_addr, required=True)
    a.add_argument("--case", choices=CASES, required=True)
    a.add_argument("--seed", type=int, default=1)
    a.add_argument("--wait", type=float, default=2.0)
    c = sub.add_parser("probe")
    c.add_argument("--connect", type=parse_addr, required=True)
    c.add_argument("--hold", type=float, default=0.5)
    args = p.parse_args()
    if args.mode == "server":
        server(args)
        return 0
    return attack(args) if args.mode == "attack" else probe(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        pass
