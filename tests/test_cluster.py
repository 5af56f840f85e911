"""The cluster as one, through the agents' encrypted channels: `vmictl --node` runs a command
on another node, `vmictl --cluster status` shows every node the agent knows, `vmictl where`
finds both ends of a connection; only root changes another node; a node whose agent died is
listed as unreachable and comes back with its agent."""

import json
import time

from helpers import (ETH0, ETH1, H1, H1_IP, H2, H2_IP, H3, H3_IP, block_port, extra_agent, metric,
                     python_prog, rated_stream, scrape_metrics, vmictl, vmictl_as_nobody,
                     wait_status)

MiB = 1 << 20


def port(i):
    return block_port("cluster", i)


def ctl_json(host, *args):
    r = vmictl(host, *args, "--json", timeout=15)
    assert r.returncode == 0, f"vmictl {args} in {host}: {r.stderr}{r.stdout}"
    return json.loads(r.stdout)


def node_name(host):
    return ctl_json(host, "status")["node"]


def test_commands_on_another_node(procs):
    h2 = node_name(H2)
    st = ctl_json(H1, "--node", H2_IP, "status")
    assert st["node"] == h2 and st["networks"], st
    # By name once the nodes heard each other (a connection makes them probe).
    p = port(0)
    addr = f"{H2_IP}:{p}"
    procs.server(H2, python_prog("stream.py", "server", "--bind", addr, "--count", "1"), p,
                 layer=True, name="server")
    procs.run(H1, python_prog("stream.py", "client", "--connect", addr, "--bytes", MiB,
                              "--seed", p), layer=True, name="client", timeout=30)
    wait_status(H1, lambda s: any(x["node"] == h2 for x in s["paths"]), 10, f"{h2} heard")
    r = vmictl(H1, "--node", h2, "net", "down", ETH1)
    assert r.returncode == 0, r.stderr
    try:
        nets = {n["name"]: n["admin"] for n in ctl_json(H2, "status")["networks"]}
        assert nets[ETH1] == "down", nets
    finally:
        r = vmictl(H1, "--node", h2, "net", "up", ETH1)
    assert r.returncode == 0, r.stderr
    nets = {n["name"]: n["admin"] for n in ctl_json(H2, "status")["networks"]}
    assert nets[ETH1] == "up", nets
    # Not root on the asking node: refused there, nothing changes.
    r = vmictl_as_nobody(H1, "--node", h2, "net", "down", ETH1)
    assert r.returncode != 0 and "not allowed" in r.stderr + r.stdout, r
    nets = {n["name"]: n["admin"] for n in ctl_json(H2, "status")["networks"]}
    assert nets[ETH1] == "up", nets
    r = vmictl(H1, "--node", "no-such-node", "status")
    assert r.returncode != 0 and "no node no-such-node" in r.stderr, r.stderr


def whole_cluster(host, names):
    """`vmictl --cluster status --json` in host once it lists exactly the nodes `names`, all
    answering (polled up to 10 s); None if it never does."""
    for _ in range(50):
        c = ctl_json(host, "--cluster", "status")
        if {n["node"] for n in c["nodes"]} == set(names) and not c["unreachable"]:
            return c
        time.sleep(0.2)
    return None


def test_cluster_status_and_where_a_connection_lives(procs, agent_control, tmp_path):
    with extra_agent(H3, tmp_path, "agent-h3", args=["--peers", f"{H1_IP},{H2_IP}"]):
        names = {h: node_name(h) for h in (H1, H2, H3)}
        # A connection between hosts 1 and 2, alive while the cluster is looked at.
        cli, addr = rated_stream(procs, H1, H1_IP, H2, port(1), 32 * MiB, 4 * MiB)
        gid = wait_status(H1, lambda s: next((c["gid"] for c in s["connections"]
                                              if c["local"] == addr), None), 10, "connection")
        # The GID says which cluster issued it: the cluster id, the key fingerprint's first
        # four hexadecimal digits.
        mesh = ctl_json(H2, "status")["mesh"]
        assert gid[:4] == mesh["cluster_id"] == mesh["key"][:4], (gid, mesh)
        # Host 3 knows hosts 1 and 2 from --peers only (no connection of its own).
        assert whole_cluster(H3, names.values()), "host 3 does not see the whole cluster"
        ends = ctl_json(H3, "where", gid)
        assert sorted(e["node"] for e in ends) == sorted([names[H1], names[H2]]), ends
        assert {e["direction"] for e in ends} == {"in", "out"}, ends
        text = vmictl(H3, "--cluster", "status", timeout=15).stdout
        for n in names.values():
            assert n in text, text
        # A node whose agent died is unreachable, and answers again once it is back.
        agent_control.kill(H2)
        c = ctl_json(H3, "--cluster", "status")
        assert [u["node"] for u in c["unreachable"]] == [names[H2]], c["unreachable"]
        agent_control.restore()
        assert whole_cluster(H3, names.values()), "host 2 did not come back in the cluster view"
        cli.wait(timeout=30)


def test_metrics_for_prometheus(procs, tmp_path):
    maddr = "127.0.0.1:19787"
    with extra_agent(H3, tmp_path, "agent-metrics", args=["--metrics", maddr]):
        text = scrape_metrics(H3, maddr)
        assert text.rstrip().endswith("# EOF"), text[-200:]
        assert "# TYPE vmi_refused counter" in text and "# TYPE vmi_processes gauge" in text
        assert metric(text, "vmi_processes") == 0
        cli, addr = rated_stream(procs, H3, H3_IP, H1, port(2), 16 * MiB, 8 * MiB)
        wait_status(H3, lambda s: any(c["local"] == addr for c in s["connections"]), 10,
                    "the connection")
        procs.run(H2, python_prog("stranger.py", "clear-connect", "--target", f"{H3_IP}:7787",
                                  "--src", f"{H2_IP}:{port(3)}", "--dst", addr),
                  layer=False, name="clear-connect")
        text = scrape_metrics(H3, maddr)
        assert "# TYPE vmi_connections gauge" in text and "# TYPE vmi_events counter" in text
        assert metric(text, "vmi_connections", substrate="tcp", link="up") == 1, text
        assert metric(text, "vmi_processes") == 1
        assert metric(text, "vmi_events_total", kind="connection") >= 1
        assert metric(text, "vmi_refused_total", kind="clear") == 1
        assert metric(text, "vmi_paths", network=ETH0, state="alive") >= 1
        assert metric(text, "vmi_open_connection_bytes", substrate="tcp",
                      direction="received") > 0
        assert "gid" not in text.lower()
        cli.wait(timeout=30)
