#!/usr/bin/env python3
"""The cluster directory in etcd with many agents: each agent's memory and CPU against the
number of nodes (flat: an agent watches only the nodes it has connections with), how fast a
new node can be found and a dead one leaves, lookups per second; and the connection set-up
rate with the directory against without it.

    sudo flock /tmp/vmi-bench.lock python3 benchmarks/harness/directory_scale.py \\
        [--parts scale,connrate] [--nodes 50,100,250,500] [--ttl 10] [--sample 16] [--settle 5]
        [--window 10] [--connrate-reps 5] [--connrate-count 20000] [--connrate-secs 3] [--out DIR]

Part `scale`. One network namespace (vmies0): three etcd members (Debian's etcd-server) on
127.0.0.1, their data in /dev/shm (the figures are the agents', not the disk's), and as many
vmi-agent processes as --nodes asks, each with a node name of its own (n0, n1, ...), its own
abstract socket and port, `--directory` naming the three members, `--directory-ttl` --ttl,
and no programs (probing once a second: an agent without peers sends no heartbeats). The
count grows step by step; at each step, once every agent is registered and --settle seconds
passed:

* memory: VmRSS of every agent (mean, max) and of the etcd members;
* CPU: utime + stime of every agent over --window seconds, per agent (percent of one core);
* join: one more agent starts; the time from its start (the process started) until a read of
  the directory finds its node record (what another agent's lookup reads; polled every 2 ms
  through etcd's JSON gateway);
* leave: that agent is killed (SIGKILL); the time until its node record is gone from etcd
  (its lease of --ttl seconds ends); then the journals of --sample agents, none of which has
  a connection with it, are read: with scoped watches none of them has a `node` event of it
  (`heard_by` 0/N), and their `node_watches` are summed (0: they watch no node);
* lookups: `Locate` (what `vmictl where` sends) on one connection to each of 4 agents at
  once, for 3 s: lookups per second in all, and each one's latency (median, 99th percentile).

Part `connrate`. Namespaces vmies1 (client), vmies2 (server), vmies3 (one etcd member) on a
bridge in vmies-sw (10.246.0.0/24). `connrate` (benchmarks/programs/connrate.c) connects,
reads the server's close and closes, one connection after the other, for --connrate-secs:
natively, under the layer with agents without a directory, and under the layer with agents
keeping the directory in etcd; --connrate-reps repetitions, the order of the three turning
each repetition (the agents restart when the mode needs other agents). Under the layer, the
keeper connection connrate holds is checked to be virtual (`vmictl status`); with etcd, the
time until etcd holds no connection record again after the loop (the directory's writes
drain behind the programs) and the agents' RSS.

Prints Markdown tables; writes directory_scale.md, .json and (with matplotlib) .png into
--out (default benchmarks/results/<date>-<time>-directory-scale/). Everything started is
stopped, and the namespaces and data removed, at the end, on failure and on Ctrl-C.
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


def start(argv, log, kind, netns=True):
    pre = ["nsenter", f"--net=/run/netns/{NS}"] if netns else []
    with open(log, "w") as out:
        p = subprocess.Popen([*pre, *map(str, argv)], stdin=subprocess.DEVNULL,
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
    cr_delete()
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


def in_netns_thread(fn):
    """fn() run on a thread that entered the namespace; its result."""
    out = {}

    def run():
        fd = os.open(f"/run/netns/{NS}", os.O_RDONLY)
        if LIBC.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
        os.close(fd)
        try:
            out["r"] = fn()
        except Exception as e:
            out["e"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "e" in out:
        raise out["e"]
    return out.get("r")


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

    def node_events(self, i, node):
        out = self.ctl(i, "events", "--json")
        return [e for e in map(json.loads, filter(None, out.splitlines()))
                if e.get("kind") == "node" and e.get("node") == node]

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

    def keys_present(self, keys):
        """How many of `keys` etcd holds now (one range read each, through etcd's JSON gateway,
        from a thread inside the namespace)."""
        import base64
        import urllib.request
        n = 0
        for k in keys:
            body = json.dumps({"key": base64.b64encode(k.encode()).decode()}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{MEMBERS[0][1]}/v3/kv/range", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=2) as r:
                n += int(json.loads(r.read()).get("count", 0)) > 0
        return n

    def poll_keys(self, keys, want, timeout, every=0.002):
        """Seconds until `want` of `keys` are present (len(keys)) or gone (0); None at timeout."""
        t0 = time.monotonic()

        def run():
            while time.monotonic() - t0 < timeout:
                if self.keys_present(keys) == want:
                    return time.monotonic()
                time.sleep(every)
            return None
        t = in_netns_thread(run)
        return t

    def join_and_leave(self, n):
        """One more agent: the time until a read of the directory finds it (its node record, as
        another agent's lookup reads it), then killed: the time until
        its entries are gone from etcd (its lease ends). The sampled agents have no connection
        with it: with scoped watches none of them hears of it (their journals are read to
        check) and none watches it."""
        name, port = f"join{n}", BASE_PORT - 1000 + n % 1000
        # (Its node record: agents on loopback alone advertise no agent address, so there is
        # no agent/ADDR entry here.)
        keys = [f"{self.pfx}node/{name}"]
        # A node name, socket and port no other agent of the run has.
        # (Below the ephemeral range: the agents' own connections to etcd take ports there.)
        argv = self.agent_argv(name, f"vmies-join{n}", port)
        t_start = time.monotonic()
        p = start(argv, self.tmp / f"join-{n}.log", "agent")
        found = self.poll_keys(keys, len(keys), 20)
        if found is None:
            raise SystemExit(f"the joining agent is not in etcd: {(self.tmp / f'join-{n}.log').read_text()[-2000:]}")
        sample = [a for a, _ in self.agents[:: max(1, len(self.agents) // self.args.sample)]][: self.args.sample]
        time.sleep(1)
        t_kill = time.monotonic()
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=5)
        gone = self.poll_keys(keys, 0, self.args.ttl + 20, every=0.02)
        time.sleep(1)
        heard = sum(1 for i in sample if self.node_events(i, name))
        watches = [json.loads(self.ctl(i, "status", "--json"))["directory"]["node_watches"] for i in sample]
        return {
            "findable_ms": round((found - t_start) * 1000, 1),
            "gone_s": round(gone - t_kill, 2) if gone else None,
            "heard_by": f"{heard}/{len(sample)}",
            "sample_node_watches": sum(watches),
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


# ------------------------------------------------------------------ connection set-up rate
CR_NET = "10.246.0"
CR_SW = "vmies-sw"
CR_HOSTS = {"vmies1": 1, "vmies2": 2, "vmies3": 3}      # client, server, etcd
CR_MODES = ["native", "layer", "layer+etcd"]


def cr_ns(host):
    return ["nsenter", f"--net=/run/netns/{host}"]


def cr_delete():
    for h in [*CR_HOSTS, CR_SW]:
        subprocess.run(["ip", "netns", "del", h], capture_output=True)
    shutil.rmtree("/dev/shm/vmies-etcd-cr", ignore_errors=True)


def cr_setup():
    cr_delete()
    for h in [CR_SW, *CR_HOSTS]:
        sh("ip", "netns", "add", h)
        sh("ip", "-n", h, "link", "set", "lo", "up")
    sh("ip", "-n", CR_SW, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", CR_SW, "link", "set", "br0", "up")
    for h, i in CR_HOSTS.items():
        sh("ip", "link", "add", f"es{i}", "netns", CR_SW, "type", "veth", "peer", "name", "eth0", "netns", h)
        sh("ip", "-n", CR_SW, "link", "set", f"es{i}", "master", "br0", "up")
        sh("ip", "-n", h, "addr", "add", f"{CR_NET}.{i}/24", "dev", "eth0")
        sh("ip", "-n", h, "link", "set", "eth0", "up")


class ConnRate:
    """`connrate` (benchmarks/programs/connrate.c: connect, read the server's close, close, one
    after the other) from vmies1 to vmies2 over a bridge: natively, under the layer with agents
    without a directory, and under the layer with agents keeping the directory in etcd (one
    member on vmies3), in an order that turns each repetition."""

    def __init__(self, args, tmp, bin_dir):
        self.args = args
        self.tmp = tmp
        self.agent_bin = bin_dir / "vmi-agent"
        self.vmictl = bin_dir / "vmictl"
        self.lib = bin_dir / "libvmi_preload.so"
        self.key = tmp / "cr.key"
        self.prog = tmp / "connrate"
        self.agents = {}
        self.agent_mode = None
        self.port = 9400
        self.n = 0

    def setup(self):
        cr_setup()
        sh("gcc", "-O2", "-Wall", "-o", self.prog, REPO / "benchmarks" / "programs" / "connrate.c", timeout=120)
        sh(self.agent_bin, "--init", "--key", self.key)
        ip = f"{CR_NET}.3"
        start(cr_ns("vmies3") + ["etcd", "--name", "cr", "--data-dir", "/dev/shm/vmies-etcd-cr",
                                 "--listen-client-urls", f"http://{ip}:2379", "--advertise-client-urls",
                                 f"http://{ip}:2379", "--listen-peer-urls", f"http://{ip}:2380",
                                 "--initial-advertise-peer-urls", f"http://{ip}:2380", "--initial-cluster",
                                 f"cr=http://{ip}:2380", "--log-level", "warn"], self.tmp / "etcd-cr.log", "etcd",
              netns=False)
        deadline = time.monotonic() + 30
        while sh(*cr_ns("vmies1"), "etcdctl", "--endpoints", f"{ip}:2379", "endpoint", "health", check=False,
                 env=dict(os.environ, ETCDCTL_API="3")).returncode != 0:
            if time.monotonic() > deadline:
                raise SystemExit("etcd (connection rate) did not become healthy within 30 s")
            time.sleep(0.3)

    def status(self, host):
        r = sh(*cr_ns(host), self.vmictl, "status", "--json", check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def agents_for(self, mode):
        want = "etcd" if mode == "layer+etcd" else "plain"
        if mode == "native" or want == self.agent_mode:
            return
        for p in self.agents.values():
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        self.agents = {}
        for h in ("vmies1", "vmies2"):
            self.n += 1
            argv = [self.agent_bin, "--config", "/dev/null", "--key", self.key, "--node", h, "--log", "warn"]
            if want == "etcd":
                argv += ["--directory", f"etcd://{CR_NET}.3:2379", "--directory-ttl", self.args.ttl]
            self.agents[h] = start(cr_ns(h) + argv, self.tmp / f"cr-agent-{h}-{self.n}.log", "agent", netns=False)
        for h in self.agents:
            deadline = time.monotonic() + 15
            while True:
                st = self.status(h)
                if st and (want == "plain" or (st.get("directory") or {}).get("connected")):
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"the agent of {h} is not ready: "
                                     f"{(self.tmp / f'cr-agent-{h}-{self.n}.log').read_text()[-2000:]}")
                time.sleep(0.1)
        self.agent_mode = want

    def one(self, mode):
        self.agents_for(mode)
        self.port += 2
        layer = [] if mode == "native" else ["env", f"LD_PRELOAD={self.lib}", "VMI_LOG=warn"]
        srv = start(cr_ns("vmies2") + layer + [self.prog, "server", f"{CR_NET}.2", self.port],
                    self.tmp / f"cr-server-{self.port}.log", "program", netns=False)
        try:
            deadline = time.monotonic() + 10
            while not sh(*cr_ns("vmies2"), "ss", "-tlnH", f"sport = :{self.port}", check=False).stdout.strip():
                if time.monotonic() > deadline:
                    raise SystemExit(f"connrate server on port {self.port} did not listen")
                time.sleep(0.05)
            seen = {}

            def watch():
                # The keeper connection, held for the whole run, is virtual under the layer.
                time.sleep(0.5)
                st = self.status("vmies1")
                seen["virtual"] = bool(st and st["connections"])
                seen["directory"] = bool(st and (st.get("directory") or {}).get("connected"))
            t = threading.Thread(target=watch)
            if mode != "native":
                t.start()
            r = sh(*cr_ns("vmies1"), *layer, self.prog, "client", f"{CR_NET}.2", self.port, self.args.connrate_count,
                   self.args.connrate_secs, timeout=self.args.connrate_secs + 60, check=False)
            if mode != "native":
                t.join()
            res = json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])
            res.update(mode=mode, **seen)
            if mode != "native" and not seen.get("virtual"):
                raise SystemExit(f"{mode}: the keeper connection is not virtual (is the layer loaded?)")
            if mode == "layer+etcd" and not seen.get("directory"):
                raise SystemExit("layer+etcd: the agent is not connected to etcd")
            if mode == "layer+etcd":
                # The directory's writes go on behind the programs (each connection's ends
                # written, then deleted): the time until etcd holds none of them again, and
                # the agents' memory meanwhile.
                res["agent_rss_mib_max"] = round(max(rss_kib(p.pid) for p in self.agents.values()) / 1024, 1)
                res["drain_s"] = self.drain(time.monotonic())
            return res
        finally:
            os.killpg(srv.pid, signal.SIGKILL)
            srv.wait(timeout=5)

    def gid_records(self):
        r = sh(*cr_ns("vmies1"), "etcdctl", "--endpoints", f"{CR_NET}.3:2379", "get", "--prefix", "/vmi/",
               "--keys-only", env=dict(os.environ, ETCDCTL_API="3"), check=False, timeout=30)
        return sum("/gid/" in x for x in r.stdout.splitlines())

    def drain(self, t0, timeout=120):
        while time.monotonic() - t0 < timeout:
            if self.gid_records() == 0:
                return round(time.monotonic() - t0, 2)
            time.sleep(0.2)
        return None

    def run(self):
        runs = []
        for rep in range(self.args.connrate_reps):
            k = rep % len(CR_MODES)
            for mode in CR_MODES[k:] + CR_MODES[:k]:
                r = self.one(mode)
                r["rep"] = rep
                runs.append(r)
                print(json.dumps(r), flush=True)
        rows = []
        nat = statistics.median(r["conns_per_sec"] for r in runs if r["mode"] == "native")
        for mode in CR_MODES:
            v = [r["conns_per_sec"] for r in runs if r["mode"] == mode]
            errs = sum(r["errors"] for r in runs if r["mode"] == mode)
            m = statistics.median(v)
            row = {"mode": mode, "reps": len(v), "conns_per_sec_median": round(m),
                   "min": round(min(v)), "max": round(max(v)), "of_native": round(m / nat, 3), "errors": errs}
            d = [r["drain_s"] for r in runs if r["mode"] == mode and "drain_s" in r]
            if d:
                row["directory_drained_s"] = f"{statistics.median([x if x is not None else 999 for x in d])} " \
                    f"({min(x or 999 for x in d)}-{max(x or 999 for x in d)})"
                row["agent_rss_mib_max"] = max(r["agent_rss_mib_max"] for r in runs if r["mode"] == mode)
            rows.append(row)
        return runs, rows


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
    ax[1][0].plot(n, [r["findable_ms"] for r in rows], "o-", label="new node findable, ms from its start")
    ax[1][0].plot(n, [r["gone_s"] * 1000 for r in rows], "s-", label="dead node gone from etcd, ms after SIGKILL")
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


def table(rows, cols):
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        md.append("| " + " | ".join(str(r.get(c)) for c in cols) + " |")
    return "\n".join(md)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="scale,connrate", help="scale, connrate or both")
    ap.add_argument("--nodes", default="50,100,250,500")
    ap.add_argument("--ttl", type=int, default=10)
    ap.add_argument("--sample", type=int, default=16)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--connrate-reps", type=int, default=5)
    ap.add_argument("--connrate-count", type=int, default=20000)
    ap.add_argument("--connrate-secs", type=float, default=3.0)
    ap.add_argument("--bin-dir", type=Path, default=REPO / "target" / "release")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if os.geteuid() != 0:
        raise SystemExit("needs root (a network namespace)")
    for tool in ("etcd", "etcdctl", "gcc"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is missing: run scripts/setup.sh")
    steps = sorted(int(x) for x in args.nodes.split(","))
    out = args.out or REPO / "benchmarks" / "results" / (_dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-directory-scale")
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="vmies-"))
    atexit.register(cleanup, tmp)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rows, cr_runs, cr_rows = [], [], []
    try:
        if "scale" in parts:
            b = Bench(args, tmp, args.bin_dir)
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
            cleanup()
        if "connrate" in parts:
            c = ConnRate(args, tmp, args.bin_dir)
            c.setup()
            cr_runs, cr_rows = c.run()
    finally:
        cleanup(tmp)
    text = ""
    if rows:
        text += table(rows, ["nodes", "agent_rss_mib_mean", "agent_rss_mib_max", "agent_cpu_pct_mean",
                             "agents_cpu_pct_total", "etcd_rss_mib_total", "etcd_cpu_pct_total", "findable_ms", "gone_s",
                             "heard_by", "sample_node_watches", "lookups_per_s", "lookup_us_median",
                             "lookup_us_p99"]) + "\n\n"
        if plot(rows, out / "directory_scale.png"):
            print(f"plot: {out / 'directory_scale.png'}")
    if cr_rows:
        text += table(cr_rows, ["mode", "reps", "conns_per_sec_median", "min", "max", "of_native", "errors",
                                "directory_drained_s", "agent_rss_mib_max"]) + "\n"
    print(text)
    (out / "directory_scale.md").write_text(f"directory_scale.py {' '.join(sys.argv[1:])}\n\n{text}")
    (out / "directory_scale.json").write_text(json.dumps({"args": vars(args) | {"bin_dir": str(args.bin_dir), "out": str(out)},
                                                          "rows": rows, "connrate_runs": cr_runs,
                                                          "connrate": cr_rows}, indent=1))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
