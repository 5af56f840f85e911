"""Above the node: other nodes' events, cluster heads and a grid view over two clusters.

Hosts of their own (network namespaces vmihx1..6 on one bridge in a seventh, vmihx-sw; all
deleted when the module ends, pass or fail, and at exit):

* cluster A, one key: a1 (vmihx1, the head), a2, a3; every node has `--head` a1;
* cluster B, another key: b1 (vmihx4, the head), b2;
* ops (vmihx6): holds A's key, knows A's nodes from `--peers` but has no head (its
  `--cluster status` asks every node: the fan-out answer), and is the grid view over A and
  B (`--grid a=HEAD@KEY_A --grid b=HEAD@KEY_B`).

A virtual connection under the layer from a3 to a2 moves bytes all along. The suite's
shared hosts (vmit*) are not used.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import time

import pytest

import helpers
from helpers import (AGENT_BIN, NOBODY, PRELOAD_LIB, PROGRAMS, PYTHON, VMICTL_BIN, AgentProc, Group,
                     build_star, capture as run, clean_env, delete_star, in_netns, public_copies,
                     require_root_and_build)

PREFIX = "vmihx"
NODES = {"a1": 1, "a2": 2, "a3": 3, "b1": 4, "b2": 5, "ops": 6}
CLUSTER_A = ("a1", "a2", "a3")
CLUSTER_B = ("b1", "b2")
SERVER_PORT = 9200
WAIT = 10.0


def ns(node):
    return f"{PREFIX}{NODES[node]}"


def ip(node):
    return f"10.252.0.{NODES[node]}"


def in_ns(node, argv, **kw):
    return in_netns(ns(node), argv, **kw)


def vmictl(node, *args, timeout=20):
    return in_ns(node, [VMICTL_BIN, *args], env=clean_env(), timeout=timeout)


def ctl_json(node, *args):
    r = vmictl(node, *args, "--json")
    assert r.returncode == 0, f"vmictl {args} on {node}: {r.stderr}{r.stdout}"
    return json.loads(r.stdout)


def events(node, *args):
    """`vmictl ... events --json` on node: the list of events."""
    r = vmictl(node, *args, "events", "--json")
    assert r.returncode == 0, f"vmictl {args} events on {node}: {r.stderr}"
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def as_nobody(node, vmictl_copy, *args):
    return in_ns(node, ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        vmictl_copy, *args], env=clean_env())


def wait_for(what, check, timeout=WAIT):
    return helpers.wait_for(what, check, timeout, every=0.2)


def star():
    return {ns(n): (f"hx{i}", f"{ip(n)}/24") for n, i in NODES.items()}


def delete_namespaces():
    delete_star(PREFIX, star())


def build_hosts():
    build_star(PREFIX, star())


class Hx:
    """The module's hosts, agents and programs."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.agents = {}
        self.groups = []
        self.keys = {"a": tmp / "a.key", "b": tmp / "b.key"}
        self.restarts = 0

    def args(self, node):
        a, b = self.keys["a"], self.keys["b"]
        base = ["--config", "/dev/null", "--node", node]
        if node in CLUSTER_A:
            peers = ",".join(ip(n) for n in CLUSTER_A if n != node)
            return [*base, "--key", a, "--peers", peers, "--head", ip("a1")]
        if node in CLUSTER_B:
            peers = ",".join(ip(n) for n in CLUSTER_B if n != node)
            return [*base, "--key", b, "--peers", peers, "--head", ip("b1")]
        return [*base, "--key", a, "--peers", ",".join(ip(n) for n in CLUSTER_A),
                "--grid", f"a={ip('a1')}@{a}", "--grid", f"b={ip('b1')}@{b}"]

    def start(self, node):
        self.restarts += 1
        a = AgentProc(ns(node), [*self.args(node), "--log", "info"], self.tmp, f"agent-{node}-{self.restarts}")
        self.agents[node] = a
        return a

    def kill(self, node):
        a = self.agents[node]
        os.killpg(a.proc.pid, 9)
        a.proc.wait(timeout=5)
        a.stop()

    def program(self, node, argv, name):
        layer = ["env", "-u", "LD_PRELOAD", f"LD_PRELOAD={PRELOAD_LIB}", "VMI_LOG=warn"]
        g = Group(["nsenter", f"--net=/run/netns/{ns(node)}", *layer, *argv], self.tmp / f"{name}.log")
        self.groups.append(g)
        return g

    def close(self):
        for g in self.groups:
            g.stop()
        for a in self.agents.values():
            try:
                a.stop()
            except Exception:
                pass
        delete_namespaces()


