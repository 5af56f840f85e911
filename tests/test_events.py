"""`vmictl events`: what happened on a node, followed live through a failover (connection made,
path dead, link rebuilt, path alive, connection closed), read back afterwards, and seen by
another user only as far as it concerns the node or that user's own processes."""

import json
import time

from helpers import (ETH0, H1, H1_IP, H2, H2_IP, H3, H3_IP, VMICTL_BIN, block_port, extra_agent,
                     metric_samples, rated_stream, scrape_metrics, vmictl, vmictl_as_nobody,
                     wait_paths_alive, wait_status)

MiB = 1 << 20


def follow(procs, host):
    return procs.start(host, [VMICTL_BIN, "events", "--follow", "--json"], layer=False,
                       name=f"events-{host}")


def lines(proc):
    return [json.loads(x) for x in proc.stdout().splitlines() if x.startswith("{")]


def vmictl_json(host, *args):
    r = vmictl(host, *args, "--json", timeout=15)
    assert r.returncode == 0, f"vmictl {args} in {host}: {r.stderr}{r.stdout}"
    return json.loads(r.stdout)


def wait_cluster(host, ok, seconds=10):
    """`vmictl --cluster status --json` in host, as {node: its report}, once ok(it) holds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        view = {n["node"]: n for n in vmictl_json(host, "--cluster", "status")["nodes"]}
        try:
            if ok(view):
                return view
        except KeyError:
            pass
        time.sleep(0.2)
    return None


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
    # The cluster view, right after the failover and seen from host 1: host 2's own report
    # (through the other network) has the path to host 1 dead and both ends have failed over.
    names = {h: vmictl_json(h, "status")["node"] for h in (H1, H2)}
    view = wait_cluster(H1, lambda v: (
        any(p["peer"] == H1_IP and p["state"] == "dead" for p in v[names[H2]]["paths"])
        and all(any(c["gid"] == gid and c["failovers"] >= 1 for c in v[n]["connections"])
                for n in names.values())))
    assert view, "the cluster view did not show the failover"
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
    # The failover as each side's process felt it: one side dialed the new link, the other
    # was handed it; the dialer stood still from its failure to the rebuilt link.
    fo = {e["side"]: e for h in mine for e in mine[h] if e["kind"] == "failover"}
    assert set(fo) == {"dialer", "holder"}, mine
    # (In whole milliseconds since the process marked its link down: a link rebuilt within
    # the same millisecond reads 0.)
    assert 0 <= fo["dialer"]["stall_ms"] < 15000, fo
    assert fo["dialer"]["local"].split(":")[0] != "0.0.0.0", fo
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
    r = vmictl_as_nobody(H1, "events", "--json")
    assert r.returncode == 0, r.stderr
    theirs = [json.loads(x) for x in r.stdout.splitlines()]
    assert any(e["kind"] == "path" for e in theirs), theirs[-5:]
    assert not any(e.get("gid") == gid for e in theirs), [e for e in theirs if "gid" in e][:5]


def test_failover_stall_in_events_and_metrics(procs, faults, tmp_path):
    """Each failover's stall and replayed bytes reach the node's events and its Prometheus
    relink-time histogram, which agree with each other."""
    maddr = "127.0.0.1:19788"
    with extra_agent(H3, tmp_path, "agent-relinks", args=["--metrics", maddr]):
        text = scrape_metrics(H3, maddr)
        assert "# TYPE vmi_relink_seconds histogram" in text, text[-800:]
        zero = metric_samples(text, "vmi_relink_seconds_count")
        assert len(zero) == 2 and not any(zero.values()), zero
        cli, addr = rated_stream(procs, H3, H3_IP, H1, block_port("cluster", 11), 40 * MiB,
                                 8 * MiB)
        gid = wait_status(H3, lambda s: next((c["gid"] for c in s["connections"]
                                              if c["local"] == addr), None), 10, "connection")
        time.sleep(1.0)
        faults.link_down(H3, ETH0)
        wait_status(H3, lambda s: any(c["gid"] == gid and c["failovers"] >= 1
                                      for c in s["connections"]), 10, "the failover")
        faults.link_up(H3, ETH0)
        cli.wait(timeout=40)
        r = vmictl(H3, "events", "--json", timeout=10)
        assert r.returncode == 0, r.stderr
        fo = [e for e in map(json.loads, r.stdout.splitlines())
              if e["kind"] == "failover" and e["gid"] == gid]
        assert fo and all(0 <= e["stall_ms"] < 15000 for e in fo), fo
        text = scrape_metrics(H3, maddr)
        count = sum(metric_samples(text, "vmi_relink_seconds_count").values())
        total = sum(metric_samples(text, "vmi_relink_seconds_sum").values())
        assert count == len(fo), (count, fo)
        assert abs(total - sum(e["stall_ms"] for e in fo) / 1000) < 0.001, (total, fo)
        replayed = sum(metric_samples(text, "vmi_replayed_bytes_total").values())
        assert replayed == sum(e["replayed"] for e in fo), (replayed, fo)
        buckets = metric_samples(text, "vmi_relink_seconds_bucket")
        assert max(buckets.values()) == count and len(buckets) >= 17, buckets
        assert "gid" not in text.lower()
