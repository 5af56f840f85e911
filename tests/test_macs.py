"""The agent learns the MAC addresses the Myrinet-style sink needs: its own interface's MAC
address and MTU on every network, and the peer's MAC address on every path (from the kernel's
neighbour table, which the heartbeats fill), exactly as `ip -j link show` says on each side.

Two nodes in namespaces of their own (vmimac1, vmimac2), each on two networks through the
bridges of a third namespace (vmimac-br); all of them, and the agents, gone when the test ends
(pass or fail).
"""

import json
import time

import pytest

from helpers import (AGENT_BIN, VMICTL_BIN, AgentProc, capture as run, clean_env,
                     in_netns as in_ns)

NODES = ("vmimac1", "vmimac2")
BRIDGE_NS = "vmimac-br"
NETS = ("10.81.0", "10.81.1")
SOCK = "vmimac"
TIMEOUT = 15.0


def sh(*argv):
    r = run(argv)
    assert r.returncode == 0, f"{' '.join(map(str, argv))}: {r.stderr}"
    return r.stdout


def dev(node, net):
    """The interface of node (1 or 2) on network net (0 or 1); its bridge port is b<node>n<net>."""
    return f"m{node}n{net}"


def ip_of(node, net):
    return f"{NETS[net]}.{node}"


def links(ns):
    """{interface: (MAC address, MTU)} as `ip -j link show` in ns says."""
    return {l["ifname"]: (l.get("address"), l.get("mtu")) for l in json.loads(sh("ip", "-n", ns, "-j", "link", "show"))}


def status(ns, *extra):
    r = in_ns(ns, [VMICTL_BIN, "--socket", SOCK, *extra, "status", "--json"], env=clean_env())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def status_text(ns):
    r = in_ns(ns, [VMICTL_BIN, "--socket", SOCK, "status"], env=clean_env())
    assert r.returncode == 0, r.stderr
    return r.stdout


def wait(what, check, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        ok, last = check()
        if ok:
            return last
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout} s: {last}")


def delete_namespaces():
    for ns in (*NODES, BRIDGE_NS):
        run(["ip", "netns", "del", ns])


@pytest.fixture
def macnet(tmp_path):
    """The two nodes on their two networks, an agent on each; everything removed at the end."""
    agents = []
    delete_namespaces()
    try:
        for ns in (*NODES, BRIDGE_NS):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        for net in (0, 1):
            sh("ip", "-n", BRIDGE_NS, "link", "add", f"br{net}", "type", "bridge")
            sh("ip", "-n", BRIDGE_NS, "link", "set", f"br{net}", "up")
            for node in (1, 2):
                ns, d, port = NODES[node - 1], dev(node, net), f"b{node}n{net}"
                sh("ip", "link", "add", d, "netns", ns, "type", "veth", "peer", "name", port, "netns", BRIDGE_NS)
                sh("ip", "-n", BRIDGE_NS, "link", "set", port, "master", f"br{net}")
                sh("ip", "-n", BRIDGE_NS, "link", "set", port, "up")
                sh("ip", "-n", ns, "addr", "add", f"{ip_of(node, net)}/24", "dev", d)
                sh("ip", "-n", ns, "link", "set", d, "up")
        key = tmp_path / "cluster.key"
        sh(AGENT_BIN, "--init", "--key", key)
        for node in (1, 2):
            other = 3 - node
            ns = NODES[node - 1]
            a = AgentProc(ns, ["--key", key, "--socket", SOCK, "--node", f"mac{node}",
                               "--peers", f"{ip_of(other, 0)},{ip_of(other, 1)}",
                               "--probe-interval", "10", "--dead-after", "200"], tmp_path, ns)
            agents.append(a)
        for a in agents:
            a.wait_ready()
        yield agents
    finally:
        for a in agents:
            a.stop()
        delete_namespaces()


def paths_alive(ns):
    s = status(ns)
    peers = {p["peer"] for p in s["paths"] if p["state"] == "alive"}
    return {ip_of(2 if ns == NODES[0] else 1, n) for n in (0, 1)} <= peers, s["paths"]