@pytest.fixture(scope="module")
def hx(tmp_path_factory):
    require_root_and_build()
    tmp = tmp_path_factory.mktemp("hier")
    h = Hx(tmp)
    atexit.register(h.close)
    try:
        build_hosts()
        for k in h.keys.values():
            run([AGENT_BIN, "--init", "--key", k], check=True, env=clean_env())
        for n in NODES:
            h.start(n)
        for a in h.agents.values():
            a.wait_ready()
        server = f"{ip('a2')}:{SERVER_PORT}"
        h.program("a2", [PYTHON, PROGRAMS / "stream.py", "server", "--bind", server, "--rate", "100000"], "server")
        wait_for("the server listening", lambda: in_ns("a2", ["ss", "-tlnH", f"sport = :{SERVER_PORT}"]).stdout.strip())
        h.client = h.program("a3", [PYTHON, PROGRAMS / "stream.py", "client", "--connect", server, "--bytes",
                                    100_000_000, "--server-bytes", 100_000_000, "--seed", 5, "--rate", 100000],
                             "client")
        h.server_addr = server
        h.gid = wait_for("the connection on a2", lambda: next(
            (c["gid"] for c in ctl_json("a2", "status")["connections"] if c["local"] == server), None))
        yield h
    finally:
        h.close()


def names(status):
    return sorted(n["node"] for n in status["nodes"])


def shape(report):
    """What does not change from one moment to the next in a node's report."""
    return {
        "processes": sorted((p["pid"], p["name"]) for p in report["processes"]),
        "listeners": sorted(x["addr"] for x in report["listeners"]),
        "networks": sorted((x["name"], x["addr"], x["admin"]) for x in report["networks"]),
        "paths": sorted((p["node"], p["local"], p["peer"], p["network"], p["state"]) for p in report["paths"]),
        "connections": sorted((c["gid"], c["pid"], c["local"], c["peer"], c["substrate"], c["direction"],
                               c["network"], c["link"]) for c in report["connections"]),
        "key": report["mesh"]["key"],
    }


def whole_a(node):
    """node's cluster status once it lists cluster A's three nodes, all answering."""
    def check():
        s = ctl_json(node, "--cluster", "status")
        return set(CLUSTER_A) <= set(names(s)) and not s["unreachable"] and s
    return wait_for(f"cluster A whole seen from {node}", check)


