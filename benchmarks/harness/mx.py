#!/usr/bin/env python3
"""The Myrinet-style protocol over raw Ethernet (`mx-stream`) side by side with kernel TCP on
the same two namespace hosts and the same network (eth1), in one run.

For each MTU (1500, and 9000 with jumbo frames on the veths and the bridge) and each
repetition, the three transports alternate:

* kernel TCP: iperf3, one stream; sockperf ping-pong;
* mx through the kernel's packet rings (`--io ring`, the driver the layer's sink uses);
* mx with one system call per frame (`--io call`).

Figures: one-stream throughput (Gbit/s at the receiver), CPU time of sender plus receiver per
GiB moved (from wait4's rusage of both processes: figures noise does not move much), system
calls per MiB (mx only, counted by mx-stream), and half the round trip of a ping-pong at
64 B, 4 KiB and 65,000 B (median over the run; sockperf's RTT/2 percentile for TCP). Medians of
the repetitions with their range; Markdown on stdout, progress on stderr.

    sudo python3 benchmarks/harness/mx.py [--reps 5] [--mib 512] [--mtus 1500,9000]

Hosts `vmimx1`, `vmimx2` (10.79.0.0/24 and 10.79.1.0/24), removed at the end, also on failure.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MX = REPO / "target" / "release" / "mx-stream"
PREFIX = "vmimx"
NET0, NET1 = "10.79.0", "10.79.1"
H1, H2 = f"{PREFIX}1", f"{PREFIX}2"
IP2 = f"{NET1}.2"
# (sockperf refuses messages above about 65,500 bytes: 65000 is the 64 KiB point.)
SIZES = [64, 4096, 65000]


def log(msg):
    print(f"[mx] {msg}", file=sys.stderr, flush=True)


def ns(host, argv):
    return ["nsenter", f"--net=/run/netns/{host}", *map(str, argv)]


def topo(cmd):
    env = dict(os.environ, VMI_NET0=NET0, VMI_NET1=NET1)
    subprocess.run(["bash", str(REPO / "scripts" / "topo.sh"), cmd, "2", PREFIX], env=env,
                   check=cmd == "up", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)


def set_mtu(mtu):
    for h in (H1, H2):
        subprocess.run(["ip", "-n", h, "link", "set", "eth1", "mtu", str(mtu)], check=True)
    for i in (1, 2):
        subprocess.run(["ip", "link", "set", f"{PREFIX}{i}e1", "mtu", str(mtu)], check=True)
    subprocess.run(["ip", "link", "set", f"{PREFIX}br1", "mtu", str(mtu)], check=True)


def mac(host):
    out = subprocess.run(["ip", "-n", host, "-br", "link", "show", "eth1"], capture_output=True,
                         text=True, check=True).stdout.split()
    return out[2]


class Proc:
    """A child whose CPU time is read from wait4 when it ends."""

    def __init__(self, argv):
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        self.cpu = None

    def finish(self, timeout):
        deadline = time.time() + timeout
        while True:
            pid, status, ru = os.wait4(self.p.pid, os.WNOHANG)
            if pid:
                self.p.returncode = os.waitstatus_to_exitcode(status)
                self.cpu = ru.ru_utime + ru.ru_stime
                break
            if time.time() > deadline:
                os.killpg(self.p.pid, 9)
                raise RuntimeError(f"{self.p.args[-12:]} did not finish in {timeout} s")
            time.sleep(0.01)
        out, err = self.p.stdout.read(), self.p.stderr.read()
        if self.p.returncode != 0:
            raise RuntimeError(f"{' '.join(self.p.args)} exited {self.p.returncode}: {err[-400:]}")
        return out


def mx_stream(io, nbytes, session):
    m1, m2 = mac(H1), mac(H2)
    common = ["--session", session, "--bytes", nbytes, "--io", io]
    r = Proc(ns(H2, [MX, "recv", "--iface", "eth1", "--peer", m1, *common]))
    time.sleep(0.3)
    s = Proc(ns(H1, [MX, "send", "--iface", "eth1", "--peer", m2, *common]))
    js = json.loads(s.finish(120).strip().splitlines()[-1])
    jr = json.loads(r.finish(30).strip().splitlines()[-1])
    if not (js["ok"] and jr["ok"]) or jr["bytes"] != nbytes:
        raise RuntimeError(f"mx stream wrong: {js} {jr}")
    return {"gbit": jr["gbit_s"], "cpu_gib": (s.cpu + r.cpu) / (nbytes / (1 << 30)),
            "calls_mib": (js["syscalls"] + jr["syscalls"]) / (nbytes / (1 << 20)),
            "resent": js["resent"]}


def tcp_stream(nbytes):
    srv = Proc(ns(H2, ["iperf3", "-s", "-1", "-B", IP2]))
    time.sleep(0.3)
    cli = Proc(ns(H1, ["iperf3", "-c", IP2, "-n", nbytes, "-J"]))
    j = json.loads(cli.finish(120))
    srv.finish(30)
    gbit = j["end"]["sum_received"]["bits_per_second"] / 1e9
    return {"gbit": gbit, "cpu_gib": (srv.cpu + cli.cpu) / (nbytes / (1 << 30)), "calls_mib": None,
            "resent": None}


def mx_ping(io, size, session):
    m1, m2 = mac(H1), mac(H2)
    iters = 20000 if size <= 4096 else 5000
    common = ["--session", session, "--iters", iters, "--msg", size, "--io", io, "--spin-us", 0]
    pong = Proc(ns(H2, [MX, "pong", "--iface", "eth1", "--peer", m1, *common]))
    time.sleep(0.3)
    ping = Proc(ns(H1, [MX, "ping", "--iface", "eth1", "--peer", m2, *common]))
    j = json.loads(ping.finish(120).strip().splitlines()[-1])
    pong.finish(30)
    if not j["ok"]:
        raise RuntimeError(f"mx ping-pong wrong: {j}")
    return j["p50_us"]


PORTS = iter(range(11111, 12111))


def tcp_ping(size):
    port = next(PORTS)
    srv = subprocess.Popen(ns(H2, ["sockperf", "sr", "--tcp", "-i", IP2, "-p", port]),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        time.sleep(0.5)
        out = subprocess.run(ns(H1, ["sockperf", "pp", "--tcp", "-i", IP2, "-p", port, "-m", size,
                                     "-t", 3]), capture_output=True, text=True, timeout=60).stdout
    finally:
        os.killpg(srv.pid, 9)
        srv.wait()
    for line in out.splitlines():
        if "percentile 50.000" in line:
            return float(line.split("=")[-1])
    raise RuntimeError(f"sockperf printed no median: {out[-300:]}")


def spread(xs, digits=2):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, default=512, help="MiB per stream")
    ap.add_argument("--mtus", default="1500,9000")
    a = ap.parse_args()
    if os.geteuid() != 0 or not MX.exists():
        sys.exit("mx.py: run as root after `cargo build --release --workspace`")
    mtus = [int(x) for x in a.mtus.split(",")]
    nbytes = a.mib << 20
    modes = ["tcp", "ring", "call"]
    res = {}
    topo("down")
    try:
        topo("up")
        for mtu in mtus:
            set_mtu(mtu)
            for rep in range(a.reps):
                for mode in modes:
                    log(f"MTU {mtu} rep {rep + 1}/{a.reps}: {mode}")
                    st = tcp_stream(nbytes) if mode == "tcp" else mx_stream(mode, nbytes, 100 + rep)
                    for k, v in st.items():
                        res.setdefault((mtu, "stream", k, mode), []).append(v)
                    for size in SIZES:
                        lat = tcp_ping(size) if mode == "tcp" else mx_ping(mode, size, 200 + rep)
                        res.setdefault((mtu, "lat", size, mode), []).append(lat)
    finally:
        topo("down")
    day = time.strftime("%Y-%m-%d")
    print(f"## mx over raw Ethernet against kernel TCP, {day}\n")
    print(f"Two namespace hosts, eth1 (veth + bridge), {a.reps} alternating repetitions; median "
          f"(min–max). Streams of {a.mib} MiB; ping-pong half round trips (p50 of the run).\n")
    print("| MTU | figure | kernel TCP | mx, rings | mx, a call per frame | rings / TCP |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = [("stream", "gbit", "one stream, Gbit/s", 2), ("stream", "cpu_gib", "CPU s per GiB (both ends)", 2),
            ("stream", "calls_mib", "system calls per MiB (both ends)", 1)]
    for mtu in mtus:
        for kind, key, label, d in rows:
            cells = [spread(res.get((mtu, kind, key, m), []), d) for m in modes]
            t, r = med(res.get((mtu, kind, key, "tcp"), [])), med(res.get((mtu, kind, key, "ring"), []))
            ratio = f"{r / t:.2f}" if t and r else "–"
            print(f"| {mtu} | {label} | {' | '.join(cells)} | {ratio} |")
        for size in SIZES:
            cells = [spread(res.get((mtu, "lat", size, m), [])) for m in modes]
            t, r = med(res.get((mtu, "lat", size, "tcp"), [])), med(res.get((mtu, "lat", size, "ring"), []))
            ratio = f"{r / t:.2f}" if t and r else "–"
            print(f"| {mtu} | latency {size} B, µs | {' | '.join(cells)} | {ratio} |")
    resent = [x for m in ("ring", "call") for mtu in mtus for x in res.get((mtu, "stream", "resent", m), [])]
    print(f"\nMessages sent again without loss, over all mx streams: {sum(resent)} "
          f"(in {len(resent)} streams).")


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
    main()
