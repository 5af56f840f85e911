#!/usr/bin/env python3
"""Client for fork_server.py: several concurrent connections, each checked.

    fork_client.py --connect IP:PORT --mode hash [--connections 8] [--max-bytes N] [--seed S]
    fork_client.py --connect IP:PORT --mode both [--connections 3]

mode hash: all connections open at once; each sends a random amount (1 .. --max-bytes) in
    random-size writes, half-closes, and checks the "<sha256> <count>" answer, reading to
    end of stream (the server may keep the connection open a while: fork_server --hold).
mode both: connections one after another; each must read exactly "child\\nparent\\n".

Prints one JSON line and exits 1 on any mismatch or error.
"""

import argparse
import hashlib
import json
import random
import socket
import sys
import threading
import time

EXPECTED_BOTH = b"child\nparent\n"


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def read_all(sock):
    parts = []
    while True:
        data = sock.recv(65536)
        if not data:
            return b"".join(parts)
        parts.append(data)


def hash_conn(index, args, barrier, results):
    rng = random.Random(args.seed * 7919 + index)
    try:
        sock = socket.create_connection(args.connect)
        barrier.wait(timeout=30)
        total = rng.randint(1, args.max_bytes)
        h = hashlib.sha256()
        left = total
        while left:
            size = min(left, max(1, int(2 ** rng.uniform(0, 17))))
            chunk = rng.randbytes(size)
            sock.sendall(chunk)
            h.update(chunk)
            left -= size
        sock.shutdown(socket.SHUT_WR)
        answer = read_all(sock)
        sock.close()
        expected = f"{h.hexdigest()} {total}\n".encode()
        if answer != expected:
            results[index] = f"connection {index}: sent {total} bytes, expected " \
                             f"{expected!r}, got {answer[:200]!r}"
        else:
            results[index] = total
    except Exception as exc:
        results[index] = f"connection {index}: {exc!r}"
        barrier.abort()


def run_hash(args):
    results = [None] * args.connections
    barrier = threading.Barrier(args.connections)
    threads = [threading.Thread(target=hash_conn, args=(i, args, barrier, results), daemon=True)
               for i in range(args.connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def run_both(args):
    results = []
    for i in range(args.connections):
        try:
            sock = socket.create_connection(args.connect)
            answer = read_all(sock)
            sock.close()
            if answer != EXPECTED_BOTH:
                results.append(f"connection {i}: expected {EXPECTED_BOTH!r}, got {answer!r}")
            else:
                results.append(len(answer))
        except Exception as exc:
            results.append(f"connection {i}: {exc!r}")
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", type=parse_addr, required=True)
    p.add_argument("--mode", choices=["hash", "both"], required=True)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    start = time.monotonic()
    results = run_hash(args) if args.mode == "hash" else run_both(args)
    errors = [r for r in results if not isinstance(r, int)]
    print(json.dumps({
        "mode": args.mode,
        "connections": args.connections,
        "ok": len(results) - len(errors),
        "bytes": sum(r for r in results if isinstance(r, int)),
        "errors": errors,
        "seconds": round(time.monotonic() - start, 3),
    }), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