def timed(node, *args, n=10):
    """Median seconds of n runs of vmictl ARGS on node."""
    ts = []
    for _ in range(n):
        t = time.monotonic()
        r = vmictl(node, *args)
        ts.append(time.monotonic() - t)
        assert r.returncode == 0, r.stderr
    return sorted(ts)[n // 2]


def test_events_of_other_nodes(hx):
    # The connection's two ends, each on its own node, seen from a1 (where neither is).
    def both_ends():
        evs = events("a1", "--cluster")
        got = {(e["node"], e.get("side")) for e in evs if e["kind"] == "connection" and e.get("gid") == hx.gid}
        return got == {("a2", "in"), ("a3", "out")} and evs
    evs = wait_for("both ends' connection events through --cluster events", both_ends)
    assert all(e.get("node") for e in evs), [e for e in evs if not e.get("node")]
    mine = [e for e in evs if e["node"] == "a1"]
    assert all(e["seq"] >= 1 for e in mine)
    # One node's, named by its name or its address.
    for to in ("a2", ip("a2")):
        evs = events("a1", "--node", to)
        assert evs and {e["node"] for e in evs} == {"a2"}, evs
        assert any(e["kind"] == "connection" and e.get("gid") == hx.gid and e["side"] == "in" for e in evs), evs
    r = vmictl("a1", "--node", "no-such-node", "events")
    assert r.returncode == 1 and "no node no-such-node" in r.stderr, r
    # The text form names the node on each line.
    text = vmictl("a1", "--cluster", "events").stdout
    assert any(line.split()[1] == "a3" and "connection" in line for line in text.splitlines()), text

    with public_copies(VMICTL_BIN) as d:
        ctl = d / "vmictl"
        # A follower on a1 sees a refusal on a3 (a node's own event: everyone sees those).
        follow = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns('a1')}", VMICTL_BIN, "--cluster", "events",
                                   "--follow", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=clean_env(), start_new_session=True)
        try:
            time.sleep(1.5)
            r = as_nobody("a3", ctl, "net", "down", "eth0")
            assert r.returncode == 1 and "not allowed" in r.stderr, r
            t0 = time.monotonic()
            seen = None
            buf = b""
            while time.monotonic() - t0 < 5 and seen is None:
                if select.select([follow.stdout], [], [], 0.2)[0]:
                    chunk = os.read(follow.stdout.fileno(), 1 << 16)
                    if not chunk:
                        break
                    buf += chunk
                for line in buf.split(b"\n")[:-1]:
                    e = json.loads(line)
                    if e.get("kind") == "refused" and e.get("node") == "a3" and e.get("what") == "local":
                        seen = time.monotonic() - t0
            assert seen is not None, f"the follower did not see a3's refusal: {buf[-2000:]!r}"
            assert follow.poll() is None, follow.stderr.read()
            print(f"\nvmihx: a3's event seen by a follower on a1 after {seen:.2f} s")
        finally:
            os.killpg(follow.pid, 9)
            follow.wait(timeout=5)
        # Another user than root sees the nodes' own events of other nodes, not root's
        # processes' (the connection's), through the head and from the node itself.
        r = as_nobody("a2", ctl, "net", "down", "eth0")
        assert r.returncode == 1, r
        for args in (["--cluster"], ["--node", "a2"]):
            r = as_nobody("a1", ctl, *args, "events", "--json")
            assert r.returncode == 0, r.stderr
            seen = [json.loads(line) for line in r.stdout.splitlines()]
            assert not [e for e in seen if e.get("pid") is not None], (args, seen)
            if args == ["--cluster"]:
                assert any(e["kind"] == "refused" and e["node"] == "a3" for e in seen), seen
            else:
                assert seen and all(e["node"] == "a2" for e in seen), seen
                assert any(e["kind"] == "refused" for e in seen), seen
        r = as_nobody("a1", ctl, "--cluster", "status", "--json")
        s = json.loads(r.stdout)
        assert s["via"] == "head" and set(names(s)) == set(CLUSTER_A), s
        assert all(not n["connections"] and not n["processes"] for n in s["nodes"]), s["nodes"]


