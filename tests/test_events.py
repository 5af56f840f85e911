"""`vmictl events`: what happened on a node, followed live through a failover (connection made,
path dead, link rebuilt, path alive, connection closed), read back afterwards, and seen by
another user only as far as it concerns the node or that user's own processes."""

import json
import subprocess
import time

from helpers import (ETH0, H1, H1_IP, H2, H2_IP, NOBODY, VMICTL_BIN, block_port, host_argv,
                     public_copies, rated_stream, vmictl, wait_paths_alive, wait_status)

MiB = 1 << 20


def follow(procs, host):
    return procs.start(host, [VMICTL_BIN, "events", "--follow", "--json"], layer=False,
                       name=f"events-{host}")


def lines(proc):
    return [json.loads(x) for x in proc.stdout().splitlines() if x.startswith("{")]


def test_events_follow_a_failover(procs, faults):
    followers = {h: follow(procs, h) for h in (H1, H2)}
    time.sleep(0.5)
    cli, addr = rated_stream(procs, H1, H1_IP, H2, block_port("cluster", 10), 48 * MiB, 8 * MiB)
    gid = wait_status(H1, lambda s: next((c["gid"] for c in s["connections"]
                                          if c["local"] == addr), None), 10, "connection")
    time.sleep(1.0)
    faults.link_down(H2, ETH0)
    wait_status(H1, lambda s: any(c["gid"] == gid and c["failovers"] >= 1
                                  for c in s["connections"]), 10, "the connection failed over")
    # Host 2 sees its link go at once; host 1 after 50 ms of silence.
    wait_status(H1, lambda s: "dead" in [p["state"] for p in s["paths"] if p["peer"] == H2_IP],
                10, f"the path to {H2_IP} dead")
    faults.link_up(H2, ETH0)
    assert wait_paths_alive([H1, H2]), "paths did not come back"
    cli.wait(timeout=40)
    time.sleep(1.0)
    seen = {}
    for h, f in followers.items():
        f.stop()
        seen[h] = lines(f)
    mine = {h: [e for e in ev if e.get("gid") == gid] for h, ev in seen.items()}
    assert any(e["kind"] == "connection" and e["side"] == "in" for e in mine[H1]), mine[H1]
    assert any(e["kind"] == "connection" and e["side"] == "out" for e in mine[H2]), mine[H2]
    assert any(e["kind"] == "relink" for h in mine for e in mine[h]), mine
    assert any(e["kind"] == "closed" for e in mine[H1]), mine[H1]
    paths = [(e["peer"], e["state"]) for e in seen[H1] if e["kind"] == "path"]
    assert (H2_IP, "dead") in paths and (H2_IP, "alive") in paths, paths
    assert paths.index((H2_IP, "dead")) < len(paths) - 1 - paths[::-1].index((H2_IP, "alive"))
    seqs = [e["seq"] for e in seen[H1]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "events out of order"
    # Read back later, without following: the same events are kept.
    r = vmictl(H1, "events", "--json", timeout=10)
    assert r.returncode == 0, r.stderr
    back = [json.loads(x) for x in r.stdout.splitlines()]
    assert {e["seq"] for e in seen[H1]} <= {e["seq"] for e in back}
    text = vmictl(H1, "events", timeout=10).stdout
    assert f"gid={gid}" in text and "relink" in text + vmictl(H2, "events").stdout, text[-2000:]
    # Another user sees the node's events, not those of root's processes.
    with public_copies(VMICTL_BIN) as d:
        r = subprocess.run(host_argv(H1, ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                          "--clear-groups", d / "vmictl", "events", "--json"],
                                     {}), capture_output=True, text=True, timeout=15)
    assert r.returncode == 0, r.stderr
    theirs = [json.loads(x) for x in r.stdout.splitlines()]
    assert any(e["kind"] == "path" for e in theirs), theirs[-5:]
    assert not any(e.get("gid") == gid for e in theirs), [e for e in theirs if "gid" in e][:5]
