#!/usr/bin/env python3
"""Asyncio echo server: every byte a client sends comes back on the same connection.

    echo_server.py --bind IP:PORT

Runs until killed. Uses the default event loop (epoll on Linux) with non-blocking sockets.
"""

import argparse
import asyncio
import sys

CHUNK = 64 * 1024


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


async def handle(reader, writer):
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError) as exc:
        print(f"echo_server: connection error: {exc!r}", file=sys.stderr, flush=True)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bind", type=parse_addr, required=True)
    args = p.parse_args()
    host, port = args.bind
    server = await asyncio.start_server(handle, host, port, backlog=1024, reuse_address=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