def test_cluster_status_through_the_head_is_the_fan_out_answer(hx):
    for n in CLUSTER_A:
        whole_a(n)
    # a2 asks the head; ops (no head) asks every node.
    for _ in range(20):
        head = ctl_json("a2", "--cluster", "status")
        fan = ctl_json("ops", "--cluster", "status")
        if {n["node"]: shape(n) for n in head["nodes"]} == {n["node"]: shape(n) for n in fan["nodes"]
                                                           if n["node"] in CLUSTER_A}:
            break
        time.sleep(0.5)
    assert head["via"] == "head" and head["head"] == ip("a1") and head["head_node"] == "a1", head
    assert head["node"] == "a2" and "fallback" not in head
    assert fan["via"] == "fan-out" and "fallback" not in fan and fan["node"] == "ops"
    assert names(head) == sorted(CLUSTER_A) and names(fan) == sorted([*CLUSTER_A, "ops"])
    assert head["unreachable"] == [] == fan["unreachable"]
    hs = {n["node"]: shape(n) for n in head["nodes"]}
    fs = {n["node"]: shape(n) for n in fan["nodes"] if n["node"] in CLUSTER_A}
    assert hs == fs, (hs, fs)
    assert any(c[0] == hx.gid for c in hs["a2"]["connections"]) and any(c[0] == hx.gid for c in hs["a3"]["connections"])
    # where: both ends through the head.
    ends = ctl_json("a2", "where", hx.gid)
    assert sorted(e["node"] for e in ends) == ["a2", "a3"], ends
    text = vmictl("a2", "--cluster", "status").stdout
    assert f"answered by cluster head {ip('a1')} (a1)" in text, text
    # One exchange with the head against one per node.
    via_head = timed("a2", "--cluster", "status", "--json")
    fan_out = timed("ops", "--cluster", "status", "--json")
    print(f"\nvmihx: --cluster status, median of 10: through the head {via_head * 1000:.1f} ms, "
          f"fan-out to 3 nodes {fan_out * 1000:.1f} ms")


def test_head_killed_queries_fall_back_and_come_back(hx):
    whole_a("a2")
    hx.kill("a1")
    try:
        s = ctl_json("a2", "--cluster", "status")
        assert s["via"] == "fan-out" and "no cluster head answered" in s["fallback"], s
        assert ip("a1") in s["fallback"]
        # (ops, which probes cluster A's nodes, is among the nodes a2 knows from heartbeats.)
        assert {"a2", "a3"} <= set(names(s)) and "a1" not in names(s), s
        assert [u["node"] for u in s["unreachable"]] == ["a1"], s["unreachable"]
        text = vmictl("a2", "--cluster", "status").stdout
        assert "every node asked from here: no cluster head answered" in text, text
        evs = events("a2", "--cluster")
        assert any(e["kind"] == "fan-out" and e["node"] == "a2" for e in evs), evs
        assert any(e["kind"] == "connection" and e["node"] == "a3" and e.get("gid") == hx.gid for e in evs), evs
        assert any(e["kind"] == "unreachable" and e["node"] == "a1" for e in evs), evs
        ends = ctl_json("a2", "where", hx.gid)
        assert sorted(e["node"] for e in ends) == ["a2", "a3"], ends
        wait_for("a log line about the fallback", lambda: "no cluster head answered" in hx.agents["a2"].log())
    finally:
        hx.start("a1").wait_ready()
    s = wait_for("the head used again", lambda: (lambda s: s["via"] == "head" and not s["unreachable"]
                                                 and names(s) == sorted(CLUSTER_A) and s)(ctl_json("a2", "--cluster", "status")))
    assert "fallback" not in s and s["head"] == ip("a1")


