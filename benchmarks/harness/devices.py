#!/usr/bin/env python3
"""Devices (the filters of the device chain) on and off, side by side in one run, on two
namespace hosts under the layer.

* codec: each filter's speed on one CPU (`filter-speed`: frames of 16 KiB of text, the
  repository's own sources and documents, and of random bytes), next to this machine's
  reference `lz4` and `zstd` command-line tools on the same text (whole-file benchmarks: the
  speed the machine allows, which the per-core targets are read against);
* goodput of text over a network shaped to 1 Gbit/s (tbf on the sender's eth0): one stream,
  no device, `lz4`, `zstd:1`, `zstd:3`, and the sealing devices (`aead` is AES-256-GCM,
  `aead:chacha20-poly1305`, and `lz4,aead`: compressed, then sealed);
* iperf3 (random data, one stream, the unshaped veth) with each device: throughput and CPU
  time of both ends per GiB moved (iperf3's own CPU figures);
* sockperf ping-pong, 64 B and 16 KiB, with each device;
* the time `vmictl device load|unload` takes on a busy connection (iperf3 at full speed):
  from the command to the sending end switching what it sends (read from the
  `send_since_ms` its layer records) once the receiving end lists the chain too;
* the taps, off and on, loaded on the running programs' connection: `profile` (at both ends)
  and `vmictl capture` (the sending end, into /dev/null, so that the figure is the layer's
  work and not the disk's), with iperf3 (the first second, before the tap, left out with
  `-O 1`) and sockperf ping-pong at 64 B (the tap on for the last 3.5 of 4 s).

Modes alternate within each repetition; medians with their range. Markdown on stdout,
progress on stderr, the raw figures as JSON with --json FILE.

    sudo python3 benchmarks/harness/devices.py [--reps 5] [--mib 256] [--only taps]

Hosts `vmidv1`, `vmidv2` (10.81.0.0/24 and 10.81.1.0/24), removed at the end, also on failure.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "target" / "release"
PREFIX = "vmidv"
NET0, NET1 = "10.81.0", "10.81.1"
H1, H2 = f"{PREFIX}1", f"{PREFIX}2"
IP2 = f"{NET0}.2"
MODES = ["none", "lz4", "zstd:1", "zstd:3", "aead", "aead:chacha20-poly1305", "lz4,aead"]
TAP_MODES = ["off", "profile", "capture"]
LIVE = []

SENDER = r"""
import socket, sys, time
host, port, total, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
buf = open(path, "rb").read()
s = socket.create_connection((host, port))
left = total
while left > 0:
    n = min(left, len(buf))
    s.sendall(memoryview(buf)[:n])
    left -= n
s.shutdown(socket.SHUT_WR)
s.recv(1)
"""

RECEIVER = r"""
import json, socket, sys, time
port = int(sys.argv[1])
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("0.0.0.0", port)); l.listen(1)
print("ready", flush=True)
c, _ = l.accept()
buf = bytearray(1 << 20)
got, t0 = 0, None
while True:
    n = c.recv_into(buf)
    if not n:
        break
    if t0 is None:
        t0 = time.monotonic()
    got += n
