#!/usr/bin/env python3
"""The cluster directory in etcd with many agents: how fast a node is known cluster-wide, how
fast a dead node is noticed, lookups per second, and each agent's memory and CPU against the
number of nodes.

    sudo flock /tmp/vmi-bench.lock python3 benchmarks/harness/directory_scale.py \\
        [--nodes 50,100,250,500] [--ttl 10] [--sample 16] [--settle 5] [--window 10] [--out DIR]

One network namespace (vmies0): three etcd members (Debian's etcd-server) on 127.0.0.1,
their data in /dev/shm (the figures are the agents', not the disk's), and as many vmi-agent
processes as --nodes asks, each with a node name of its own (n0, n1, ...), its own abstract
socket and port, `--directory` naming the three members, `--directory-ttl` --ttl, and no
programs (probing once a second: an agent without peers sends no heartbeats). The count
grows step by step; at each step, once every agent is registered and --settle seconds passed:

* memory: VmRSS of every agent (mean, max) and of the etcd members;
* CPU: utime + stime of every agent over --window seconds, per agent (percent of one core);
* join: one more agent starts; the time from its registration (its `registered_ms`) to the
  `joined` event in the journals of --sample agents (the largest; the median too; a few ms
  below zero when the others hear of it before the agent itself notes it is registered),
  and from its start (the process started) to the last of those events;
* leave: that agent is killed (SIGKILL); the time to the `left` event in the same journals
  (a lease of --ttl seconds ends first);
* lookups: `Locate` (what `vmictl where` sends) on one connection to each of 4 agents at
  once, for 3 s: lookups per second in all, and each one's latency (median, 99th percentile).

Prints a Markdown table; writes directory_scale.md, .json and (with matplotlib) .png into
--out (default benchmarks/results/<date>-<time>-directory-scale/). Everything started is
stopped, and the namespace and data removed, at the end, on failure and on Ctrl-C.
"""

import argparse
import atexit
import ctypes
import datetime as _dt
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NS = "vmies0"
MEMBERS = [("e1", 23791, 23801), ("e2", 23792, 23802), ("e3", 23793, 23803)]
ENDPOINTS = ",".join(f"127.0.0.1:{c}" for _, c, _ in MEMBERS)
BASE_PORT = 30000
TICKS = os.sysconf("SC_CLK_TCK")
LIBC = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000

procs = []          # every process started: (Popen, kind)


def sh(*argv, check=True, timeout=30, **kw):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=check, timeout=timeout, **kw)


def in_ns(*argv, **kw):
    return sh("nsenter", f"--net=/run/netns/{NS}", *argv, **kw)


def start(argv, log, kind):
    with open(log, "w") as out:
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{NS}", *map(str, argv)], stdin=subprocess.DEVNULL,
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    procs.append((p, kind))
    return p


def cleanup(tmp=None):
    for p, _ in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p, _ in procs:
        try:
            p.wait(timeout=5)
        except Exception:
            pass
    procs.clear()
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    for d in Path("/dev/shm").glob("vmies-etcd-*"):
        shutil.rmtree(d, ignore_errors=True)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


def rss_kib(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_ticks(pid):
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])
    except (OSError, IndexError):
        return 0


def real_pid(p):
    """The agent under nsenter (nsenter execs it: the same pid)."""
    return p.pid