def test_two_clusters_under_one_grid_view(hx):
    key_a = ctl_json("a1", "status")["mesh"]["key"]
    key_b = ctl_json("b1", "status")["mesh"]["key"]
    assert key_a != key_b

    def whole_grid():
        g = ctl_json("ops", "--grid", "status")
        cs = {c["cluster"]: c for c in g["clusters"]}
        return (sorted(cs) == ["a", "b"] and sorted(n["node"] for n in cs["a"]["nodes"]) == sorted(CLUSTER_A)
                and sorted(n["node"] for n in cs["b"]["nodes"]) == sorted(CLUSTER_B)
                and not cs["a"]["unreachable"] and not cs["b"]["unreachable"]
                and all(n["health"] == "ok" for c in cs.values() for n in c["nodes"]) and cs)
    cs = wait_for("both clusters whole in the grid view", whole_grid)
    assert (cs["a"]["key"], cs["b"]["key"]) == (key_a, key_b)
    assert (cs["a"]["head"], cs["a"]["head_node"], cs["b"]["head"], cs["b"]["head_node"]) == (ip("a1"), "a1", ip("b1"), "b1")
    assert all(n["key"] == key_a for n in cs["a"]["nodes"]) and all(n["key"] == key_b for n in cs["b"]["nodes"])
    a = {n["node"]: n for n in cs["a"]["nodes"]}
    assert a["a2"]["connections"] >= 1 and a["a2"]["tcp"] >= 1, a
    text = vmictl("ops", "--grid", "status").stdout
    assert f"cluster a (key {key_a}, head a1 at {ip('a1')}): 3 nodes" in text, text
    assert f"cluster b (key {key_b}, head b1 at {ip('b1')}): 2 nodes" in text, text
    # Another user sees the clusters, not root's connections.
    with public_copies(VMICTL_BIN) as d:
        r = as_nobody("ops", d / "vmictl", "--grid", "status", "--json")
    assert r.returncode == 0, r.stderr
    g = {c["cluster"]: c for c in json.loads(r.stdout)["clusters"]}
    assert all(n["connections"] == 0 and n["processes"] == 0 for c in g.values() for n in c["nodes"]), g
    # A node of one cluster cannot read the other: its channel is refused.
    before = ctl_json("b1", "status")["mesh"]["refused"]["channel"]
    for to in (ip("b1"), ip("b2")):
        r = vmictl("a2", "--node", to, "status")
        assert r.returncode == 1 and "did not answer" in r.stderr and "b1" not in r.stdout, r
    r = vmictl("a2", "--node", ip("b1"), "events")
    assert r.returncode != 0 or not r.stdout.strip(), r
    assert ctl_json("b1", "status")["mesh"]["refused"]["channel"] > before
    assert "refused: agent channel from" in hx.agents["b1"].log()
    # A grid member whose head does not answer is listed with why, the other still is.
    hx.kill("b1")
    try:
        g = {c["cluster"]: c for c in ctl_json("ops", "--grid", "status")["clusters"]}
        assert "no head answered" in g["b"]["error"] and not g["b"]["nodes"], g["b"]
        assert sorted(n["node"] for n in g["a"]["nodes"]) == sorted(CLUSTER_A), g["a"]
    finally:
        hx.start("b1").wait_ready()
    wait_for("cluster b back in the grid view", whole_grid)


def test_the_configuration_of_heads_and_grids(hx, tmp_path):
    # A grid entry whose key file is missing or open to others stops the agent (exit 2).
    loose = tmp_path / "loose.key"
    loose.write_bytes(hx.keys["a"].read_bytes())
    loose.chmod(0o644)
    for bad, says in ((f"c={ip('a1')}@/nonexistent.key", "grid cluster c"), (f"c={ip('a1')}@{loose}", "open to other users"),
                      ("c=nowhere@/k", "grid")):
        r = run([AGENT_BIN, "--check-config", "--config", "/dev/null", "--key", hx.keys["a"], "--grid", bad], env=clean_env())
        assert r.returncode == 2 and says in r.stderr, (bad, r)
    r = run([AGENT_BIN, "--check-config", "--config", "/dev/null", "--key", hx.keys["a"], "--head", "10.0.0.1,10.0.0.2",
             "--grid", f"a={ip('a1')}@{hx.keys['a']}"], env=clean_env())
    assert r.returncode == 0, r.stderr
    assert 'head = ["10.0.0.1", "10.0.0.2"]' in r.stdout and f'grid = ["a={ip("a1")}@{hx.keys["a"]}"]' in r.stdout, r.stdout
    r = vmictl("a1", "--grid", "status")
    assert r.returncode == 1 and "no grid view" in r.stderr, r
    r = vmictl("a1", "--grid", "--cluster", "status")
    assert r.returncode == 2, r


