#!/usr/bin/env python3
"""What the kernel offers for sending without its copy, on this machine's paths: plain
`send`, `send(MSG_ZEROCOPY)` with its completions, and `vmsplice` of the buffer's pages into
a pipe then `splice` into the socket (benchmarks/programs/zerocopy_probe.c), over veth
between two namespace hosts and over loopback, at several sizes. The modes alternate within
each repetition; medians (min-max) of the sender's CPU time per GiB and of the rate, and how
many zero-copy completions said the kernel copied after all.

    sudo python3 benchmarks/harness/zerocopy.py [--reps 5] [--gib 2] [--ring]

With `--ring`, the ways the layer's send path could send from its replay ring instead: the
buffer copied into an 8 MiB ring behind a 24-byte frame header, then sent with one `sendmsg`
(the kernel's copy: what the layer does) or spliced from the ring with the header through the
pipe, by `send` with MSG_MORE, or left out (the bound), at 128 KiB and 1 MiB.

Hosts `vmizc1`, `vmizc2` (10.84.0.0/24), removed at the end, also on failure. No layer is
involved: this measures what the layer's send path could build on.
"""

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREFIX = "vmizc"
NET0, NET1 = "10.84.0", "10.84.1"
H1, H2 = f"{PREFIX}1", f"{PREFIX}2"
MODES = ["plain", "zerocopy", "splice"]
SIZES = [16384, 65536, 262144]
RING_MODES = ["ring", "ring-pipe", "ring-send", "ring-bare"]
RING_SIZES = [131072, 1048576]


def ns(host, argv):
    return ["nsenter", f"--net=/run/netns/{host}", *map(str, argv)]


def topo(cmd):
    env = dict(os.environ, VMI_NET0=NET0, VMI_NET1=NET1)
    subprocess.run(["bash", str(REPO / "scripts" / "topo.sh"), cmd, "2", PREFIX], env=env,
                   check=cmd == "up", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)


def spread(xs, fmt):
    return f"{fmt % statistics.median(xs)} ({fmt % min(xs)}-{fmt % max(xs)})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gib", type=int, default=2, help="GiB per run")
    ap.add_argument("--ring", action="store_true", help="the replay-ring modes")
    a = ap.parse_args()
    modes, sizes = (RING_MODES, RING_SIZES) if a.ring else (MODES, SIZES)
    tmp = Path(tempfile.mkdtemp(prefix="vmi-zc-"))
    probe = tmp / "zerocopy_probe"
    subprocess.run(["gcc", "-O2", "-Wall", "-o", probe, REPO / "benchmarks" / "programs" / "zerocopy_probe.c"],
                   check=True)
    servers = []
    res = {}
    topo("down")
    topo("up")
    try:
        paths = {"veth": (f"{NET0}.2", 5100), "loopback": ("127.0.0.1", 5101)}
        servers.append(subprocess.Popen(ns(H2, [probe, "server", paths["veth"][0], 5100]),
                                        start_new_session=True))
        servers.append(subprocess.Popen(ns(H1, [probe, "server", "127.0.0.1", 5101]),
                                        start_new_session=True))
        time.sleep(0.5)
        for rep in range(a.reps):
            for size in sizes:
                count = (a.gib << 30) // size
                for mode in modes if rep % 2 == 0 else modes[::-1]:
                    for path, (ip, port) in paths.items():
                        print(f"[zerocopy] rep {rep + 1}/{a.reps} {size} B {mode} {path}",
                              file=sys.stderr, flush=True)
                        out = subprocess.run(ns(H1, ["taskset", "-c", "1", probe, "client", ip, port,
                                                     mode, size, count]),
                                             capture_output=True, text=True, timeout=300, check=True)
                        j = json.loads(out.stdout)
                        res.setdefault((path, size, mode), []).append(j)
    finally:
        for s in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.pid, signal.SIGKILL)
            s.wait()
        topo("down")
    title = "A ring sent by reference" if a.ring else "Sending without the kernel's copy"
    print(f"## {title}, {time.strftime('%Y-%m-%d')}\n")
    print("| path | size | mode | sender CPU s per GiB | Gbit/s | completions copied |")
    print("|---|---|---|---|---|---|")
    for (path, size, mode), runs in sorted(res.items()):
        cpu = [r["cpu_s_per_gib"] for r in runs]
        rate = [r["bytes"] * 8 / r["seconds"] / 1e9 for r in runs]
        done = sum(r["completions"] for r in runs)
        copied = sum(r["copied"] for r in runs)
        zc = f"{copied} of {done}" if mode == "zerocopy" else "-"
        print(f"| {path} | {size >> 10} KiB | {mode} | {spread(cpu, '%.3f')} | {spread(rate, '%.1f')} | {zc} |")


if __name__ == "__main__":
    main()
