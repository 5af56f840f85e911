#!/usr/bin/env python3
"""Two builds of vmi side by side in one run: bench.py alternates between them, round after
round, and the layer's figures of each are put in one table (median and range).

    benchmarks/harness/builds.py --old DIR --new DIR [--rounds N] [--only connrate,failover,calls]
                                 [--out DIR]

DIR is a folder with libvmi_preload.so, vmi-agent, vmictl and the benchmark programs (a
`target/release` of each build). Each round runs `bench.py --only ... --reps 1` once with
each build, in alternating order (old first in even rounds), so a machine that gets slower
or faster during the run weighs on both alike. The figures are the layer's (the native
baseline of each bench.py run is printed too, as a check that the machine did not change):

- connrate: connections set up per second, sequentially, by one client (`connrate`);
- failover: the longest receive stall after a network fails mid-stream, loud (link down) and
  silent (veth off its bridge), in ms;
- calls: nanoseconds per write/read/write/read round trip on one connection held by one
  process (`vc_calls`, 64 B, 1 KiB, 16 KiB), the layer's cost per call with no wake-up in
  the way.

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


def figures(b):
    """{figure name: value} of one bench.py result."""
    f = {}
    for r in b.get("connrate", {}).get("runs", []):
        f[f"connrate {r['mode']} (conn/s)"] = r["conns_per_sec"]
    for r in b.get("failover", {}).get("runs", []):
        f[f"failover {r['kind']} {r['mode']} stall (ms)"] = r["stall_ms"]
    for r in b.get("calls", {}).get("runs", []):
        for size in (64, 1024, 16384):
            if f"rt_{size}_ns" in r:
                f[f"calls {size} B {r['mode']} (ns per round trip)"] = r[f"rt_{size}_ns"]
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
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    got = {"old": [], "new": []}
    for i in range(a.rounds):
        for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
            d = a.old if which == "old" else a.new
            print(f"round {i + 1}/{a.rounds}: {which} ({d})", flush=True)
            got[which].append(figures(run(d, a.only, a.out / f"{which}-{i}")))
    names = sorted({k for side in got.values() for f in side for k in f})
    lines = [f"# Two builds side by side ({a.rounds} alternating rounds; median (range))", "",
             f"old: `{a.old}`  ", f"new: `{a.new}`", "",
             "| figure | old | new | new/old (medians) |", "| --- | --- | --- | --- |"]
    for n in names:
        o = [f[n] for f in got["old"] if n in f]
        w = [f[n] for f in got["new"] if n in f]
        ratio = (f"{statistics.median(w) / statistics.median(o):.2f}"
                 if o and w and statistics.median(o) else "-")
        lines.append(f"| {n} | {summary(o)} | {summary(w)} | {ratio} |")
    md = "\n".join(lines) + "\n"
    (a.out / "builds.md").write_text(md)
    (a.out / "builds.json").write_text(json.dumps(got, indent=1))
    print(md)


if __name__ == "__main__":
    main()