def test_a_node_that_does_not_answer_holds_nobody_up(hx):
    whole_a("a2")
    whole_a("ops")
    stopped = hx.agents["a3"].proc.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        # Fan-out (ops has no head): a3 is reported, the others' events come all the same.
        t0 = time.monotonic()
        evs = events("ops", "--cluster")
        took = time.monotonic() - t0
        assert took < 4, f"--cluster events took {took:.1f} s with a3's agent stopped"
        assert any(e["kind"] == "unreachable" and e["node"] == "a3" and "did not answer" in e["detail"]
                   for e in evs), evs
        assert any(e["node"] == "a2" and e["kind"] == "connection" for e in evs), evs
        t0 = time.monotonic()
        s = ctl_json("ops", "--cluster", "status")
        took_status = time.monotonic() - t0
        assert took_status < 4 and [u["node"] for u in s["unreachable"]] == ["a3"], (took_status, s["unreachable"])
        assert {"a1", "a2", "ops"} <= set(names(s)), s
        # Through the head: a3's heartbeats stopped too.
        s = wait_for("a3 unreachable through the head", lambda: (lambda s: [u["node"] for u in s["unreachable"]] == ["a3"]
                                                                  and s)(ctl_json("a2", "--cluster", "status")), 5)
        assert s["via"] == "head"
        print(f"\nvmihx: a3's agent stopped: --cluster events (fan-out) {took:.2f} s, --cluster status (fan-out) "
              f"{took_status:.2f} s")
        # The head stopped as well: a2 falls back within the bound.
        os.kill(hx.agents["a1"].proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            s = ctl_json("a2", "--cluster", "status")
            took = time.monotonic() - t0
            assert s["via"] == "fan-out" and "did not answer within" in s["fallback"], s
            assert took < 6, f"the fallback took {took:.1f} s"
            assert sorted(u["node"] for u in s["unreachable"]) == ["a1", "a3"], s["unreachable"]
        finally:
            os.kill(hx.agents["a1"].proc.pid, signal.SIGCONT)
    finally:
        os.kill(stopped, signal.SIGCONT)
    whole_a("a2")
    whole_a("ops")


def test_a_nodes_agent_killed_and_restarted(hx):
    whole_a("a2")
    hx.kill("a3")
    try:
        t0 = time.monotonic()
        s = wait_for("a3 unreachable through the head", lambda: (lambda s: [u["node"] for u in s["unreachable"]] == ["a3"]
                                                                  and s)(ctl_json("a2", "--cluster", "status")), 8)
        took = time.monotonic() - t0
        assert s["via"] == "head" and sorted(names(s)) == ["a1", "a2"], s
        assert s["unreachable"][0]["stale"] is True and s["unreachable"][0]["addrs"] == [ip("a3")], s
        f = ctl_json("ops", "--cluster", "status")
        assert [u["node"] for u in f["unreachable"]] == ["a3"], f["unreachable"]
        print(f"\nvmihx: a3's agent killed: unreachable through the head after {took:.2f} s")
    finally:
        hx.start("a3").wait_ready()
    s = whole_a("a2")
    assert s["via"] == "head"
    whole_a("ops")


def test_gids_say_which_cluster_issued_them(hx):
    """A GID's first four hexadecimal digits are the id of the cluster that issued it (the
    first four of its key's fingerprint); the two clusters' ids differ."""
    a, b = ctl_json("a2", "status")["mesh"], ctl_json("b1", "status")["mesh"]
    assert a["cluster_id"] == a["key"][:4] and b["cluster_id"] == b["key"][:4], (a, b)
    assert a["cluster_id"] != b["cluster_id"], (a, b)
    assert hx.gid[:4] == a["cluster_id"], (hx.gid, a)
    ends = ctl_json("a2", "where", hx.gid)
    assert ends and all(e["gid"][:4] == a["cluster_id"] for e in ends), ends
