#!/usr/bin/env python3
"""Many connections on one node: the agent's and the programs' memory and CPU with N virtual
connections open, idle and then active at a low rate, side by side with the same connections
held natively.

    sudo flock /tmp/vmi-bench.lock python3 benchmarks/harness/scale.py \\
        [--conns 1000,10000] [--procs 4] [--reps 2] [--idle 10] [--active 10] [--bin-dir DIR]
        [--failover 30] [--failover-after 3] [--failover-wait 120]

Two namespace hosts (scripts/topo.sh, prefix vmisc, networks 10.97.0/24 and 10.97.1/24), a
vmi-agent in each, started afresh before every run (native runs too, so that both see the same
background). For each N, repetition and mode (native and layer alternating which goes first):

* server: `programs/scale_conns.c server` in vmisc2, accepts and holds every connection;
* clients: --procs `scale_conns client` processes in vmisc1, N/procs connections each (each
  carries its 8-byte id when opened), all opening at once; above --per-server connections one
  server per client, each on its own port (the descriptor limit here is 20,000 and cannot be
  raised); the client host's ephemeral port range is --port-range (default 1024-65000; the
  kernel's default range holds 28,232 ports, for each destination since the layer no longer
  binds before connect, but a rebuilt link is bound to its address before it dials the peer
  node's agent, so after a failover each moved connection holds a port of its own);
* phases, each read from /proc (VmRSS of /proc/PID/status, Pss of smaps_rollup, utime+stime
  of /proc/PID/stat, voluntary + involuntary context switches of every thread):
  before (after each client's warm-up connection), after set-up (1 s after the last client
  reported), idle (--idle seconds with nothing sent), active (--active seconds in which every
  connection sends 64 B once a second, spread evenly), and `vmictl status --json` timed in both
  hosts (--status-reps times each, after the idle phase);
* failover (layered runs only: natively a TCP connection cannot move to another network, it
  stalls until its own comes back or it times out; there is nothing to compare): the connections send 64 B a second again for --failover
  seconds; --failover-after seconds in, the client host's eth0 goes down (`ip -n vmisc1 link
  set dev eth0 down`, the loud failure of tests/test_failover.py) and stays down until the
  run ends. Measured: the first and the last connection moved, from the `failover` events
  (one per rebuilt link, stamped by the agent, with the stall the process saw) that
  `vmictl events --follow --json` shows in both hosts, and the time until `vmictl status
  --json` in the client host shows every connection of the clients on 10.97.1/24 with its link
  up (polled; then the server host must show the same); the agents' CPU over the phase;
* bytes: at the end every client prints the bytes it sent, in all and per connection, and
  each server those it received on the connections that closed; once the servers have seen
  every connection close, both must match on every connection (natively too);
* checks: every connection is virtual in the layered run (vmictl status: the clients' pids
  hold N + procs connections in vmisc1, the server's N + procs in vmisc2), none in the native
  run; the server host has N + procs established TCP connections on the port (`ss`).

Figures: agent RSS and CPU in each phase and both hosts; memory per idle connection in the
programs (clients' RSS and PSS growth over the set-up, divided by N, layer and native) and in
the agents; CPU of the layer's control threads (`vmi-control`) while idle; time of `vmictl
status --json`. Prints a Markdown table; writes scale.md, scale.json and (with matplotlib)
scale.png into --out (default benchmarks/results/<date>-<time>-scale/).
"""

import argparse
import contextlib
import datetime as _dt
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from procfs import cpu_s, ctxt, nfds, pss_kb, status_kb, threads

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = REPO / "benchmarks" / "programs"
TOPO = REPO / "scripts" / "topo.sh"
PREFIX = "vmisc"
NET0, NET1 = "10.97.0", "10.97.1"
CLIENT, SERVER = f"{PREFIX}1", f"{PREFIX}2"
SERVER_IP = f"{NET0}.2"
TARGET_PROGRAM_KIB = 16.0  # issue 17: memory per idle connection in the program
TARGET_AGENT_KIB = 1.0     # ... and in the agent

LIVE = []  # every Popen we started (each in its own session)


def log(msg):
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wrap(host, argv, limit=None):
    return ["nsenter", f"--net=/run/netns/{host}", *map(str, argv)]


def start(argv, env, out=subprocess.DEVNULL, err=subprocess.DEVNULL, stdin=subprocess.DEVNULL):
    p = subprocess.Popen(argv, env=env, stdin=stdin, stdout=out, stderr=err,
                         start_new_session=True)
    LIVE.append(p)
    return p


def stop(p, grace=3.0):
    if p is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGTERM if p.poll() is None else signal.SIGKILL)
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=grace)
    if p in LIVE:
        LIVE.remove(p)


def topo(*args):
    env = dict(os.environ, VMI_NET0=NET0, VMI_NET1=NET1)
    subprocess.run(["bash", str(TOPO), *args], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)


# ------------------------------------------------------------------------------ /proc readings

def control_cpu(pid):
    """CPU seconds of the layer's control threads of a process (None: it has none)."""
    ts = [t for t, c in threads(pid).items() if c == "vmi-control"]
    if not ts:
        return None
    return sum(cpu_s(pid, t) or 0.0 for t in ts)


def sample(pids):
    """One reading of every process of interest: {name: {...}}."""
    out = {}
    for name, pid in pids.items():
        out[name] = {"rss_kb": status_kb(pid, "VmRSS"), "pss_kb": pss_kb(pid),
                     "anon_kb": status_kb(pid, "RssAnon"), "shmem_kb": status_kb(pid, "RssShmem"),
                     "cpu_s": cpu_s(pid), "ctxt": ctxt(pid), "fds": nfds(pid),
                     "control_cpu_s": control_cpu(pid), "threads": len(threads(pid))}
    out["_t"] = time.monotonic()
    return out