t1 = time.monotonic()
c.close()
print(json.dumps({"bytes": got, "seconds": t1 - (t0 or t1)}), flush=True)
"""


def log(msg):
    print(f"[devices] {msg}", file=sys.stderr, flush=True)


def ns(host, argv):
    return ["nsenter", f"--net=/run/netns/{host}", *map(str, argv)]


def start(argv, env=None, **kw):
    p = subprocess.Popen(argv, env=env, start_new_session=True, **kw)
    LIVE.append(p)
    return p


def stop(p):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=3)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@contextlib.contextmanager
def hosts(tmp):
    """The two hosts, an agent in each; everything started is stopped and the hosts removed
    at the end, also on failure."""
    topo("down")
    topo("up")
    try:
        Agents(tmp).up()
        yield
    finally:
        for p in LIVE:
            if p.poll() is None:
                stop(p)
        topo("down")


def topo(cmd):
    env = dict(os.environ, VMI_NET0=NET0, VMI_NET1=NET1)
    subprocess.run(["bash", str(REPO / "scripts" / "topo.sh"), cmd, "2", PREFIX], env=env,
                   check=cmd == "up", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)


def layer_env(chain):
    e = dict(os.environ, LD_PRELOAD=str(BIN / "libvmi_preload.so"), VMI_LOG="warn", VMI_SHM="0")
    e.pop("VMI_CHAIN", None)
    if chain != "none":
        e["VMI_CHAIN"] = chain
    return e


def vmictl(host, *args):
    r = subprocess.run(ns(host, [BIN / "vmictl", *args]), capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise RuntimeError(f"vmictl {' '.join(map(str, args))} in {host}: {r.stderr.strip()}")
    return r.stdout


def med(xs):
    return statistics.median(xs) if xs else None


def spread(xs, digits=2):
    if not xs:
        return "-"
    return f"{med(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


class Agents:
    def __init__(self, tmp):
        self.key = tmp / "cluster.key"
        subprocess.run([BIN / "vmi-agent", "--init", "--key", self.key], check=True,
                       capture_output=True)
        self.procs = []

    def up(self):
        env = dict(os.environ, VMI_CLUSTER_KEY=str(self.key), VMI_LOG="warn")
        env.pop("LD_PRELOAD", None)
        for h in (H1, H2):
            self.procs.append(start(ns(h, [BIN / "vmi-agent"]), env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        for h in (H1, H2):
            while subprocess.run(ns(h, [BIN / "vmictl", "status"]), capture_output=True).returncode:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no agent in {h}")
                time.sleep(0.2)


def codec(reps, text):
    rows = {}
    for _ in range(reps):
        out = subprocess.run([BIN / "filter-speed", "--text", text, "--seconds", "0.5"],
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            r = json.loads(line)
            k = (r["filter"], r["data"])
            rows.setdefault(k, {"enc": [], "dec": [], "ratio": r["ratio"]})
            rows[k]["enc"].append(r["encode_gbs"])
            rows[k]["dec"].append(r["decode_gbs"])
    ref = {}
    for name, argv in (("lz4 -1 (64 KiB blocks)", ["lz4", "-b1", "-B4", text]),
                       ("zstd -1", ["zstd", "-b1", text]), ("zstd -3", ["zstd", "-b3", text])):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            found = re.findall(r"(\d+) -> +(\d+) \(x?([\d.]+)\), +([\d.]+) MB/s ?, *([\d.]+) MB/s",
                               r.stdout + r.stderr)
            _, _, ratio, comp, decomp = found[-1]
            ref[name] = f"{ratio}x smaller, {float(comp) / 1000:.2f} GB/s compressing, " \
                        f"{float(decomp) / 1000:.2f} GB/s decompressing"
        except (OSError, subprocess.SubprocessError, IndexError):
            ref[name] = "(not installed)"
    return rows, ref


def shaped_goodput(mode, port, mib, text):
    rcv = start(ns(H2, ["python3", "-c", RECEIVER, port]), env=layer_env(mode),
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert rcv.stdout.readline().strip() == "ready"
        snd = start(ns(H1, ["python3", "-c", SENDER, IP2, port, mib << 20, text]),
                    env=layer_env(mode), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        snd.wait(timeout=600)
        r = json.loads(rcv.stdout.readline())
        if r["bytes"] != mib << 20:
            raise RuntimeError(f"{mode}: received {r['bytes']} of {mib << 20} bytes")
        return r["bytes"] * 8 / r["seconds"] / 1e9
    finally:
        stop(rcv)


def iperf3(mode, port, seconds=4):
    srv = start(ns(H2, ["iperf3", "-s", "-1", "-p", port]), env=layer_env(mode),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        r = subprocess.run(ns(H1, ["iperf3", "-c", IP2, "-p", port, "-t", seconds, "--json"]),
                           env=layer_env(mode), capture_output=True, text=True, timeout=seconds + 40)
        j = json.loads(r.stdout)
        end = j["end"]
        bps = end["sum_received"]["bits_per_second"]
        moved = end["sum_received"]["bytes"]
        cpu = end["cpu_utilization_percent"]
        cpu_s = (cpu["host_total"] + cpu["remote_total"]) / 100 * seconds
        return bps / 1e9, cpu_s / (moved / (1 << 30))
    finally:
        stop(srv)


def sockperf(mode, port, size):
    srv = start(ns(H2, ["sockperf", "server", "--tcp", "-i", IP2, "-p", port]), env=layer_env(mode),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        r = subprocess.run(ns(H1, ["sockperf", "ping-pong", "--tcp", "-i", IP2, "-p", port, "-t", "3",
                                   "-m", size]), env=layer_env(mode), capture_output=True, text=True,
                           timeout=60)
        for line in r.stdout.splitlines():
            if "50.000 =" in line or "<MEDIAN>" in line.upper():
                return float(line.split("=")[-1].strip())
        for line in r.stdout.splitlines():
            if "avg-latency" in line:
                return float(line.split("avg-latency=")[1].split()[0])
        raise RuntimeError(f"sockperf {mode}: {r.stdout[-300:]} {r.stderr[-300:]}")
    finally:
        stop(srv)


def tap_on(mode, prog):
    """Puts tap `mode` on the connection of the program `prog` runs in H1 (the one that sent
    most); returns the capture's vmictl process, if any."""
    deadline = time.monotonic() + 5
    conns = []
    while not conns and time.monotonic() < deadline:
        conns = [c for c in json.loads(vmictl(H1, "status", "--json"))["connections"]
                 if c.get("bytes_sent", 0) > 0 and c.get("program", prog) == prog]
        time.sleep(0.05)
    if not conns:
        raise RuntimeError(f"no connection of {prog} in {H1}")
    gid = max(conns, key=lambda c: c.get("bytes_sent", 0))["gid"]
    if mode == "profile":
        for h in (H1, H2):
            vmictl(h, "device", "load", "profile", "--gid", gid)
    elif mode == "capture":
        return start(ns(H1, [BIN / "vmictl", "capture", gid, "-w", "/dev/null", "--duration", 10]),
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return None


def iperf3_tapped(mode, port, seconds=5):
    """iperf3 (one stream, random data) with tap `mode` put on 0.4 s after it starts; the
    first second is left out of its figures."""
    srv = start(ns(H2, ["iperf3", "-s", "-1", "-p", port]), env=layer_env("none"),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cap = None
    try:
        time.sleep(0.3)
        cli = start(ns(H1, ["iperf3", "-c", IP2, "-p", port, "-t", seconds, "-O", 1, "--json"]),
                    env=layer_env("none"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        time.sleep(0.4)
        if mode != "off":
            cap = tap_on(mode, "iperf3")
        out, _ = cli.communicate(timeout=seconds + 40)
        end = json.loads(out)["end"]
        bps = end["sum_received"]["bits_per_second"]
        moved = end["sum_received"]["bytes"]
        cpu = end["cpu_utilization_percent"]
        cpu_s = (cpu["host_total"] + cpu["remote_total"]) / 100 * (seconds + 1)
        return bps / 1e9, cpu_s / (moved / (1 << 30) * (seconds + 1) / seconds)
    finally:
        if cap:
            stop(cap)
        stop(srv)


def sockperf_tapped(mode, port, size=64):
    """sockperf ping-pong for 4 s, tap `mode` put on after 0.5 s: the median half round trip."""
    srv = start(ns(H2, ["sockperf", "server", "--tcp", "-i", IP2, "-p", port]), env=layer_env("none"),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cap = None
    try:
        time.sleep(0.5)
        cli = start(ns(H1, ["sockperf", "ping-pong", "--tcp", "-i", IP2, "-p", port, "-t", "4", "-m", size]),
                    env=layer_env("none"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        time.sleep(0.5)
        if mode != "off":
            cap = tap_on(mode, "sockperf")
        out, _ = cli.communicate(timeout=60)
        for line in out.splitlines():
            if "50.000 =" in line or "<MEDIAN>" in line.upper():
                return float(line.split("=")[-1].strip())
        raise RuntimeError(f"sockperf with {mode}: {out[-300:]}")
    finally:
        if cap:
            stop(cap)
        stop(srv)


def taps(reps, port):
    thr = {m: [] for m in TAP_MODES}
    cpu = {m: [] for m in TAP_MODES}
    lat = {m: [] for m in TAP_MODES}
    for rep in range(reps):
        for m in (TAP_MODES if rep % 2 == 0 else TAP_MODES[::-1]):
            port += 2
            log(f"rep {rep + 1}/{reps}: taps, {m}")
            g, c = iperf3_tapped(m, port)
            thr[m].append(g)
            cpu[m].append(c)
            lat[m].append(sockperf_tapped(m, port + 1))
    return thr, cpu, lat


def print_taps(thr, cpu, lat):
    print("\n### Taps on and off (loaded on the running programs' connection)\n")
    print("| tap | iperf3 Gbit/s | vs off | CPU s per GiB (both ends) | 64 B RTT/2 us | vs off |")
    print("|---|---|---|---|---|---|")
    for m in TAP_MODES:
        r = med(thr[m]) / med(thr["off"])
        q = med(lat[m]) / med(lat["off"])
        print(f"| {m} | {spread(thr[m])} | {r:.2f} | {spread(cpu[m])} | {spread(lat[m], 1)} | {q:.2f} |")


def switch_times(port, loads):
    """A full-speed iperf3 stream under the layer; `lz4` loaded and unloaded `loads` times."""
    srv = start(ns(H2, ["iperf3", "-s", "-1", "-p", port]), env=layer_env("none"),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cli = None
    took = []
    try:
        time.sleep(0.3)
        cli = start(ns(H1, ["iperf3", "-c", IP2, "-p", port, "-t", 5 + 2 * loads]), env=layer_env("none"),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)
        conns = json.loads(vmictl(H1, "status", "--json"))["connections"]
        gid = max(conns, key=lambda c: c.get("bytes_sent", 0))["gid"]
        for k in range(loads):
            op, want = ("load", "lz4") if k % 2 == 0 else ("unload", "")
            t0 = time.time() * 1000
            vmictl(H1, "device", op, "lz4", "--gid", gid)
            # (iperf3's data flows one way: the sender's switch is the one that counts; the
            # receiver's offer back goes only with bytes it sends, and it sends none.)
            done = None
            deadline = time.monotonic() + 5
            while done is None and time.monotonic() < deadline:
                snd = [c for c in json.loads(vmictl(H1, "status", "--json"))["connections"]
                       if c["gid"] == gid and (c.get("chain") or {}).get("send") == want]
                rcv = [c for c in json.loads(vmictl(H2, "status", "--json"))["connections"]
                       if c["gid"] == gid and (c.get("chain") or {}).get("recv") == want]
                if snd and rcv:
                    done = snd[0]["chain"]["send_since_ms"]
            if done is None:
                ends = [c for h in (H1, H2) for c in json.loads(vmictl(h, "status", "--json"))["connections"]
                        if c["gid"] == gid]
                raise RuntimeError(f"{op} lz4 on {gid}: no switch within 5 s; the ends: {ends}")
            took.append(done - t0)
            time.sleep(0.3)
        return took
    finally:
        if cli:
            stop(cli)
        stop(srv)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, default=256, help="MiB of text per shaped run")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", choices=["taps"], help="run only this part")
    a = ap.parse_args()
    for b in ("libvmi_preload.so", "vmi-agent", "vmictl", "filter-speed"):
        if not (BIN / b).exists():
            sys.exit(f"{BIN / b} missing: cargo build --release")
    tmp = Path(tempfile.mkdtemp(prefix="vmi-devices-"))
    text = tmp / "text.bin"
    with open(text, "wb") as f:
        for p in sorted(REPO.rglob("*")):
            if p.suffix in (".rs", ".md", ".py", ".c", ".sh") and "target" not in p.parts:
                f.write(p.read_bytes())
    res = {"date": time.strftime("%Y-%m-%d"), "text_bytes": text.stat().st_size}
    if a.only == "taps":
        with hosts(tmp):
            tt = taps(a.reps, 25000)
        print(f"## Taps on and off, {res['date']}")
        print_taps(*tt)
        if a.json:
            res.update({"taps_iperf3_gbps": tt[0], "taps_cpu_s_per_gib": tt[1], "taps_latency_us": tt[2]})
            a.json.write_text(json.dumps(res, indent=1))
        return
    log(f"codec speed ({text.stat().st_size} bytes of text)")
    rows, ref = codec(a.reps, text)
    with hosts(tmp):
        shaped = {m: [] for m in MODES}
        thr = {m: [] for m in MODES}
        cpu = {m: [] for m in MODES}
        lat = {(m, s): [] for m in MODES for s in (64, 16384)}
        port = 24000
        for rep in range(a.reps):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            subprocess.run(ns(H1, ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                                   "1gbit", "burst", "256kb", "latency", "50ms"]), check=True)
            for m in order:
                port += 1
                log(f"rep {rep + 1}/{a.reps}: 1 Gbit/s text, {m}")
                shaped[m].append(shaped_goodput(m, port, a.mib, text))
            subprocess.run(ns(H1, ["tc", "qdisc", "del", "dev", "eth0", "root"]), check=True)
            for m in order:
                port += 1
                log(f"rep {rep + 1}/{a.reps}: iperf3, {m}")
                g, c = iperf3(m, port)
                thr[m].append(g)
                cpu[m].append(c)
                for s in (64, 16384):
                    port += 1
                    lat[(m, s)].append(sockperf(m, port, s))
        log("device load/unload on a busy connection")
        took = switch_times(port + 1, 2 * a.reps)
        tt = taps(a.reps, port + 10)
    print(f"## Devices on and off, {res['date']}\n")
    print("### Per core, no network (16 KiB frames; GB/s of original bytes)\n")
    print("| filter | data | encode GB/s | decode GB/s | coded/original |")
    print("|---|---|---|---|---|")
    for (f, d), r in rows.items():
        print(f"| {f} | {d} | {spread(r['enc'])} | {spread(r['dec'])} | {r['ratio']:.3f} |")
    print("\nThis machine's reference tools on the same text (whole file; ratio, compress, "
          "decompress):\n")
    for k, v in ref.items():
        print(f"* `{k}`: {v}")
    print("\n### Text over a network shaped to 1 Gbit/s (goodput, Gbit/s)\n")
    print("| device | goodput | vs none |")
    print("|---|---|---|")
    for m in MODES:
        r = med(shaped[m]) / med(shaped["none"]) if shaped[m] and shaped["none"] else None
        print(f"| {m} | {spread(shaped[m])} | {r:.2f}x |" if r else f"| {m} | - | - |")
    print("\n### iperf3, random data, one stream (unshaped veth)\n")
    print("| device | Gbit/s | vs none | CPU s per GiB (both ends) | 64 B RTT/2 us | 16 KiB RTT/2 us |")
    print("|---|---|---|---|---|---|")
    for m in MODES:
        r = med(thr[m]) / med(thr["none"])
        print(f"| {m} | {spread(thr[m])} | {r:.2f} | {spread(cpu[m])} | "
              f"{spread(lat[(m, 64)], 1)} | {spread(lat[(m, 16384)], 1)} |")
    print(f"\n### `vmictl device load|unload lz4` on a busy connection (iperf3 at full speed)\n")
    print(f"From the command to the sender switching: {spread(took, 0)} ms over {len(took)} "
          f"switches (the vmictl process start and the agent's round trip included).")
    print_taps(*tt)
    if a.json:
        res.update({"codec": {f"{f}/{d}": r for (f, d), r in rows.items()}, "reference": ref,
                    "shaped_gbps": shaped, "iperf3_gbps": thr, "cpu_s_per_gib": cpu,
                    "latency_us": {f"{m}/{s}": v for (m, s), v in lat.items()},
                    "switch_ms": took, "taps_iperf3_gbps": tt[0], "taps_cpu_s_per_gib": tt[1],
                    "taps_latency_us": tt[2]})
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