class Bench:
    def __init__(self, args, tmp, bin_dir):
        self.args = args
        self.tmp = tmp
        self.agent_bin = bin_dir / "vmi-agent"
        self.vmictl = bin_dir / "vmictl"
        self.key = tmp / "cluster.key"
        self.agents = []           # (index, Popen)
        self.etcd = []

    def setup(self):
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
        sh("ip", "netns", "add", NS)
        sh("ip", "-n", NS, "link", "set", "lo", "up")
        sh(self.agent_bin, "--init", "--key", self.key)
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, _, p in MEMBERS)
        for name, client, peer in MEMBERS:
            data = Path(f"/dev/shm/vmies-etcd-{name}")
            shutil.rmtree(data, ignore_errors=True)
            self.etcd.append(start(["etcd", "--name", name, "--data-dir", data,
                                    "--listen-client-urls", f"http://127.0.0.1:{client}",
                                    "--advertise-client-urls", f"http://127.0.0.1:{client}",
                                    "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                                    "--initial-cluster", cluster, "--initial-cluster-state", "new",
                                    "--initial-cluster-token", "vmies", "--log-level", "warn"],
                                   self.tmp / f"etcd-{name}.log", "etcd"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if in_ns("etcdctl", "--endpoints", ENDPOINTS, "endpoint", "health", check=False,
                     env=dict(os.environ, ETCDCTL_API="3")).returncode == 0:
                return
            time.sleep(0.3)
        raise SystemExit("etcd did not become healthy within 30 s")

    def prefix(self):
        return json.loads(self.ctl(0, "status", "--json"))["directory"]["prefix"]

    def agent_argv(self, name, sock, port):
        return [self.agent_bin, "--config", "/dev/null", "--key", self.key, "--node", name,
                "--socket", sock, "--port", port, "--bind", "127.0.0.1",
                "--probe-interval", 1000, "--dead-after", 3000, "--sweep-every", 3_600_000,
                "--directory", f"etcd://{ENDPOINTS}", "--directory-ttl", self.args.ttl, "--log", "warn"]

    def start_agent(self, i):
        return start(self.agent_argv(f"n{i}", f"vmies-{i}", BASE_PORT + i), self.tmp / f"agent-{i}.log", "agent")

    def ctl(self, i, *args):
        r = in_ns(self.vmictl, "--socket", f"vmies-{i}", *args, check=False, timeout=20)
        if r.returncode != 0:
            raise RuntimeError(f"vmictl {args} on agent {i}: {r.stderr}")
        return r.stdout

    def registered(self):
        r = in_ns("etcdctl", "--endpoints", ENDPOINTS, "get", "--prefix", f"{self.pfx}node/", "--keys-only", "--limit", "1",
                  "-w", "json", env=dict(os.environ, ETCDCTL_API="3"), check=False)
        try:
            return json.loads(r.stdout).get("count", 0)
        except ValueError:
            return 0

    def grow(self, n):
        while len(self.agents) < n:
            i = len(self.agents)
            self.agents.append((i, self.start_agent(i)))
            if i == 0:
                time.sleep(1)
                self.pfx = self.prefix()
            elif i % 25 == 0:
                time.sleep(0.2)
        deadline = time.monotonic() + 120
        while self.registered() < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {self.registered()} of {n} agents registered within 120 s")
            dead = [i for i, p in self.agents if p.poll() is not None]
            if dead:
                raise SystemExit(f"agents {dead[:5]} exited: {(self.tmp / f'agent-{dead[0]}.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def events_ms(self, i, node, change):
        out = self.ctl(i, "events", "--json")
        ms = [e["ms"] for e in map(json.loads, filter(None, out.splitlines()))
              if e.get("kind") == "node" and e.get("node") == node and e.get("change") == change]
        return ms[-1] if ms else None

    def wait_events(self, sample, node, change, timeout):
        got = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(sample) and time.monotonic() < deadline:
            for i in sample:
                if i not in got:
                    m = self.events_ms(i, node, change)
                    if m is not None:
                        got[i] = m
            time.sleep(0.1)
        return got

    def join_and_leave(self, n):
        # A node name, socket and port no other agent of the run has.
        # (Below the ephemeral range: the agents' own connections to etcd take ports there.)
        argv = self.agent_argv(f"join{n}", f"vmies-join{n}", BASE_PORT - 1000 + n % 1000)
        started_ms = time.time() * 1000
        p = start(argv, self.tmp / f"join-{n}.log", "agent")
        deadline = time.monotonic() + 20
        reg = None
        while time.monotonic() < deadline and reg is None:
            try:
                d = json.loads(in_ns(self.vmictl, "--socket", f"vmies-join{n}", "status", "--json",
                                     check=False).stdout or "{}").get("directory") or {}
                reg = d.get("registered_ms")
            except ValueError:
                pass
            time.sleep(0.05)
        if reg is None:
            raise SystemExit(f"the joining agent did not register: {(self.tmp / f'join-{n}.log').read_text()[-2000:]}")
        sample = [a for a, _ in self.agents[:: max(1, len(self.agents) // self.args.sample)]][: self.args.sample]
        joined = self.wait_events(sample, f"join{n}", "joined", 20)
        time.sleep(1)
        killed_ms = int(time.time() * 1000)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=5)
        left = self.wait_events(sample, f"join{n}", "left", self.args.ttl + 20)
        jl = sorted(m - reg for m in joined.values())
        js = sorted(m - started_ms for m in joined.values())
        ll = sorted(m - killed_ms for m in left.values())
        return {
            "join_ms_max": jl[-1] if jl else None, "join_ms_median": statistics.median(jl) if jl else None,
            "join_heard_by": f"{len(joined)}/{len(sample)}",
            "join_from_start_ms_max": round(js[-1]) if js else None,
            "registered_after_start_ms": round(reg - started_ms),
            "leave_ms_max": ll[-1] if ll else None, "leave_ms_median": statistics.median(ll) if ll else None,
            "leave_heard_by": f"{len(left)}/{len(sample)}",
        }

    def lookups(self, seconds=3.0, clients=4):
        gid = 0x1234_5678_9abc_def0_1234_5678_9abc_def0
        body = bytes([90]) + gid.to_bytes(16, "little")
        frame = struct.pack("<I", len(body)) + body
        lat = []
        counts = []
        errors = []
        lock = threading.Lock()
        agents = [a for a, _ in self.agents[:: max(1, len(self.agents) // clients)]][:clients]

        def run(i):
            # The agent's abstract socket lives in the namespace: connect from a thread that
            # entered it.
            fd = os.open(f"/run/netns/{NS}", os.O_RDONLY)
            if LIBC.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
            os.close(fd)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(f"\0vmies-{i}")
            f = s.makefile("rb")
            mine, n = [], 0
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t = time.perf_counter()
                s.sendall(frame)
                hdr = f.read(4)
                reply = f.read(struct.unpack("<I", hdr)[0])
                mine.append(time.perf_counter() - t)
                if reply[0] != 11:
                    with lock:
                        errors.append(reply[5:].decode(errors="replace"))
                    break
                n += 1
            s.close()
            with lock:
                lat.extend(mine)
                counts.append(n)
        ts = [threading.Thread(target=run, args=(i,)) for i in agents]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        lat.sort()
        return {
            "lookups_per_s": round(sum(counts) / seconds),
            "lookup_us_median": round(lat[len(lat) // 2] * 1e6) if lat else None,
            "lookup_us_p99": round(lat[int(len(lat) * 0.99)] * 1e6) if lat else None,
            "lookup_errors": errors[:3],
        }

    def usage(self):
        pids = [real_pid(p) for _, p in self.agents]
        etcd = [real_pid(p) for p in self.etcd]
        c0 = {p: cpu_ticks(p) for p in pids + etcd}
        time.sleep(self.args.window)
        c1 = {p: cpu_ticks(p) for p in pids + etcd}
        rss = [rss_kib(p) for p in pids]
        pct = [100.0 * (c1[p] - c0[p]) / TICKS / self.args.window for p in pids]
        return {
            "agent_rss_mib_mean": round(statistics.mean(rss) / 1024, 2),
            "agent_rss_mib_max": round(max(rss) / 1024, 2),
            "agent_cpu_pct_mean": round(statistics.mean(pct), 3),
            "agent_cpu_pct_max": round(max(pct), 2),
            "agents_cpu_pct_total": round(sum(pct), 1),
            "etcd_rss_mib_total": round(sum(rss_kib(p) for p in etcd) / 1024, 1),
            "etcd_cpu_pct_total": round(sum(100.0 * (c1[p] - c0[p]) / TICKS / self.args.window for p in etcd), 1),
        }


def plot(rows, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    n = [r["nodes"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    ax[0][0].plot(n, [r["agent_rss_mib_mean"] for r in rows], "o-", label="mean")
    ax[0][0].plot(n, [r["agent_rss_mib_max"] for r in rows], "s--", label="max")
    ax[0][0].set_title("agent RSS (MiB)")
    ax[0][0].set_ylim(bottom=0)
    ax[0][0].legend()
    ax[0][1].plot(n, [r["agent_cpu_pct_mean"] for r in rows], "o-", label="mean")
    ax[0][1].set_title("agent CPU (% of one core), idle")
    ax[0][1].set_ylim(bottom=0)
    ax[1][0].plot(n, [r["join_from_start_ms_max"] for r in rows], "o-", label="join known, from start (max of sample)")
    ax[1][0].plot(n, [r["leave_ms_max"] for r in rows], "s-", label="death noticed (max of sample)")
    ax[1][0].set_title("ms")
    ax[1][0].set_ylim(bottom=0)
    ax[1][0].legend()
    ax[1][1].plot(n, [r["lookups_per_s"] for r in rows], "o-")
    ax[1][1].set_title("GID lookups per second (4 clients)")
    ax[1][1].set_ylim(bottom=0)
    for a in ax.flat:
        a.set_xlabel("nodes")
        a.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="50,100,250,500")
    ap.add_argument("--ttl", type=int, default=10)
    ap.add_argument("--sample", type=int, default=16)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--bin-dir", type=Path, default=REPO / "target" / "release")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (a network namespace)")
    for tool in ("etcd", "etcdctl"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is missing: run scripts/setup.sh")
    steps = sorted(int(x) for x in args.nodes.split(","))
    out = args.out or REPO / "benchmarks" / "results" / (_dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-directory-scale")
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="vmies-"))
    atexit.register(cleanup, tmp)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    b = Bench(args, tmp, args.bin_dir)
    rows = []
    try:
        b.setup()
        for n in steps:
            t0 = time.monotonic()
            b.grow(n)
            grown = time.monotonic() - t0
            time.sleep(args.settle)
            row = {"nodes": n, "grow_s": round(grown, 1)}
            row.update(b.usage())
            row.update(b.join_and_leave(n))
            row.update(b.lookups())
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        cleanup(tmp)
    cols = ["nodes", "agent_rss_mib_mean", "agent_rss_mib_max", "agent_cpu_pct_mean", "agents_cpu_pct_total",
            "etcd_rss_mib_total", "etcd_cpu_pct_total", "registered_after_start_ms", "join_ms_median", "join_ms_max",
            "join_from_start_ms_max", "leave_ms_median",
            "leave_ms_max", "lookups_per_s", "lookup_us_median", "lookup_us_p99"]
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        md.append("| " + " | ".join(str(r.get(c)) for c in cols) + " |")
    text = "\n".join(md)
    print(text)
    (out / "directory_scale.md").write_text(
        f"directory_scale.py --nodes {args.nodes} --ttl {args.ttl} --sample {args.sample}\n\n{text}\n")
    (out / "directory_scale.json").write_text(json.dumps({"args": vars(args) | {"bin_dir": str(args.bin_dir), "out": str(out)},
                                                          "rows": rows}, indent=1))
    if plot(rows, out / "directory_scale.png"):
        print(f"plot: {out / 'directory_scale.png'}")
    print(f"results in {out}")


if __name__ == "__main__":
    main()
