#!/usr/bin/env python3
"""Many concurrent echo clients that check every echoed byte.

    echo_clients.py --connect IP:PORT [--clients 300] [--messages 20] [--max-size 65536]
                    [--seed 1] [--hold S] [--gap S]

All clients connect first and wait until every one of them is connected; then each sends
--messages messages of random size (1 B .. --max-size, log-uniform, from a per-client seed),
reading each echo back and comparing it byte for byte (with --gap, that many seconds after
the previous echo). With --hold every client keeps its connection open that many seconds
after its last echo. Prints one JSON line with totals and
exits 1 if any echo differed or any client failed.
"""

import argparse
import asyncio
import json
import math
import random
import sys
import time


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


class Totals:
    def __init__(self):
        self.connected = 0
        self.done = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages = 0
        self.mismatches = 0
        self.errors = []


async def one_client(index, args, totals, all_connected):
    rng = random.Random(args.seed * 1_000_003 + index)
    host, port = args.connect
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        totals.connected += 1
        if totals.connected == args.clients:
            all_connected.set()
        await asyncio.wait_for(all_connected.wait(), timeout=args.connect_timeout)
        max_exp = math.log2(args.max_size)
        for i in range(args.messages):
            if i and args.gap > 0:
                await asyncio.sleep(args.gap)
            size = max(1, min(args.max_size, int(2 ** rng.uniform(0, max_exp))))
            msg = rng.randbytes(size)
            writer.write(msg)
            await writer.drain()
            echo = await reader.readexactly(size)
            totals.bytes_sent += size
            totals.bytes_received += len(echo)
            totals.messages += 1
            if echo != msg:
                totals.mismatches += 1
                first = next(i for i in range(size) if echo[i] != msg[i])
                totals.errors.append(f"client {index}: echo differs at byte {first} of {size}")
                break
        if args.hold > 0:
            await asyncio.sleep(args.hold)
        totals.done += 1
    except Exception as exc:
        totals.errors.append(f"client {index}: {exc!r}")
        all_connected.set()  # do not leave the others waiting for a client that failed
    finally:
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass


async def run(args):
    totals = Totals()
    all_connected = asyncio.Event()
    start = time.monotonic()
    await asyncio.gather(*(one_client(i, args, totals, all_connected)
                           for i in range(args.clients)))
    result = {
        "clients": args.clients,
        "connected": totals.connected,
        "completed": totals.done,
        "messages": totals.messages,
        "bytes_sent": totals.bytes_sent,
        "bytes_received": totals.bytes_received,
        "mismatches": totals.mismatches,
        "errors": totals.errors[:20],
        "error_count": len(totals.errors),
        "seconds": round(time.monotonic() - start, 3),
    }
    print(json.dumps(result), flush=True)
    ok = totals.mismatches == 0 and not totals.errors and totals.done == args.clients
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", type=parse_addr, required=True)
    p.add_argument("--clients", type=int, default=300)
    p.add_argument("--messages", type=int, default=20)
    p.add_argument("--max-size", type=int, default=65536)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--gap", type=float, default=0.0, help="seconds between two messages of a client")
    p.add_argument("--connect-timeout", type=float, default=30.0,
                   help="seconds to wait for all clients to be connected")
    args = p.parse_args()
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