def test_own_and_peer_mac_addresses_and_mtu_as_the_kernel_says(macnet):
    for ns in NODES:
        wait(f"both paths alive in {ns}", lambda: paths_alive(ns))
    mine, theirs = links(NODES[0]), links(NODES[1])

    def networks_as_ip_says():
        nets = {n["name"]: n for n in status(NODES[0])["networks"]}
        want = {dev(1, net): {"addr": ip_of(1, net), "mac": mine[dev(1, net)][0], "mtu": mine[dev(1, net)][1]}
                for net in (0, 1)}
        got = {d: {k: nets.get(d, {}).get(k) for k in ("addr", "mac", "mtu")} for d in want}
        return got == want, (got, want)

    wait("vmimac1's own MAC and MTU per network", networks_as_ip_says)

    def peer_macs_as_ip_says():
        paths = status(NODES[0])["paths"]
        got = {p["peer"]: (p["network"], p["peer_mac"]) for p in paths if p["node"] == "mac2"}
        want = {ip_of(2, net): (dev(1, net), theirs[dev(2, net)][0]) for net in (0, 1)}
        return got == want, (got, want)

    wait("the peer's MAC on every path from vmimac1", peer_macs_as_ip_says)
    # Both reports say the same, and the table too.
    cluster = status(NODES[0], "--cluster")
    me = next(n for n in cluster["nodes"] if n["node"] == "mac1")
    assert {p["peer"]: p["peer_mac"] for p in me["paths"]} == {ip_of(2, n): theirs[dev(2, n)][0] for n in (0, 1)}
    assert {n["name"]: n["mac"] for n in me["networks"]} == {dev(1, n): mine[dev(1, n)][0] for n in (0, 1)}
    text = status_text(NODES[0])
    for net in (0, 1):
        assert mine[dev(1, net)][0] in text and theirs[dev(2, net)][0] in text, text

    # Jumbo frames on the second network, on both sides (and the bridge ports between them).
    for node in (1, 2):
        sh("ip", "-n", BRIDGE_NS, "link", "set", f"b{node}n1", "mtu", "9000")
        sh("ip", "-n", NODES[node - 1], "link", "set", dev(node, 1), "mtu", "9000")
    mine = links(NODES[0])
    assert mine[dev(1, 1)][1] == 9000 and links(NODES[1])[dev(2, 1)][1] == 9000
    wait("MTU 9000 on the second network", networks_as_ip_says)
    assert {n["name"]: n["mtu"] for n in status(NODES[1])["networks"]} == {dev(2, 0): 1500, dev(2, 1): 9000}
    assert "mtu 9000" in status_text(NODES[0])


def test_a_missing_neighbour_entry_is_reported_as_unknown(macnet):
    """A path whose peer has no complete neighbour entry shows no MAC (null, "-"), never a
    guess: the peer's address on the second network is taken away, so its path dies and the
    kernel's entry fails."""
    wait("both paths alive in vmimac1", lambda: paths_alive(NODES[0]))
    theirs = links(NODES[1])
    wait("the peer's MACs", lambda: (lambda p: (all(x["peer_mac"] for x in p), p))(status(NODES[0])["paths"]))
    sh("ip", "-n", NODES[1], "link", "set", dev(2, 1), "down")
    sh("ip", "-n", NODES[0], "neigh", "flush", "dev", dev(1, 1))

    def gone():
        paths = {p["peer"]: p for p in status(NODES[0])["paths"]}
        lost, kept = paths.get(ip_of(2, 1), {}), paths.get(ip_of(2, 0), {})
        ok = ("peer_mac" in lost and lost["peer_mac"] is None and lost["state"] == "dead"
              and kept.get("peer_mac") == theirs[dev(2, 0)][0])
        return ok, paths

    wait("no MAC for the dead path, the other one kept", gone)
    line = next(l for l in status_text(NODES[0]).splitlines() if f"-> {ip_of(2, 1)} " in l)
    assert " - " in line, line
