#!/usr/bin/env python3
"""A two-way stream of framed messages over non-blocking sockets (asyncio: epoll, partial
sends, reads until EAGAIN), the way event-driven programs and MPI progress engines use TCP.

    nb_stream.py server|client --addr IP:PORT [--seconds S]

Each side sends messages of mixed sizes (8 B to 70001 B) for S seconds (default 5), each an
8-byte header (length, sequence number) and a payload derived from its sequence number, then
an end marker; the other side checks every message. Each prints one JSON line: {"role",
"sent", "received", "errors"} ("first_error" and "error" when something went wrong). The
server takes one connection.
"""
import argparse
import asyncio
import json
import random
import struct

def payload(seq, n):
    b = bytes([(seq * 7 + i) % 251 for i in range(min(n, 251))])
    return (b * (n // 251 + 1))[:n]

async def run(reader, writer, seconds, out):
    async def tx():
        seq = 0
        loop = asyncio.get_running_loop(); end = loop.time() + seconds
        rnd = random.Random(1)
        while loop.time() < end:
            n = rnd.choice([8, 24, 100, 1000, 4096, 9000, 65536, 70001])
            writer.write(struct.pack("<II", n, seq) + payload(seq, n))
            seq += 1
            if seq % 8 == 0:
                await writer.drain()
        writer.write(struct.pack("<II", 0, seq)); await writer.drain()
        out["sent"] = seq
    async def rx():
        seq = 0
        while True:
            n, s = struct.unpack("<II", await reader.readexactly(8))
            if n == 0:
                break
            data = await reader.readexactly(n)
            if s != seq or data != payload(seq, n):
                out["errors"] += 1
                out.setdefault("first_error", f"msg {seq}: got seq {s} len {n}")
                break
            seq += 1
        out["received"] = seq
    await asyncio.gather(tx(), rx())

async def main():
    ap = argparse.ArgumentParser(); ap.add_argument("role"); ap.add_argument("--addr"); ap.add_argument("--seconds", type=float, default=5)
    a = ap.parse_args(); host, _, port = a.addr.rpartition(":")
    out = {"role": a.role, "errors": 0}
    if a.role == "server":
        done = asyncio.Event()
        async def handle(r, w):
            try:
                await run(r, w, a.seconds, out)
            except Exception as e:
                out["error"] = repr(e)
            w.close(); done.set()
        srv = await asyncio.start_server(handle, host, int(port))
        await done.wait(); srv.close()
    else:
        r, w = await asyncio.open_connection(host, int(port))
        try:
            await run(r, w, a.seconds, out)
        except Exception as e:
            out["error"] = repr(e)
        w.close()
    print(json.dumps(out), flush=True)

asyncio.run(main())
