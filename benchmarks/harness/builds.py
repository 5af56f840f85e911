#!/usr/bin/env python3
"""Two builds of vmi side by side in one run: bench.py alternates between them, round after
round, and the layer's figures of each are put in one table (median and range).

    benchmarks/harness/builds.py --old DIR --new DIR [--rounds N]
                                 [--only connrate,failover,calls,throughput,mpi,mpich,migration,redis,memcached,nginx]
                                 [--migration-mb 10] [--migration-reps 3] [--out DIR]

DIR is a folder with libvmi_preload.so, vmi-agent, vmictl, vmi-migrate (a `target/release`
of each build). Each round runs `bench.py --only ... --reps 1` once with
each build, in alternating order (old first in even rounds), so a machine that gets slower
or faster during the run weighs on both alike. The figures are the layer's (the native
baseline of each bench.py run is printed too, as a check that the machine did not change):

- connrate: connections set up per second, sequentially, by one client (`connrate`);
- failover: the longest receive stall after a network fails mid-stream, loud (link down) and
  silent (veth off its bridge), in ms;
- calls: nanoseconds per write/read/write/read round trip on one connection held by one
  process (`vc_calls`, 64 B, 1 KiB, 16 KiB), the layer's cost per call with no wake-up in
  the way, and per `epoll_ctl` of the changes an event loop makes around a request;
- mpi, mpich: Open MPI's NetPIPE and MPICH's ping-pong between the two hosts, 8 B one way
  (us) and 1 MiB (Mbit/s);
- redis, memcached, nginx: the request/response rows of bench.py (redis-benchmark SET and
  GET, memcaslap, wrk against nginx), operations or requests per second;
- migration: `migration.py --bin-dir DIR --sizes MB --reps R` in each round (its own hosts,
  vmimb1..3): the peer's longest receive gap while `vmi-migrate` moves the streaming sender
  (MB MiB of ballast) to another host with CRIU, in ms, with vmi-migrate's phases beside it.
  Every repetition of every round is one value. Needs CRIU (/opt/vmi/criu/bin/criu);
- scale: `scale.py --bin-dir DIR --conns N --reps 1` in each round (hosts vmisc1..2; N from
  --scale-conns, default 10,000): the agents' memory and CPU per connection, while idle, and
  the time of `vmictl status --json` with N virtual connections (layer runs only).

Writes builds.md and builds.json into --out (default benchmarks/results/builds).
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def run(bin_dir, only, out):
    cmd = [sys.executable, str(HERE / "bench.py"), "--only", only, "--reps", "1",
           "--failover-reps", "1", "--bin-dir", str(bin_dir), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        raise SystemExit(f"bench.py failed ({r.returncode}) with {bin_dir}")
    return json.loads((out / "results.json").read_text())["benchmarks"]


def run_migration(bin_dir, mb, reps, out):
    """migration.py with this build; its rows (a failed repetition stays out of the figures
    and is counted)."""
    cmd = [sys.executable, str(HERE / "migration.py"), "--bin-dir", str(bin_dir), "--sizes",
           str(mb), "--reps", str(reps), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600 + 120 * reps)
    (out / "migration.log").write_text(r.stdout + "\n--- stderr\n" + r.stderr)
    try:
        return json.loads((out / "migration.json").read_text())
    except (OSError, ValueError):
        sys.stderr.write(r.stdout[-2000:] + r.stderr[-2000:])
        return [{"ok": False, "intact": False, "outcome": f"migration.py rc={r.returncode}"}]


PHASES = ("freeze", "dump", "transfer", "restore", "thaw")

SCALE_FIGURES = {
    "agent_client_kib_per_conn": "agent RSS growth per connection, client host (KiB)",
    "agent_server_kib_per_conn": "agent RSS growth per connection, server host (KiB)",
    "agent_client_anon_status_kib": "agent RssAnon after vmictl status, client host (KiB)",
    "agent_client_cpu_setup_us_per_conn": "agent CPU per connection set up, client host (us)",
    "agent_server_cpu_setup_us_per_conn": "agent CPU per connection set up, server host (us)",
    "agent_client_cpu_idle_pct": "agent CPU while idle, client host (%)",
    "agent_client_ctxt_idle_per_s": "agent context switches/s while idle, client host",
    "control_cpu_idle_pct": "control threads' CPU while idle (%)",
    "status_ms_client": "vmictl status --json, client host (ms)",
    "setup_s": "set-up of all connections, 4 clients (s)",
}


def run_scale(bin_dir, n, out):
    cmd = [sys.executable, str(HERE / "scale.py"), "--bin-dir", str(bin_dir), "--conns", str(n),
           "--reps", "1", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    (out / "scale.log").write_text(r.stdout + "\n--- stderr\n" + r.stderr)
    try:
        return json.loads((out / "scale.json").read_text()).get("figures", {})
    except (OSError, ValueError):
        sys.stderr.write(r.stdout[-2000:] + r.stderr[-2000:])
        return {}


def figures(b, mig=None, scale=None):
    """{figure name: [values]} of one bench.py result (and migration.py rows)."""
    f = {}

    def add(name, v):
        if v is not None:
            f.setdefault(name, []).append(v)
    for r in b.get("connrate", {}).get("runs", []):
        add(f"connrate {r['mode']} (conn/s)", r["conns_per_sec"])
    for r in b.get("failover", {}).get("runs", []):
        add(f"failover {r['kind']} {r['mode']} stall (ms)", r["stall_ms"])
    for r in b.get("throughput", {}).get("runs", []):
        add(f"iperf3 -P{r['streams']} {r['mode']} (Gbit/s)", r["gbps"])
        add(f"iperf3 -P{r['streams']} {r['mode']} (CPU s per GiB, both ends)", r.get("cpu_s_per_gib"))
    for key, label in (("mpi", "MPI"), ("mpich", "MPICH")):
        for r in b.get(key, {}).get("runs", []):
            add(f"{label} 8 B {r['mode']} (us one way)", r["lat8_us"])
            add(f"{label} 1 MiB {r['mode']} (Mbit/s)", r["bw1m_mbps"])
    for r in b.get("redis", {}).get("runs", []):
        for test, rec in r.get("tests", {}).items():
            add(f"redis-benchmark {test} {r['mode']} (ops/s)", rec.get("rps"))
    for r in b.get("memcached", {}).get("runs", []):
        add(f"memcached {r['mode']} (ops/s)", r.get("tps"))
    for r in b.get("nginx", {}).get("runs", []):
        add(f"nginx + wrk {r['mode']} (requests/s)", r.get("rps"))
    for r in b.get("calls", {}).get("runs", []):
        for size in (64, 1024, 16384):
            if f"rt_{size}_ns" in r:
                add(f"calls {size} B {r['mode']} (ns per round trip)", r[f"rt_{size}_ns"])
        if r.get("ctl_ns"):
            add(f"calls epoll_ctl {r['mode']} (ns per call)", r["ctl_ns"])
    for r in mig or []:
        if not (r.get("ok") and r.get("intact")):
            add("migration failed runs", 1)
            continue
        mb = r["size_mb"]
        add(f"migration {mb} MiB downtime seen by the peer (ms)", r["downtime_ms"])
        for ph in PHASES:
            add(f"migration {mb} MiB {ph} (ms)", r.get(ph))
        add(f"migration {mb} MiB image (MiB)", r.get("image_mb"))
    for key, runs in (scale or {}).items():
        mode, n = key.split()
        if mode != "layer":
            continue
        for run_f in runs:
            for k, label in SCALE_FIGURES.items():
                add(f"scale N={int(n):,}: {label}", run_f.get(k))
    return f


def summary(vals):
    if not vals:
        return "-"
    return f"{statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="connrate,failover")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "builds")
    ap.add_argument("--migration-mb", type=int, default=10,
                    help="MiB of ballast of the migrated sender (default 10)")
    ap.add_argument("--migration-reps", type=int, default=3,
                    help="migrations per build and round (default 3)")
    ap.add_argument("--scale-conns", type=int, default=10000,
                    help="connections of the scale figure (default 10000)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    only = [x.strip() for x in a.only.split(",") if x.strip()]
    bench_only = ",".join(x for x in only if x not in ("migration", "scale"))
    got = {"old": [], "new": []}
    for i in range(a.rounds):
        for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
            d = a.old if which == "old" else a.new
            print(f"round {i + 1}/{a.rounds}: {which} ({d})", flush=True)
            b = run(d, bench_only, a.out / f"{which}-{i}") if bench_only else {}
            mig = None
            if "migration" in only:
                mdir = a.out / f"{which}-{i}" / "migration"
                mdir.mkdir(parents=True, exist_ok=True)
                mig = run_migration(d, a.migration_mb, a.migration_reps, mdir)
            sc = None
            if "scale" in only:
                sdir = a.out / f"{which}-{i}" / "scale"
                sdir.mkdir(parents=True, exist_ok=True)
                sc = run_scale(d, a.scale_conns, sdir)
            got[which].append(figures(b, mig, sc))
            # What is known so far, in case the run is cut short.
            (a.out / "builds.json").write_text(json.dumps(got, indent=1))
    names = sorted({k for side in got.values() for f in side for k in f})
    lines = [f"# Two builds side by side ({a.rounds} alternating rounds; median (range), values)",
             "", f"old: `{a.old}`  ", f"new: `{a.new}`", "",
             "| figure | old | new | new/old (medians) | values old / new |",
             "| --- | --- | --- | --- | --- |"]
    for n in names:
        o = [v for f in got["old"] for v in f.get(n, [])]
        w = [v for f in got["new"] for v in f.get(n, [])]
        if n == "migration failed runs":
            lines.append(f"| {n} | {len(o)} | {len(w)} | - | |")
            continue
        ratio = (f"{statistics.median(w) / statistics.median(o):.2f}"
                 if o and w and statistics.median(o) else "-")
        lines.append(f"| {n} | {summary(o)} | {summary(w)} | {ratio} | {len(o)} / {len(w)} |")
    md = "\n".join(lines) + "\n"
    (a.out / "builds.md").write_text(md)
    (a.out / "builds.json").write_text(json.dumps(got, indent=1))
    print(md)


if __name__ == "__main__":
    main()
