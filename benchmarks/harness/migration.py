#!/usr/bin/env python3
"""Migration downtime: a process under the layer streams to a peer while vmi-migrate moves it
to another host with CRIU; the peer measures how long its receive side stood still.

    sudo python3 benchmarks/harness/migration.py [--sizes 10,100,1000] [--reps 2] [--out DIR]
                                                 [--bin-dir DIR]

Three namespace hosts (scripts/topo.sh, prefix vmimb, networks 10.93.0/24 and 10.93.1/24), a
vmi-agent in each. For each size S (MiB of resident memory the sender holds) and repetition:

* receiver: benchmarks/programs/failover_stream.py recv in host 2, under the layer;
* sender: failover_stream.py send --ballast-mb S in host 1, under the layer, streaming at full
  speed; after 1 s it is migrated to host 3 (`vmi-migrate PID --to vmimb3 --json`);
* downtime = the receiver's longest gap between two receives (last byte before the dump to
  the first byte after the restore), beside vmi-migrate's phases: freeze, dump, transfer,
  restore, thaw (reconnect and replay), the image size and the bytes replayed. The stream's
  SHA-256 must be equal at both ends and no byte may be out of place.

Prints a table, writes migration.json and (with matplotlib) migration.png in --out.
--bin-dir takes libvmi_preload.so, vmi-agent and vmi-migrate from another build (default
target/release); builds.py uses it to put two builds side by side. An agent from before the
cluster key (no `--init`) runs without one.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REL = REPO / "target" / "release"
LIB, AGENT, MIGRATE = REL / "libvmi_preload.so", REL / "vmi-agent", REL / "vmi-migrate"


def use_bin_dir(d):
    global REL, LIB, AGENT, MIGRATE
    REL = Path(d).resolve()
    LIB, AGENT, MIGRATE = REL / "libvmi_preload.so", REL / "vmi-agent", REL / "vmi-migrate"
STREAM = REPO / "benchmarks" / "programs" / "failover_stream.py"
TOPO = REPO / "scripts" / "topo.sh"
PREFIX = "vmimb"
NET0, NET1 = "10.93.0", "10.93.1"
PORT = 18801


def host(i):
    return f"{PREFIX}{i}"


def topo(*args):
    env = dict(os.environ, VMI_NET0=NET0, VMI_NET1=NET1)
    subprocess.run([str(TOPO), *args], env=env, check=True, stdout=subprocess.DEVNULL)


def start(h, argv, out, err, layer=True, extra_env=None):
    env = ["env", "-u", "LD_PRELOAD"]
    if layer:
        env += [f"LD_PRELOAD={LIB}", "VMI_LOG=warn"]
    env += [f"{k}={v}" for k, v in (extra_env or {}).items()]
    return subprocess.Popen(["nsenter", f"--net=/run/netns/{h}", *env, *map(str, argv)],
                            stdin=subprocess.DEVNULL, stdout=open(out, "wb"),
                            stderr=open(err, "wb"), start_new_session=True)


def kill(p):
    if p is None:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=3)
    except subprocess.TimeoutExpired:
        pass


def json_lines(path):
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def wait_event(path, event, timeout, pid=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for j in json_lines(path):
            if j.get("event") == event:
                if pid is None or not Path(f"/proc/{pid}").exists() or \
                        Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
                    return j
        time.sleep(0.05)
    return None


def rss_mb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def one(size, rep, logdir):
    tag = f"{size}mb-{rep}"
    recv_out, send_out = logdir / f"recv-{tag}.out", logdir / f"send-{tag}.out"
    recv = start(host(2), [sys.executable, STREAM, "recv", "--port", PORT, "--gap-ms", 1],
                 recv_out, logdir / f"recv-{tag}.err")
    send = None
    try:
        if not wait_event(recv_out, "listening", 10):
            raise RuntimeError("receiver did not start")
        seconds = 4 + size / 250
        send = start(host(1), [sys.executable, STREAM, "send", "--connect", f"{NET0}.2", "--port",
                               PORT, "--seconds", seconds, "--ballast-mb", size],
                     send_out, logdir / f"send-{tag}.err")
        if not wait_event(send_out, "streaming", 30):
            raise RuntimeError("sender did not start streaming")
        time.sleep(1.0)
        rss = rss_mb(send.pid)
        stop = threading.Event()

        def reap():  # the original is our child: its pid must be free for the restore
            while not stop.is_set():
                send.poll()
                time.sleep(0.005)
        t = threading.Thread(target=reap, daemon=True)
        t.start()
        r = subprocess.run([str(MIGRATE), str(send.pid), "--to", host(3), "--json"],
                           capture_output=True, text=True, timeout=300)
        stop.set()
        t.join()
        rep_lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
        mig = json.loads(rep_lines[-1]) if rep_lines else {"ok": False, "outcome": r.stderr}
        done_r = wait_event(recv_out, "done", seconds + 60)
        done_s = wait_event(send_out, "done", 30, pid=send.pid)
        if not (done_r and done_s):
            raise RuntimeError(f"stream did not finish: recv {done_r}, send {done_s}; "
                               f"migration {mig}")
        intact = (done_r["sha256"] == done_s["sha256"] and done_r["bytes"] == done_s["bytes"]
                  and done_r.get("mismatch_at") is None and not done_r.get("error")
                  and not done_s.get("error"))
        return {
            "size_mb": size, "rep": rep, "rss_mb": round(rss, 1), "ok": bool(mig.get("ok")),
            "intact": intact, "downtime_ms": done_r["max_gap_ms"],
            "image_mb": round(mig.get("image_bytes", 0) / 2**20, 1),
            **{k: mig.get(f"{k}_ms") for k in ("freeze", "dump", "transfer", "restore", "thaw")},
            "reconnect_ms": mig.get("reconnect_ms"), "bytes_replayed": mig.get("bytes_replayed"),
            "bytes": done_r["bytes"], "outcome": mig.get("outcome"),
        }
    finally:
        kill(send)
        kill(recv)
        if send is not None:  # the restored copy keeps the original's process group
            try:
                os.killpg(send.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot)")
        return
    sizes = sorted({r["size_mb"] for r in rows})
    phases = ["freeze", "dump", "transfer", "restore", "thaw"]
    med = {}
    for s in sizes:
        rs = [r for r in rows if r["size_mb"] == s]
        med[s] = {p: sorted(r[p] or 0 for r in rs)[len(rs) // 2] for p in phases + ["downtime_ms"]}
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(sizes))
    bottom = [0.0] * len(sizes)
    for p in phases:
        vals = [med[s][p] for s in sizes]
        ax.bar([i - 0.2 for i in x], vals, 0.4, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar([i + 0.2 for i in x], [med[s]["downtime_ms"] for s in sizes], 0.4, color="black",
           label="downtime seen by the peer")
    ax.set_xticks(list(x), [f"{s} MiB ballast" for s in sizes])
    ax.set_ylabel("ms (median)")
    ax.set_title("vmi-migrate: phases vs the peer's receive gap")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10,100,1000")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "migration"))
    ap.add_argument("--bin-dir", default=str(REL),
                    help="folder with libvmi_preload.so, vmi-agent, vmi-migrate")
    a = ap.parse_args()
    use_bin_dir(a.bin_dir)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logdir = out / "logs"
    logdir.mkdir(exist_ok=True)
    for b in (LIB, AGENT, MIGRATE):
        if not b.exists():
            sys.exit(f"{b} missing: cargo build --release")
    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    topo("down-all", PREFIX)
    agents = []
    rows = []
    try:
        topo("up", "3", PREFIX)
        key = logdir / "cluster.key"
        key.unlink(missing_ok=True)
        # An agent from before the cluster key has no --init and ignores VMI_CLUSTER_KEY.
        init = subprocess.run([str(AGENT), "--init", "--key", str(key)], capture_output=True)
        env = {"VMI_LOG": "info"}
        if init.returncode == 0:
            env["VMI_CLUSTER_KEY"] = key
        for i in (1, 2, 3):
            agents.append(start(host(i), [AGENT], logdir / f"agent{i}.out",
                                logdir / f"agent{i}.err", layer=False, extra_env=env))
        time.sleep(1.0)
        for size in [int(s) for s in a.sizes.split(",")]:
            for rep in range(a.reps):
                row = one(size, rep, logdir)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for p in agents:
            kill(p)
        topo("down", "3", PREFIX)
    (out / "migration.json").write_text(json.dumps(rows, indent=1))
    cols = ["size_mb", "rss_mb", "image_mb", "freeze", "dump", "transfer", "restore", "thaw",
            "downtime_ms", "bytes_replayed", "intact"]
    print("\n| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c)) for c in cols) + " |")
    plot(rows, out / "migration.png")
    bad = [r for r in rows if not (r["ok"] and r["intact"])]
    if bad:
        print(f"FAILED runs: {bad}")
        sys.exit(1)


if __name__ == "__main__":
    main()
