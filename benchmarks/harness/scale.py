#!/usr/bin/env python3
"""Many connections on one node: the agent's and the programs' memory and CPU with N virtual
connections open, idle and then active at a low rate, side by side with the same connections
held natively.

    sudo flock /tmp/vmi-bench.lock python3 benchmarks/harness/scale.py \\
        [--conns 1000,10000] [--procs 4] [--reps 2] [--idle 10] [--active 10] [--bin-dir DIR]

Two namespace hosts (scripts/topo.sh, prefix vmisc, networks 10.97.0/24 and 10.97.1/24), a
vmi-agent in each, started afresh before every run (native runs too, so that both see the same
background). For each N, repetition and mode (native and layer alternating which goes first):

* server: `programs/scale_conns.c server` in vmisc2, accepts and holds every connection;
* clients: --procs `scale_conns client` processes in vmisc1, N/procs connections each (each
  carries one byte when opened), all opening at once; above --per-server connections one
  server per client, each on its own port (the descriptor limit here is 20,000 and cannot be
  raised); the client host's ephemeral port range is --port-range (default 1024-65000: the
  layer binds each socket to a port of its own before connect, and the kernel's default
  range holds 28,232);
* phases, each read from /proc (VmRSS of /proc/PID/status, Pss of smaps_rollup, utime+stime
  of /proc/PID/stat, voluntary + involuntary context switches of every thread):
  before (after each client's warm-up connection), after set-up (1 s after the last client
  reported), idle (--idle seconds with nothing sent), active (--active seconds in which every
  connection sends 64 B once a second, spread evenly), and `vmictl status --json` timed in both
  hosts (--status-reps times each, after the idle phase);
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

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = REPO / "benchmarks" / "programs"
TOPO = REPO / "scripts" / "topo.sh"
PREFIX = "vmisc"
NET0, NET1 = "10.97.0", "10.97.1"
CLIENT, SERVER = f"{PREFIX}1", f"{PREFIX}2"
SERVER_IP = f"{NET0}.2"
TARGET_PROGRAM_KIB = 16.0  # issue 17: memory per idle connection in the program
TARGET_AGENT_KIB = 1.0     # ... and in the agent
CLK = os.sysconf("SC_CLK_TCK")

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

def status_kb(pid, key):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def pss_kb(pid):
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_s(pid, tid=None):
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        f = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / CLK
    except (OSError, ValueError, IndexError):
        return None


def threads(pid):
    """{tid: comm} of a process."""
    out = {}
    with contextlib.suppress(OSError):
        for t in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out[int(t)] = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
    return out


def ctxt(pid):
    """Context switches (voluntary + involuntary) of every thread of a process."""
    total = 0
    for tid in threads(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                    total += int(line.split()[1])
    return total


def nfds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


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
    # One server holds everything, unless that is more than its descriptors allow: then one
    # server (own port) per client process.
    nsrv = 1 if n + a.procs <= a.per_server else a.procs
    res["servers"] = nsrv
    try:
        for j in range(nsrv):
            logf = open(logdir / f"server{j}-{tag}.log", "wb")
            servers.append(start(wrap(SERVER, [prog, "server", SERVER_IP, port + j]), env,
                                 out=logf, err=subprocess.STDOUT))
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
            clients.append(start(wrap(CLIENT, [prog, "client", SERVER_IP, port + i % nsrv, k]),
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
        for c in clients:
            with contextlib.suppress(OSError):
                c.stdin.close()
        for c in clients:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.wait(timeout=30)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        res["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        for c in clients:
            stop(c)
        for srv in servers:
            stop(srv)
        agents.stop()
    return res


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
    ("set-up of all connections, 4 clients at once (s)", "setup_s", "{:.2f}"),
    ("`vmictl status --json`, client host (ms)", "status_ms_client", "{:.0f}"),
    ("`vmictl status --json`, server host (ms)", "status_ms_server", "{:.0f}"),
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
    for label, key, fmt in ROWS:
        cells = []
        for n in ns:
            for m in ("native", "layer"):
                xs = [f.get(key) for f in figs.get((n, m), [])]
                if fmt == "mib":
                    cells.append(med_range([x / 1024 if x is not None else None for x in xs],
                                           "{:.1f}"))
                else:
                    cells.append(med_range(xs, fmt))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
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