# ------------------------------------------------------------------------------ agents

class Agents:
    def __init__(self, bins, logdir, agent_args):
        self.bins, self.logdir, self.extra = bins, logdir, agent_args
        self.procs = {}
        self.key = logdir / "cluster.key"
        self.key.unlink(missing_ok=True)
        r = subprocess.run([str(bins["agent"]), "--init", "--key", str(self.key)],
                           capture_output=True, timeout=10)
        self.has_key = r.returncode == 0

    def status(self, host, timeout=60.0):
        """(seconds, parsed JSON or None) of one `vmictl status --json`."""
        t0 = time.monotonic()
        try:
            r = subprocess.run(wrap(host, [self.bins["vmictl"], "status", "--json"]),
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return timeout, None
        dt = time.monotonic() - t0
        if r.returncode != 0:
            return dt, None
        try:
            return dt, json.loads(r.stdout)
        except ValueError:
            return dt, None

    def restart(self, tag):
        self.stop()
        for h in (CLIENT, SERVER):
            env = dict(os.environ, VMI_LOG="warn")
            env.pop("LD_PRELOAD", None)
            if self.has_key:
                env["VMI_CLUSTER_KEY"] = str(self.key)
            logf = open(self.logdir / f"agent-{h}-{tag}.log", "wb")
            p = start(wrap(h, [self.bins["agent"], *self.extra]), env, out=logf,
                      err=subprocess.STDOUT)
            logf.close()
            self.procs[h] = p
        for h, p in self.procs.items():
            deadline = time.monotonic() + 20
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"vmi-agent in {h} exited with {p.returncode}")
                if self.status(h, timeout=5)[1] is not None:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vmi-agent in {h} not ready after 20 s")
                time.sleep(0.2)
            exe = os.readlink(f"/proc/{p.pid}/exe")
            if not exe.endswith("vmi-agent"):
                raise RuntimeError(f"pid {p.pid} is {exe}, not the agent")

    def stop(self):
        for p in self.procs.values():
            stop(p)
        self.procs = {}


# ------------------------------------------------------------------------------ one run

def read_json_line(p, timeout):
    box = []

    def reader():
        while True:
            line = p.stdout.readline()
            if not line:
                return
            line = line.decode(errors="replace").strip()
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    box.append(json.loads(line))
                    return
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else None


def established(port, nsrv):
    flt = f"( sport >= :{port} and sport <= :{port + nsrv - 1} )"
    r = subprocess.run(wrap(SERVER, ["ss", "-Htn", "state", "established", flt]),
                       capture_output=True, text=True, timeout=60)
    return sum(1 for line in r.stdout.splitlines() if line.strip())


def count_virtual(st, pids):
    if not isinstance(st, dict):
        return None
    return sum(1 for c in st.get("connections", []) if isinstance(c, dict) and c.get("pid") in pids)


def one(a, bins, agents, prog, mode, n, rep, port, logdir):
    tag = f"{mode}-{n}-r{rep}"
    res = {"mode": mode, "n": n, "rep": rep, "procs": a.procs, "errors": []}
    try:
        agents.restart(tag)
    except (RuntimeError, OSError) as e:
        res["errors"].append(f"agents: {e}")
        return res
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if mode == "layer":
        env["LD_PRELOAD"] = str(bins["preload"])
        env["VMI_LOG"] = "warn"
    servers, clients = [], []
    link_down = False
    want = n + a.procs
    # One server holds everything, unless that is more than its descriptors allow: then one
    # server (own port) per client process.
    nsrv = 1 if n + a.procs <= a.per_server else a.procs
    res["servers"] = nsrv
    try:
        for j in range(nsrv):
            logf = open(logdir / f"server{j}-{tag}.log", "wb")
            servers.append(start(wrap(SERVER, [prog, "server", SERVER_IP, port + j]), env,
                                 out=subprocess.PIPE, err=logf, stdin=subprocess.PIPE))
            logf.close()
        for j, srv in enumerate(servers):
            deadline = time.monotonic() + 15
            while not subprocess.run(wrap(SERVER, ["ss", "-Hltn", f"sport = :{port + j}"]),
                                     capture_output=True, text=True).stdout.strip():
                if srv.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server {j} not listening (rc={srv.poll()})")
                time.sleep(0.05)
        per = [n // a.procs + (1 if i < n % a.procs else 0) for i in range(a.procs)]
        for i, k in enumerate(per):
            errf = open(logdir / f"client{i}-{tag}.log", "wb")
            clients.append(start(wrap(CLIENT, [prog, "client", SERVER_IP, port + i % nsrv, k,
                                               i]),
                                 env, out=subprocess.PIPE, err=errf, stdin=subprocess.PIPE))
            errf.close()
        for i, c in enumerate(clients):
            j = read_json_line(c, 30)
            if not j or j.get("event") != "warm":
                raise RuntimeError(f"client {i} did not start (rc={c.poll()}, {j})")
        time.sleep(1.0)
        pids = {"agent_client": agents.procs[CLIENT].pid, "agent_server": agents.procs[SERVER].pid,
                **{f"server{j}": s.pid for j, s in enumerate(servers)},
                **{f"client{i}": c.pid for i, c in enumerate(clients)}}
        res["before"] = sample(pids)
        t0 = time.monotonic()
        for c in clients:
            c.stdin.write(b"open\n")
            c.stdin.flush()
        opened = []
        for i, c in enumerate(clients):
            j = read_json_line(c, 60 + n / 100)
            if not j or j.get("event") != "open":
                raise RuntimeError(f"client {i} did not report its connections (rc={c.poll()})")
            opened.append(j)
        res["setup_s"] = time.monotonic() - t0
        res["opened"] = sum(j["opened"] for j in opened)
        res["open_errors"] = sum(j["errors"] for j in opened)
        res["client_open_s"] = [j["seconds"] for j in opened]
        if res["opened"] < n:
            res["errors"].append(f"only {res['opened']} of {n} connections opened "
                                 f"({res['open_errors']} errors; logs/client*-{tag}.log)")
        # All accepted and held by the server (N + the warm-ups)?
        want = res["opened"] + a.procs
        deadline = time.monotonic() + 60
        while (est := established(port, nsrv)) < want and time.monotonic() < deadline:
            time.sleep(0.5)
        res["established"] = est
        if est < want:
            res["errors"].append(f"server host shows {est} established connections, {want} "
                                 "expected")
        time.sleep(1.0)
        res["after_setup"] = sample(pids)
        time.sleep(a.idle)
        res["after_idle"] = sample(pids)
        # vmictl status --json, timed in both hosts; and the count of virtual connections.
        cpids = {c.pid for c in clients}
        perf = None
        if a.perf_status and mode == "layer":
            # Where the client host's agent spends the time of `vmictl status --json`.
            perf = subprocess.Popen(["perf", "record", "-F", "2999", "-g", "-p",
                                     str(agents.procs[CLIENT].pid), "-o",
                                     str(logdir / f"perf-status-{tag}.data")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        for h, who in ((CLIENT, cpids), (SERVER, {s.pid for s in servers})):
            times, counts = [], []
            for _ in range(a.status_reps):
                dt, st = agents.status(h)
                times.append(dt)
                counts.append(count_virtual(st, who))
            res[f"status_s_{h}"] = times
            res[f"virtual_{h}"] = counts
            good = [x for x in counts if x is not None]
            if not good:
                res["errors"].append(f"vmictl status --json failed in {h}")
                continue
            expect = want if mode == "layer" else 0
            if max(good) != expect:
                res["errors"].append(f"vmictl in {h} lists {max(good)} connections of the "
                                     f"programs, {expect} expected")
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                perf.wait(timeout=30)
            rep_txt = subprocess.run(["perf", "report", "--stdio", "--no-children", "-g", "none",
                                      "--percent-limit", "1", "-i",
                                      str(logdir / f"perf-status-{tag}.data")],
                                     capture_output=True, text=True, timeout=300).stdout
            (logdir / f"perf-status-{tag}.txt").write_text(rep_txt)
        res["after_status"] = sample(pids)
        time.sleep(1.0)
        res["before_active"] = sample(pids)
        for c in clients:
            c.stdin.write(f"active {a.active}\n".encode())
            c.stdin.flush()
        act = [read_json_line(c, a.active + 60) for c in clients]
        res["after_active"] = sample(pids)
        res["active"] = act
        if any(j is None or j.get("errors") for j in act):
            res["errors"].append(f"active phase: {act}")
        if mode == "layer" and a.failover > 0:
            link_down = True
            plain = dict(os.environ)
            plain.pop("LD_PRELOAD", None)
            failover(a, bins, agents, clients, servers, res, plain)
        # The clients close: each says what it sent; the servers must have received as much,
        # connection by connection, once they have seen every connection close.
        for c in clients:
            with contextlib.suppress(OSError):
                c.stdin.close()
        sent = [read_json_line(c, 60 + n / 1000) for c in clients]
        res["sent"] = sent
        for c in clients:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.wait(timeout=30)
        res["received"] = received(servers, want, timeout=60 + n / 1000)
        check_bytes(res)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        res["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        if link_down:
            set_link(CLIENT, "eth0", "up", res)
        for c in clients:
            stop(c)
        for srv in servers:
            stop(srv)
        agents.stop()
    return res


def set_link(host, dev, state, res=None):
    """`ip -n HOST link set dev DEV STATE` (as tests/helpers.py link_down / link_up)."""
    r = subprocess.run(["ip", "-n", host, "link", "set", "dev", dev, state],
                       capture_output=True, text=True, timeout=15)
    if r.returncode != 0 and res is not None:
        res["errors"].append(f"ip -n {host} link set dev {dev} {state}: {r.stderr.strip()}")
    return r.returncode == 0


class Follower:
    """`vmictl events --follow --json` in a host: the failover and relink events (`ms`: wall
    clock, as the agent stamps them), and how many events it missed (gaps in the sequence
    numbers: a follower that falls more than the journal's 4,096 events behind)."""

    def __init__(self, bins, host, env):
        self.p = start(wrap(host, [bins["vmictl"], "events", "--follow", "--json"]), env,
                       out=subprocess.PIPE)
        self.events, self.missed, self.last_seq = [], 0, None
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            seq = e.get("seq")
            if isinstance(seq, int):
                if self.last_seq is not None and seq > self.last_seq + 1:
                    self.missed += seq - self.last_seq - 1
                self.last_seq = seq
            if e.get("kind") in ("failover", "relink"):
                self.events.append({k: e.get(k) for k in ("kind", "ms", "gid", "pid", "stall_ms",
                                                          "side", "local", "replayed")})

    def close(self):
        stop(self.p)
        self.t.join(5)


def moved_counts(st, pids):
    """(connections of `pids`, on network 1 with their link up, relinking, failed)."""
    if not isinstance(st, dict):
        return None
    mine = [c for c in st.get("connections", []) if isinstance(c, dict) and c.get("pid") in pids]
    on1 = sum(1 for c in mine if c.get("link") == "up"
              and str(c.get("link_local") or "").startswith(NET1 + "."))
    return (len(mine), on1, sum(1 for c in mine if c.get("link") == "relinking"),
            sum(1 for c in mine if c.get("link") == "failed"))


def failover(a, bins, agents, clients, servers, res, env):
    """Network 0 of the client host goes down (`ip link set dev eth0 down` in it, the loud
    failure of tests/test_failover.py) while every connection sends 64 B a second; how long
    until every connection runs on network 1. The link stays down until the run's end."""
    cpids = {c.pid for c in clients}
    spids = {s.pid for s in servers}
    want = res["opened"] + a.procs
    _, st = agents.status(CLIENT)
    mc = moved_counts(st, cpids)
    res["failover_before"] = mc
    if mc is not None:
        res["failover_on_net0_before"] = sum(
            1 for c in st.get("connections", []) if isinstance(c, dict) and c.get("pid") in cpids
            and str(c.get("link_local") or "").startswith(NET0 + "."))
    follow = {h: Follower(bins, h, env) for h in (CLIENT, SERVER)}
    try:
        time.sleep(1.0)
        for c in clients:
            c.stdin.write(f"active {a.failover}\n".encode())
            c.stdin.flush()
        time.sleep(a.failover_after)
        t_down = time.time()
        res["before_failover"] = sample({"agent_client": agents.procs[CLIENT].pid,
                                         "agent_server": agents.procs[SERVER].pid})
        t0 = time.monotonic()
        if not set_link(CLIENT, "eth0", "down", res):
            return
        log(f"  eth0 of {CLIENT} down; {want} connections to move")
        polls = []
        deadline = t0 + a.failover_wait
        done = None
        while time.monotonic() < deadline:
            ts = time.monotonic() - t0
            _, st = agents.status(CLIENT)
            te = time.monotonic() - t0
            mc = moved_counts(st, cpids)
            polls.append([round(ts, 3), round(te, 3), mc])
            if mc is not None and mc[1] >= want:
                done = te
                break
            if mc is not None and mc[2] == 0 and mc[1] + mc[3] >= want:
                break  # no link still being rebuilt: the rest have failed
            time.sleep(0.2)
        res["failover_polls"] = polls
        res["failover_all_moved_s"] = done
        # The same from the servers' side.
        _, st = agents.status(SERVER)
        res["failover_server_side"] = moved_counts(st, spids)
        if done is None:
            last = polls[-1][2] if polls else None
            res["errors"].append(f"failover: after {a.failover_wait:.0f} s {last} (connections, "
                                 f"on {NET1}/24, relinking, failed) of {want}")
        elif res["failover_server_side"] is None or res["failover_server_side"][1] < want:
            res["errors"].append(f"failover: the server host shows {res['failover_server_side']}"
                                 f" (connections, on {NET1}/24, relinking, failed) of {want}")
        act = [read_json_line(c, a.failover + 60) for c in clients]
        res["failover_active"] = act
        res["after_failover"] = sample({"agent_client": agents.procs[CLIENT].pid,
                                        "agent_server": agents.procs[SERVER].pid})
        time.sleep(2.0)
    finally:
        for f in follow.values():
            f.close()
    ms0 = t_down * 1000
    for h, short in ((CLIENT, "client"), (SERVER, "server")):
        f = follow[h]
        # (The follower first prints the journal's last events: only those after the link
        # went down count.)
        ev = [e for e in f.events if e["kind"] == "failover" and e["pid"] in (cpids | spids)
              and (e.get("ms") or 0) >= ms0]
        res[f"failover_events_before_{short}"] = sum(
            1 for e in f.events if e["kind"] == "failover" and (e.get("ms") or 0) < ms0)
        res[f"failover_events_{short}"] = len(ev)
        res[f"failover_gids_{short}"] = len({e["gid"] for e in ev})
        res[f"failover_missed_{short}"] = f.missed
        res[f"relink_events_{short}"] = sum(1 for e in f.events if e["kind"] == "relink")
        if ev:
            ms = sorted(e["ms"] for e in ev)
            stalls = sorted(e["stall_ms"] for e in ev if e.get("stall_ms") is not None)
            res[f"failover_first_s_{short}"] = (ms[0] - ms0) / 1000
            res[f"failover_last_s_{short}"] = (ms[-1] - ms0) / 1000
            # When each tenth of them had moved (s after the link went down).
            res[f"failover_deciles_s_{short}"] = [round((ms[min(len(ms) - 1, len(ms) * k // 10)]
                                                         - ms0) / 1000, 3) for k in range(11)]
            if stalls:
                res[f"failover_stall_ms_{short}"] = {
                    "min": stalls[0], "median": statistics.median(stalls), "max": stalls[-1]}
            res[f"failover_sides_{short}"] = {s: sum(1 for e in ev if e.get("side") == s)
                                              for s in ("dialer", "holder")}
    errs = [j.get("errors", 0) if j else None for j in res.get("failover_active", [])]
    res["failover_send_errors"] = None if None in errs else sum(errs)
    log(f"  failover: first {res.get('failover_first_s_client')}, last "
        f"{res.get('failover_last_s_client')} s (events, client host: "
        f"{res.get('failover_gids_client')} connections, {res.get('failover_missed_client')} "
        f"events missed), all on {NET1}/24 per vmictl after {done} s")


def received(servers, want, timeout):
    """The servers' counts once they have seen `want` connections close (or at `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        got = []
        for srv in servers:
            with contextlib.suppress(OSError):
                srv.stdin.write(b"stats\n")
                srv.stdin.flush()
            got.append(read_json_line(srv, 30))
        closed = sum(g["closed"] + g.get("failed", 0) for g in got if g)
        if (None not in got and closed >= want) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def check_bytes(res):
    """Bytes the clients sent against the bytes the servers received, in all and (through the
    fingerprint, a sum over connections of a hash of id and count) connection by connection."""
    sent, got = res.get("sent") or [], res.get("received") or []
    if not sent or not got or None in sent or None in got:
        res["errors"].append(f"bytes: a client or server did not report (sent {sent}, "
                             f"received {got})")
        res["bytes_equal"] = None
        return
    s_bytes = sum(j["bytes"] for j in sent)
    s_conns = sum(j["conns"] for j in sent)
    s_fp = sum(j["fingerprint"] for j in sent) % (1 << 64)
    r_bytes = sum(j["closed_bytes"] for j in got)
    r_conns = sum(j["closed"] for j in got)
    r_fp = sum(j["fingerprint"] for j in got) % (1 << 64)
    res["bytes_sent"], res["bytes_received"] = s_bytes, r_bytes
    res["bytes_conns"] = [s_conns, r_conns]
    res["bytes_equal"] = s_bytes == r_bytes and s_conns == r_conns and s_fp == r_fp
    if not res["bytes_equal"]:
        res["errors"].append(f"bytes: clients sent {s_bytes} on {s_conns} connections, servers "
                             f"received {r_bytes} on {r_conns} closed ones (fingerprints "
                             f"{'equal' if s_fp == r_fp else 'differ'}); received in all "
                             f"{sum(j['bytes'] for j in got)}; "
                             f"{sum(j.get('failed', 0) for j in got)} connections ended with an "
                             "error in the servers")


# ------------------------------------------------------------------------------ figures

def derive(r):
    """Figures of one run (None where a reading is missing)."""
    f = {}
    n = r.get("opened") or r["n"]
    b, s, i, ba, aa = (r.get(k) for k in ("before", "after_setup", "after_idle",
                                         "before_active", "after_active"))
    if not (b and s and i and ba and aa):
        return f
    cl = [k for k in b if k.startswith("client")]

    def tot(smp, key, names):
        vals = [smp[k][key] for k in names]
        return None if any(v is None for v in vals) else sum(vals)

    def per_conn_kib(key, names):
        x0, x1 = tot(b, key, names), tot(s, key, names)
        return None if x0 is None or x1 is None else (x1 - x0) / n

    f["clients_rss_kib_per_conn"] = per_conn_kib("rss_kb", cl)
    f["clients_pss_kib_per_conn"] = per_conn_kib("pss_kb", cl)
    sv = [k for k in b if k.startswith("server")]
    f["server_rss_kib_per_conn"] = per_conn_kib("rss_kb", sv)
    f["server_pss_kib_per_conn"] = per_conn_kib("pss_kb", sv)
    didle, dact = i["_t"] - s["_t"], aa["_t"] - ba["_t"]
    for ag in ("agent_client", "agent_server"):
        f[f"{ag}_rss_before_kib"] = b[ag]["rss_kb"]
        f[f"{ag}_rss_setup_kib"] = s[ag]["rss_kb"]
        f[f"{ag}_rss_active_kib"] = aa[ag]["rss_kb"]
        if r.get("after_status"):
            f[f"{ag}_rss_status_kib"] = r["after_status"][ag]["rss_kb"]
            f[f"{ag}_shmem_status_kib"] = r["after_status"][ag].get("shmem_kb")
            f[f"{ag}_anon_status_kib"] = r["after_status"][ag].get("anon_kb")
        f[f"{ag}_threads"] = s[ag]["threads"]
        f[f"{ag}_kib_per_conn"] = (s[ag]["rss_kb"] - b[ag]["rss_kb"]) / n
        f[f"{ag}_fds_setup"] = s[ag]["fds"]
        f[f"{ag}_cpu_setup_ms"] = (s[ag]["cpu_s"] - b[ag]["cpu_s"]) * 1000
        f[f"{ag}_cpu_setup_us_per_conn"] = f[f"{ag}_cpu_setup_ms"] * 1000 / n
        f[f"{ag}_cpu_idle_pct"] = 100 * (i[ag]["cpu_s"] - s[ag]["cpu_s"]) / didle
        f[f"{ag}_ctxt_idle_per_s"] = (i[ag]["ctxt"] - s[ag]["ctxt"]) / didle
        f[f"{ag}_cpu_active_pct"] = 100 * (aa[ag]["cpu_s"] - ba[ag]["cpu_s"]) / dact
        f[f"{ag}_ctxt_active_per_s"] = (aa[ag]["ctxt"] - ba[ag]["ctxt"]) / dact
    procs = cl + sv
    f["programs_cpu_idle_pct"] = 100 * sum(i[k]["cpu_s"] - s[k]["cpu_s"] for k in procs) / didle
    f["programs_ctxt_idle_per_s"] = sum(i[k]["ctxt"] - s[k]["ctxt"] for k in procs) / didle
    f["programs_cpu_active_pct"] = 100 * sum(aa[k]["cpu_s"] - ba[k]["cpu_s"]
                                             for k in procs) / dact
    ctl = [(i[k]["control_cpu_s"], s[k]["control_cpu_s"]) for k in procs
           if i[k]["control_cpu_s"] is not None and s[k]["control_cpu_s"] is not None]
    f["control_threads"] = len(ctl)
    f["control_cpu_idle_pct"] = (100 * sum(x1 - x0 for x1, x0 in ctl) / didle) if ctl else None
    f["setup_s"] = r.get("setup_s")
    f["bytes_equal"] = r.get("bytes_equal")
    f["bytes_received_mib"] = (r["bytes_received"] / 2**20
                               if r.get("bytes_received") is not None else None)
    for k in ("failover_on_net0_before", "failover_first_s_client", "failover_last_s_client",
              "failover_all_moved_s", "failover_gids_client", "failover_gids_server",
              "failover_missed_client", "failover_send_errors"):
        f[k] = r.get(k)
    st = r.get("failover_stall_ms_client") or {}
    f["failover_stall_median_ms"], f["failover_stall_max_ms"] = st.get("median"), st.get("max")
    lates = [j.get("max_late_ms") for j in r.get("failover_active") or [] if j]
    f["failover_max_late_ms"] = max(lates) if lates else None
    if r.get("before_failover") and r.get("after_failover"):
        b0, b1 = r["before_failover"], r["after_failover"]
        dt = b1["_t"] - b0["_t"]
        for ag in ("agent_client", "agent_server"):
            f[f"{ag}_cpu_failover_pct"] = 100 * (b1[ag]["cpu_s"] - b0[ag]["cpu_s"]) / dt
    for h, short in ((CLIENT, "client"), (SERVER, "server")):
        t = r.get(f"status_s_{h}")
        f[f"status_ms_{short}"] = statistics.median(t) * 1000 if t else None
    return f


def med_range(xs, fmt="{:.2f}"):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    m = statistics.median(xs)
    if len(xs) == 1:
        return fmt.format(m)
    return f"{fmt.format(m)} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


ROWS = [
    ("clients: RSS growth per connection (KiB)", "clients_rss_kib_per_conn", "{:.2f}"),
    ("clients: PSS growth per connection (KiB)", "clients_pss_kib_per_conn", "{:.2f}"),
    ("server: RSS growth per connection (KiB)", "server_rss_kib_per_conn", "{:.2f}"),
    ("agent, client host: RSS before (MiB)", "agent_client_rss_before_kib", "mib"),
    ("agent, client host: RSS after set-up (MiB)", "agent_client_rss_setup_kib", "mib"),
    ("agent, client host: RSS after the `vmictl status` calls (MiB)", "agent_client_rss_status_kib",
     "mib"),
    ("... of which shared memory (RssShmem, MiB)", "agent_client_shmem_status_kib", "mib"),
    ("... of which anonymous (RssAnon, MiB)", "agent_client_anon_status_kib", "mib"),
    ("agent, client host: RSS after the active phase (MiB)", "agent_client_rss_active_kib", "mib"),
    ("agent, server host: RSS after set-up (MiB)", "agent_server_rss_setup_kib", "mib"),
    ("agent, server host: RSS after the active phase (MiB)", "agent_server_rss_active_kib", "mib"),
    ("agent, client host: threads after set-up", "agent_client_threads", "{:.0f}"),
    ("agent, client host: RSS growth per connection (KiB)", "agent_client_kib_per_conn", "{:.2f}"),
    ("agent, server host: RSS growth per connection (KiB)", "agent_server_kib_per_conn", "{:.2f}"),
    ("agent, client host: open descriptors after set-up", "agent_client_fds_setup", "{:.0f}"),
    ("agent, client host: CPU during set-up (ms)", "agent_client_cpu_setup_ms", "{:.0f}"),
    ("agent, server host: CPU during set-up (ms)", "agent_server_cpu_setup_ms", "{:.0f}"),
    ("agent, client host: CPU per connection set up (us)", "agent_client_cpu_setup_us_per_conn",
     "{:.0f}"),
    ("agent, server host: CPU per connection set up (us)", "agent_server_cpu_setup_us_per_conn",
     "{:.0f}"),
    ("agent, client host: CPU while idle (%)", "agent_client_cpu_idle_pct", "{:.2f}"),
    ("agent, server host: CPU while idle (%)", "agent_server_cpu_idle_pct", "{:.2f}"),
    ("agent, client host: context switches/s while idle", "agent_client_ctxt_idle_per_s",
     "{:.0f}"),
    ("agent, client host: CPU while active (%)", "agent_client_cpu_active_pct", "{:.2f}"),
    ("agent, server host: CPU while active (%)", "agent_server_cpu_active_pct", "{:.2f}"),
    ("agent, client host: context switches/s while active", "agent_client_ctxt_active_per_s",
     "{:.0f}"),
    ("programs (clients + server): CPU while idle (%)", "programs_cpu_idle_pct", "{:.2f}"),
    ("programs: context switches/s while idle", "programs_ctxt_idle_per_s", "{:.1f}"),
    ("layer's control threads: CPU while idle (%)", "control_cpu_idle_pct", "{:.2f}"),
    ("programs: CPU while active (%)", "programs_cpu_active_pct", "{:.1f}"),
    ("set-up of all connections, the clients at once (s)", "setup_s", "{:.2f}"),
    ("`vmictl status --json`, client host (ms)", "status_ms_client", "{:.0f}"),
    ("`vmictl status --json`, server host (ms)", "status_ms_server", "{:.0f}"),
    ("bytes received by the servers (MiB)", "bytes_received_mib", "{:.1f}"),
    ("bytes sent = received, every connection (after the close)", "bytes_equal", "yes/no"),
    # The failover (layer only: natively a TCP connection cannot move to another network, so
    # the native runs have no such phase).
    ("failover: connections on network 0 when it went down", "failover_on_net0_before",
     "layer {:.0f}"),
    ("failover: first connection moved (s after the link went down)", "failover_first_s_client",
     "layer {:.3f}"),
    ("failover: last connection moved (s)", "failover_last_s_client", "layer {:.3f}"),
    ("failover: all on network 1 per `vmictl status` (s, polled)", "failover_all_moved_s",
     "layer {:.2f}"),
    ("failover: connections with a failover event, client / server host",
     ("failover_gids_client", "failover_gids_server"), "layer pair"),
    ("failover: events the follower missed (client host)", "failover_missed_client",
     "layer {:.0f}"),
    ("failover: stall per connection as its process saw it, median (ms)",
     "failover_stall_median_ms", "layer {:.0f}"),
    ("failover: stall per connection, longest (ms)", "failover_stall_max_ms", "layer {:.0f}"),
    ("failover: sends that failed", "failover_send_errors", "layer {:.0f}"),
    ("failover: latest 10 ms send slot of the clients (ms late)", "failover_max_late_ms",
     "layer {:.0f}"),
    ("agent, client host: CPU during the failover phase (%)", "agent_client_cpu_failover_pct",
     "layer {:.1f}"),
    ("agent, server host: CPU during the failover phase (%)", "agent_server_cpu_failover_pct",
     "layer {:.1f}"),
]


def report(runs, a):
    ns = sorted({r["n"] for r in runs})
    figs = {}
    for r in runs:
        figs.setdefault((r["n"], r["mode"]), []).append(derive(r))
    head = ["figure"] + [f"{m} N={n:,}" for n in ns for m in ("native", "layer")]
    lines = [f"# {a.procs} client processes, N connections to one server; median (range) of "
             f"{a.reps} runs per cell", "", "| " + " | ".join(head) + " |",
             "|" + " --- |" * len(head)]
    for label, key, rowfmt in ROWS:
        cells = []
        for n in ns:
            for m in ("native", "layer"):
                fs = figs.get((n, m), [])
                fmt = rowfmt
                if fmt.startswith("layer") and m == "native":
                    cells.append("n/a")
                    continue
                if fmt == "layer pair":
                    cells.append(" / ".join(med_range([f.get(k) for f in fs], "{:.0f}")
                                            for k in key))
                    continue
                if fmt.startswith("layer "):
                    fmt = fmt[6:]
                xs = [f.get(key) for f in fs]
                if fmt == "yes/no":
                    xs = [x for x in xs if x is not None]
                    cells.append("-" if not xs else
                                 "yes" if all(xs) else f"**no** ({xs.count(False)} of {len(xs)})")
                elif fmt == "mib":
                    cells.append(med_range([x / 1024 if x is not None else None for x in xs],
                                           "{:.1f}"))
                else:
                    cells.append(med_range(xs, fmt))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("n/a: native runs have no failover phase (natively a TCP connection cannot "
                 "move to another network: it stalls until its own comes back or it times out).")
    lines.append("")
    for n in ns:
        lay = figs.get((n, "layer"), [])
        nat = figs.get((n, "native"), [])
        prog = [f.get("clients_rss_kib_per_conn") for f in lay]
        natp = [f.get("clients_rss_kib_per_conn") for f in nat]
        agent = [f.get("agent_client_kib_per_conn") for f in lay]
        prog = [x for x in prog if x is not None]
        agent = [x for x in agent if x is not None]
        if prog:
            m = statistics.median(prog)
            mn = statistics.median([x for x in natp if x is not None] or [0])
            lines.append(f"- N={n:,}: program {m:.2f} KiB per idle virtual connection "
                         f"({m - mn:.2f} above native), target <= {TARGET_PROGRAM_KIB:.0f}: "
                         + ("met" if m <= TARGET_PROGRAM_KIB else "**MISSED**"))
        if agent:
            m = statistics.median(agent)
            lines.append(f"- N={n:,}: agent {m:.2f} KiB per connection (client host), target "
                         f"<= {TARGET_AGENT_KIB:.0f}: "
                         + ("met" if m <= TARGET_AGENT_KIB else "**MISSED**"))
    errs = [(r["mode"], r["n"], r["rep"], e) for r in runs for e in r["errors"]]
    if errs:
        lines += ["", "Problems:", ""] + [f"- {m} N={n} rep {rp + 1}: {e}" for m, n, rp, e in errs]
    return "\n".join(lines) + "\n", figs


def plot(figs, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ns = sorted({n for n, _ in figs})

    def med(n, m, key):
        xs = [f.get(key) for f in figs.get((n, m), []) if f.get(key) is not None]
        return statistics.median(xs) if xs else float("nan")
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    for m, style in (("native", "o--"), ("layer", "s-")):
        ax[0].plot(ns, [med(n, m, "clients_rss_kib_per_conn") for n in ns], style,
                   label=f"programs, {m}")
    ax[0].plot(ns, [med(n, "layer", "agent_client_kib_per_conn") for n in ns], "^-",
               label="agent (client host), layer")
    ax[0].axhline(TARGET_PROGRAM_KIB, color="grey", ls=":", label="program target")
    ax[0].axhline(TARGET_AGENT_KIB, color="red", ls=":", label="agent target")
    ax[0].set_title("memory per idle connection (KiB)")
    ax[1].plot(ns, [med(n, "layer", "agent_client_rss_setup_kib") / 1024 for n in ns], "s-",
               label="agent RSS after set-up, layer")
    ax[1].plot(ns, [med(n, "native", "agent_client_rss_setup_kib") / 1024 for n in ns], "o--",
               label="agent RSS, native run")
    ax[1].set_title("agent RSS, client host (MiB)")
    for key, lab in (("agent_client_cpu_idle_pct", "agent idle"),
                     ("agent_client_cpu_active_pct", "agent active"),
                     ("control_cpu_idle_pct", "control threads idle")):
        ax[2].plot(ns, [med(n, "layer", key) for n in ns], "s-", label=lab)
    ax[2].set_title("CPU (% of one CPU), layer")
    for x in ax:
        x.set_xscale("log")
        x.set_xlabel("connections N")
        x.legend(fontsize=7)
    fig.tight_layout()
    path = out / "scale.png"
    fig.savefig(path, dpi=110)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conns", default="1000,10000")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--idle", type=float, default=10.0)
    ap.add_argument("--active", type=float, default=10.0)
    ap.add_argument("--status-reps", type=int, default=3)
    ap.add_argument("--bin-dir", type=Path, default=REPO / "target" / "release")
    ap.add_argument("--agent-args", default="")
    ap.add_argument("--port-range", default="1024 65000",
                    help="net.ipv4.ip_local_port_range of the client host (default '1024 65000'; "
                    "the kernel's default is '32768 60999')")
    ap.add_argument("--perf-status", action="store_true",
                    help="perf record the client host's agent while vmictl status --json runs "
                    "(layered runs; logs/perf-status-*.txt)")
    ap.add_argument("--per-server", type=int, default=15000,
                    help="most connections one server process holds (default 15000: the "
                    "descriptor limit here is 20,000 and cannot be raised without "
                    "CAP_SYS_RESOURCE); above it, one server per client process")
    ap.add_argument("--failover", type=float, default=30.0,
                    help="layered runs: seconds of sending (64 B/s per connection) in the failover "
                    "phase, eth0 of the client host going down --failover-after seconds in "
                    "(default 30; 0: no failover phase)")
    ap.add_argument("--failover-after", type=float, default=3.0)
    ap.add_argument("--failover-wait", type=float, default=120.0,
                    help="longest wait for every connection to be on network 1 (default 120 s)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("scale.py: must run as root (network namespaces)")
    d = a.bin_dir.resolve()
    bins = {"preload": d / "libvmi_preload.so", "agent": d / "vmi-agent", "vmictl": d / "vmictl"}
    for b in bins.values():
        if not b.exists():
            sys.exit(f"{b} missing: cargo build --release -p vmi-agent -p vmi-preload")
    out = a.out or (REPO / "benchmarks" / "results" /
                    (_dt.datetime.now().strftime("%Y-%m-%d-%H%M%S") + "-scale"))
    out.mkdir(parents=True, exist_ok=True)
    logdir = out / "logs"
    logdir.mkdir(exist_ok=True)
    prog = out / "scale_conns"
    subprocess.run(["gcc", "-O2", "-Wall", "-o", str(prog), str(PROGRAMS / "scale_conns.c")],
                   check=True)

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    runs = []
    t0 = time.monotonic()
    meta = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "bin_dir": str(d),
            "git": subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                  capture_output=True, text=True).stdout.strip(),
            "loadavg_before": os.getloadavg(), "args": {k: str(v) for k, v in vars(a).items()},
            "vmi_env": {k: v for k, v in os.environ.items() if k.startswith("VMI_")},
            "nofile": list(__import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE))}
    agents = None
    try:
        topo("down-all", PREFIX)
        topo("up", "2", PREFIX)
        # 30,000 connections from one address to one port need more than the default
        # 28,232 ephemeral ports.
        subprocess.run(wrap(CLIENT, ["sysctl", "-qw",
                                     f"net.ipv4.ip_local_port_range={a.port_range}"]), check=True)
        agents = Agents(bins, logdir, a.agent_args.split())
        port = 24000
        k = 0
        for n in [int(x) for x in a.conns.split(",")]:
            for rep in range(a.reps):
                for mode in (("native", "layer") if k % 2 == 0 else ("layer", "native")):
                    k += 1
                    log(f"N={n} rep {rep + 1}/{a.reps} {mode}")
                    r = one(a, bins, agents, prog, mode, n, rep, port, logdir)
                    port += a.procs
                    runs.append(r)
                    f = derive(r)
                    log(f"  opened {r.get('opened')} in {r.get('setup_s') or 0:.1f} s; "
                        f"clients {f.get('clients_rss_kib_per_conn') or 0:.2f} KiB/conn, agent "
                        f"{f.get('agent_client_kib_per_conn') or 0:.2f} KiB/conn, agent idle "
                        f"{f.get('agent_client_cpu_idle_pct') or 0:.2f} %, status "
                        f"{f.get('status_ms_client') or 0:.0f} ms; errors {r['errors']}")
                    (out / "scale.json").write_text(json.dumps(
                        {"meta": meta, "runs": runs}, indent=1))
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        meta["interrupted"] = True
    finally:
        if agents is not None:
            agents.stop()
        for p in list(LIVE):
            stop(p, grace=1.0)
        with contextlib.suppress(Exception):
            topo("down", "2", PREFIX)
    meta["seconds"] = round(time.monotonic() - t0, 1)
    md, figs = report(runs, a)
    summary = {f"{m} {n}": fs for (n, m), fs in figs.items()}
    (out / "scale.json").write_text(json.dumps({"meta": meta, "figures": summary, "runs": runs},
                                               indent=1))
    (out / "scale.md").write_text(md)
    p = plot(figs, out)
    print(md)
    log(f"wrote {out}/scale.md, scale.json" + (f", {p.name}" if p else ""))
    return 1 if any(r["errors"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
