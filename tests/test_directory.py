"""The cluster directory in etcd (`vmi-agent --directory etcd://...`).

Hosts of their own (network namespaces vmiet1..6 on one bridge in a seventh, vmiet-sw; all
deleted when the module ends, pass or fail, and at exit):

* e1, e2, e3 (vmiet4..6): a three-member etcd cluster (Debian's etcd-server);
* h1, h2, h3 (vmiet1..3): vmi-agent with `--directory` naming the three members and a
  lease of LEASE_S seconds.

Real programs under the layer (tests/programs/stream.py) connect across the hosts. What is
in etcd is read with `etcdctl`. The suite's shared hosts (vmit*) are not used.
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

import helpers
from helpers import (AGENT_BIN, MIGRATE_BIN, PRELOAD_LIB, PROGRAMS, PYTHON, VMICTL_BIN, AgentProc, Group,
                     assert_same_stream, build_star, capture as run, clean_env, delete_star, in_netns,
                     require_root_and_build)

PREFIX = "vmiet"
HOSTS = {"h1": 1, "h2": 2, "h3": 3}
MEMBERS = {"e1": 4, "e2": 5, "e3": 6}
NET = "10.249.0"
LEASE_S = 4
CRIU = os.environ.get("VMI_CRIU", "/opt/vmi/criu/bin/criu")
WAIT = 15.0
SERVER_PORT = 9300


def ns(name):
    return f"{PREFIX}{HOSTS.get(name) or MEMBERS[name]}"


def ip(name):
    return f"{NET}.{HOSTS.get(name) or MEMBERS[name]}"


ENDPOINTS = ",".join(f"{ip(m)}:2379" for m in MEMBERS)


def in_ns(name, argv, **kw):
    return in_netns(ns(name), argv, **kw)


def vmictl(node, *args, timeout=20):
    return in_ns(node, [VMICTL_BIN, *args], env=clean_env(), timeout=timeout)


def ctl_json(node, *args):
    r = vmictl(node, *args, "--json")
    assert r.returncode == 0, f"vmictl {args} on {node}: {r.stderr}{r.stdout}"
    return json.loads(r.stdout)


def etcd_get(prefix, where="h1"):
    """{key: value} under prefix, read with etcdctl from host `where`."""
    r = in_ns(where, ["etcdctl", "--endpoints", ENDPOINTS, "--dial-timeout", "2s", "--command-timeout", "3s",
                      "get", "--prefix", prefix, "-w", "json"], env=clean_env(ETCDCTL_API="3"), timeout=10)
    assert r.returncode == 0, f"etcdctl get {prefix}: {r.stderr}"
    import base64
    kvs = json.loads(r.stdout).get("kvs") or []
    return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv["value"]).decode() for kv in kvs}


def wait_for(what, check, timeout=WAIT, every=0.05):
    return helpers.wait_for(what, check, timeout, every)


def star():
    return {ns(n): (f"et{HOSTS.get(n) or MEMBERS[n]}", f"{ip(n)}/24") for n in [*HOSTS, *MEMBERS]}


def delete_namespaces():
    delete_star(PREFIX, star())


def build_hosts():
    build_star(PREFIX, star())


class Et:
    """The module's etcd members, agents and programs."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.key = tmp / "cluster.key"
        self.agents = {}
        self.etcd = {}
        self.groups = []
        self.n = 0

    def start_member(self, m, state="new"):
        self.n += 1
        cluster = ",".join(f"{x}=http://{ip(x)}:2380" for x in MEMBERS)
        argv = ["nsenter", f"--net=/run/netns/{ns(m)}", "etcd", "--name", m, "--data-dir", self.tmp / f"etcd-{m}",
                "--listen-client-urls", f"http://{ip(m)}:2379", "--advertise-client-urls", f"http://{ip(m)}:2379",
                "--listen-peer-urls", f"http://{ip(m)}:2380", "--initial-advertise-peer-urls",
                f"http://{ip(m)}:2380", "--initial-cluster", cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", "vmiet", "--heartbeat-interval", "50", "--election-timeout", "500"]
        self.etcd[m] = Group(argv, self.tmp / f"etcd-{m}-{self.n}.log")

    def stop_members(self):
        for g in self.etcd.values():
            g.stop(signal.SIGKILL)

    def etcd_healthy(self):
        r = in_ns("h1", ["etcdctl", "--endpoints", ENDPOINTS, "--dial-timeout", "1s", "endpoint", "health"],
                  env=clean_env(ETCDCTL_API="3"), timeout=10)
        return r.returncode == 0

    def start_agent(self, node, extra=()):
        self.n += 1
        args = ["--config", "/dev/null", "--key", self.key, "--node", node, "--directory", f"etcd://{ENDPOINTS}",
                "--directory-ttl", LEASE_S, "--log", "info", *extra]
        a = AgentProc(ns(node), args, self.tmp, f"agent-{node}-{self.n}")
        self.agents[node] = a
        return a

    def kill_agent(self, node):
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
        self.stop_members()
        delete_namespaces()


@pytest.fixture(scope="module")
def et(tmp_path_factory):
    require_root_and_build()
    if not shutil.which("etcd") or not shutil.which("etcdctl"):
        pytest.fail("etcd and etcdctl are missing: run scripts/setup.sh", pytrace=False)
    tmp = tmp_path_factory.mktemp("dir")
    e = Et(tmp)
    atexit.register(e.close)
    try:
        build_hosts()
        run([AGENT_BIN, "--init", "--key", e.key], check=True, env=clean_env())
        for m in MEMBERS:
            e.start_member(m)
        wait_for("the etcd cluster healthy", e.etcd_healthy, timeout=30, every=0.3)
        yield e
    finally:
        e.close()


def prefix_of(node):
    return ctl_json(node, "status")["directory"]["prefix"]


def directory(node):
    return ctl_json(node, "status")["directory"]


def node_events(node, of):
    """The `node` events of `node`'s journal about node `of`: [change]."""
    evs = [json.loads(x) for x in vmictl(node, "events", "--json").stdout.splitlines() if x.strip()]
    return [e.get("change") for e in evs if e["kind"] == "node" and e.get("node") == of]


def test_nodes_register_in_the_directory_and_watch_no_one_yet(et):
    t0 = time.monotonic()
    for n in HOSTS:
        et.start_agent(n)
    for a in et.agents.values():
        a.wait_ready()
    p = prefix_of("h1")
    assert p == f"/vmi/{ctl_json('h1', 'status')['mesh']['cluster_id']}/"
    wait_for("three nodes in etcd", lambda: len([k for k in etcd_get(p + "node/") if k]) == 3)
    took = time.monotonic() - t0
    nodes = {k.rsplit("/", 1)[1]: json.loads(v) for k, v in etcd_get(p + "node/").items()}
    assert set(nodes) == set(HOSTS), nodes
    h2 = nodes["h2"]
    assert h2["agents"] == [f"{ip('h2')}:7787"], h2
    net = [x for x in h2["networks"] if x["name"] == "eth0"]
    assert net and net[0]["addr"] == ip("h2") and net[0]["mtu"] == 1500 and len(net[0]["mac"]) == 17, h2
    # Each agent's directory section. No agent has connections yet: none watches another
    # node, whatever the cluster's size.
    for n in HOSTS:
        d = wait_for(f"{n} connected", lambda n=n: (lambda d: d["connected"] and d)(directory(n)))
        assert d["lease"] and d["endpoints"] == [f"http://{ip(m)}:2379" for m in MEMBERS], d
        # (An etcd cluster just elected may let a first request time out: the agent then
        # registers on its next try, and says why it retried.)
        assert d["ttl_s"] == LEASE_S and (d["last_error"] is None or d["registrations"] >= 1), d
        assert d["node_watches"] == 0 and d["watched"] == [] and d["nodes_known"] == 0, d
        assert d["nodes_not_watched"] == 0, d
    # Each agent address names its node (how a node not watched is found on demand).
    agents = etcd_get(p + "agent/")
    assert {k: json.loads(v)["node"] for k, v in agents.items()} == {
        f"{p}agent/{ip(n)}:7787": n for n in HOSTS}, agents
    print(f"\nvmiet: three agents started and registered in etcd within {took:.2f} s")


def test_listeners_and_connections_are_in_the_directory(et):
    p = prefix_of("h1")
    server = f"{ip('h2')}:{SERVER_PORT}"
    t0 = time.monotonic()
    srv = et.program("h2", [PYTHON, PROGRAMS / "stream.py", "server", "--bind", server, "--count", "1"], "server")
    key = f"{p}listener/h2/{server}"
    wait_for("the listener in etcd", lambda: key in etcd_get(p + "listener/"))
    print(f"\nvmiet: listener in etcd {time.monotonic() - t0:.2f} s after its program started")
    assert json.loads(etcd_get(key)[key]) == {"node": "h2", "addr": server}
    c = et.program("h1", [PYTHON, PROGRAMS / "stream.py", "client", "--connect", server, "--bytes", 2_000_000,
                          "--seed", 3, "--rate", 1_000_000, "--hold", 3], "client")
    gid = wait_for("the connection on h2", lambda: next(
        (x["gid"] for x in ctl_json("h2", "status")["connections"] if x["local"] == server), None))
    # Its two ends' agents now watch each other's node; h3, with no connection, none.
    for a, b in (("h1", "h2"), ("h2", "h1")):
        wait_for(f"{a} watches {b}", lambda a=a, b=b: (lambda d: d["watched"] == [b] and d["node_watches"] == 1
                                                          and d["nodes_known"] == 1)(directory(a)), timeout=5)
    assert directory("h3")["watched"] == []
    ends = wait_for("both ends in etcd", lambda: (lambda g: len(g) == 2 and g)(etcd_get(f"{p}gid/{gid}/")))
    sides = {k.rsplit("/", 1)[1]: json.loads(v)["node"] for k, v in ends.items()}
    assert sides == {"out": "h1", "in": "h2"}, ends
    # vmictl where answers from the directory, one lookup.
    lat = []
    for _ in range(20):
        w = ctl_json("h3", "where", gid)
        assert {(x["node"], x["direction"]) for x in w} == {("h1", "out"), ("h2", "in")}, w
        assert all(x["source"] == "directory" for x in w), w
        lat.append(w[0]["lookup_us"])
    lat.sort()
    print(f"vmiet: GID lookup through the directory: median {lat[10]} us, max {lat[-1]} us (of 20)")
    assert lat[-1] < 300_000
    c.proc.wait(timeout=30)
    srv.proc.wait(timeout=30)
    wait_for("the connection's ends gone from etcd once it closed", lambda: not etcd_get(f"{p}gid/{gid}/"))


def test_a_dead_agent_leaves_when_its_lease_ends(et):
    """h1 has a connection with h3 when h3's agent dies: h1 watches h3's node and hears it
    leave (and come back); h2, with no connection to h3, does not watch it and hears
    nothing of it."""
    p = prefix_of("h1")
    assert f"{p}node/h3" in etcd_get(p + "node/")
    port = SERVER_PORT + 5
    server = f"{ip('h3')}:{port}"
    srv = et.program("h3", [PYTHON, PROGRAMS / "stream.py", "server", "--bind", server, "--count", "1"],
                     "server-dead")
    wait_for("server listening", lambda: in_ns("h3", ["ss", "-tlnH", f"sport = :{port}"]).stdout.strip())
    cli = et.program("h1", [PYTHON, PROGRAMS / "stream.py", "client", "--connect", server, "--bytes", 100_000,
                            "--seed", 5, "--hold", 25], "client-dead")
    wait_for("h1 watches h3", lambda: "h3" in directory("h1")["watched"], timeout=10)
    assert "h3" not in directory("h2")["watched"], directory("h2")
    et.kill_agent("h3")
    t0 = time.monotonic()
    wait_for("h3 gone from etcd", lambda: f"{p}node/h3" not in etcd_get(p + "node/"), timeout=LEASE_S + 5)
    gone = time.monotonic() - t0

    wait_for("h1's journal says h3 left", lambda: "left" in node_events("h1", "h3"), timeout=5)
    heard = time.monotonic() - t0
    print(f"\nvmiet: agent of h3 killed: its node gone from etcd after {gone:.2f} s, h1's journal had it "
          f"after {heard:.2f} s (lease {LEASE_S} s)")
    assert gone <= LEASE_S + 1.5
    d = directory("h1")
    assert "h3" in d["watched"] and d["nodes_known"] == d["node_watches"] - 1, d
    # Back: h1 hears it join again.
    et.start_agent("h3").wait_ready()
    wait_for("h3 back in etcd", lambda: f"{p}node/h3" in etcd_get(p + "node/"))
    wait_for("h1's journal says h3 joined", lambda: node_events("h1", "h3")[-1:] == ["joined"], timeout=5)
    d = directory("h1")
    assert d["nodes_known"] == d["node_watches"], d
    # h2 has no connection with h3: it does not watch it, and its journal has nothing of h3.
    d = directory("h2")
    assert "h3" not in d["watched"] and d["node_watches"] <= 1, d
    assert node_events("h2", "h3") == [], node_events("h2", "h3")
    print(f"vmiet: h2 (no connection with h3) watches {d['watched']} and heard nothing of h3")
    for g in (cli, srv):
        g.stop()


def test_etcd_down_for_30_s_while_a_stream_flows(et):
    p = prefix_of("h1")
    server = f"{ip('h3')}:{SERVER_PORT + 1}"
    srv = et.program("h3", [PYTHON, PROGRAMS / "stream.py", "server", "--bind", server, "--count", "1"],
                     "server-outage")
    wait_for("server listening", lambda: in_ns("h3", ["ss", "-tlnH", f"sport = :{SERVER_PORT + 1}"]).stdout.strip())
    # 45 s of a checksummed stream both ways at 1 MB/s.
    cli = et.program("h1", [PYTHON, PROGRAMS / "stream.py", "client", "--connect", server, "--bytes", 45_000_000,
                            "--server-bytes", 45_000_000, "--seed", 9, "--rate", 1_000_000], "client-outage")
    wait_for("the stream virtual", lambda: any(x["local"] == server for x in ctl_json("h3", "status")["connections"]))
    before = {n: ctl_json(n, "status")["directory"] for n in HOSTS}
    t0 = time.monotonic()
    et.stop_members()
    for n in HOSTS:
        wait_for(f"{n} sees etcd gone", lambda n=n: not ctl_json(n, "status")["directory"]["connected"], timeout=10)
    # A new connection while etcd is down: set up without waiting on it.
    server2 = f"{ip('h2')}:{SERVER_PORT + 2}"
    et.program("h2", [PYTHON, PROGRAMS / "stream.py", "server", "--bind", server2, "--count", "1"], "server-during")
    wait_for("server listening", lambda: in_ns("h2", ["ss", "-tlnH", f"sport = :{SERVER_PORT + 2}"]).stdout.strip())
    t1 = time.monotonic()
    during = et.program("h1", [PYTHON, PROGRAMS / "stream.py", "client", "--connect", server2, "--bytes", 100_000,
                               "--seed", 4], "client-during")
    during.proc.wait(timeout=20)
    made = time.monotonic() - t1
    assert during.proc.returncode == 0, during.output()
    time.sleep(max(0.0, 30 - (time.monotonic() - t0)))
    progress = ctl_json("h3", "status")["connections"]
    for m in MEMBERS:
        et.start_member(m, state="existing")
    back = time.monotonic()
    for n in HOSTS:
        wait_for(f"{n} registered again", lambda n=n: (lambda d: d["connected"] and
                 d["registrations"] > before[n]["registrations"] and d)(ctl_json(n, "status")["directory"]),
                 timeout=30, every=0.2)
    again = time.monotonic() - back
    wait_for("three nodes in etcd again", lambda: len(etcd_get(p + "node/")) == 3)
    for n in HOSTS:
        d = ctl_json(n, "status")["directory"]
        assert d["lease"] != before[n]["lease"] and d["outages"] == before[n]["outages"] + 1, (before[n], d)
    cli.proc.wait(timeout=60)
    srv.proc.wait(timeout=30)
    assert_same_stream(cli.last_json(), srv.last_json())
    warns = [x for x in et.agents["h1"].log().splitlines() if "WARN" in x and "directory" in x]
    assert len(warns) == 1, warns
    print(f"\nvmiet: etcd down 30 s: stream of 45 MB each way whole ({len(progress)} connection(s) live during); "
          f"a new connection during the outage done in {made:.2f} s; every agent registered again "
          f"{again:.2f} s after the members restarted; one warning per agent")


def migrate(group, to):
    """vmi-migrate moves group's program to host `to`; its JSON report. The original is
    reaped meanwhile (it is this test's child) so that its pid is free for the restore."""
    stop = threading.Event()

    def reap():
        while not stop.is_set():
            group.proc.poll()
            time.sleep(0.005)
    t = threading.Thread(target=reap, daemon=True)
    t.start()
    try:
        r = run([MIGRATE_BIN, group.proc.pid, "--to", ns(to), "--json", "--criu", CRIU], timeout=60,
                env=clean_env())
    finally:
        stop.set()
        t.join()
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0 and lines and json.loads(lines[-1]).get("ok") is True, (r.stdout, r.stderr)
    return json.loads(lines[-1])


def finished(group, timeout):
    """The JSON result of a (maybe migrated) stream.py, once its process is gone."""
    pid = group.proc.pid
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        group.proc.poll()
        gone = helpers.process_gone(pid)
        lines = [x for x in group.output().splitlines() if x.startswith("{")]
        if gone and lines:
            return json.loads(lines[-1])
        time.sleep(0.1)
    raise AssertionError(f"no result of {group.log_path} within {timeout} s")


def test_a_migrated_process_moves_its_connection_in_the_directory(et):
    if not Path(CRIU).exists():
        pytest.fail(f"{CRIU} is missing: run scripts/setup.sh (it installs CRIU 4.2)", pytrace=False)
    p = prefix_of("h1")
    port = SERVER_PORT + 3
    server = f"{ip('h2')}:{port}"
    srv = et.program("h2", [PYTHON, PROGRAMS / "stream.py", "server", "--bind", f"0.0.0.0:{port}", "--count", "1",
                            "--rate", 1_000_000, "--hold", 0.5], "server-migrate")
    wait_for("server listening", lambda: in_ns("h2", ["ss", "-tlnH", f"sport = :{port}"]).stdout.strip())
    cli = et.program("h1", [PYTHON, PROGRAMS / "stream.py", "client", "--connect", server, "--bytes", 24_000_000,
                            "--server-bytes", 24_000_000, "--seed", 7, "--rate", 1_000_000, "--hold", 0.5],
                     "client-migrate")
    gid = wait_for("the connection on h1", lambda: next(
        (x["gid"] for x in ctl_json("h1", "status")["connections"] if x["peer"] == server), None))
    key = f"{p}gid/{gid}/out"
    wait_for("the client's end in etcd on h1", lambda: json.loads(etcd_get(key).get(key, "{}")).get("node") == "h1")

    def moved_here(node, came_from):
        evs = [json.loads(x) for x in vmictl(node, "events", "--json").stdout.splitlines() if x.strip()]
        return sum(e["kind"] == "directory" and e.get("gid") == gid and e.get("moved_from") == came_from
                   for e in evs)
    took = []
    for to in ("h3", "h1"):
        migrate(cli, to)
        t0 = time.monotonic()
        wait_for(f"the client's end in etcd on {to}",
                 lambda to=to: json.loads(etcd_get(key).get(key, "{}")).get("node") == to, timeout=10)
        took.append(time.monotonic() - t0)
        # (A connection's ends are written a second after set-up, registry::WRITE_DELAY: the
        # first move can come sooner than h2's end.)
        w = wait_for(f"where names the ends on {to} and h2", lambda to=to: (
            lambda w: {(x["node"], x["direction"]) for x in w} == {(to, "out"), ("h2", "in")} and w)(
            ctl_json("h2", "where", gid)), timeout=5)
        assert all(x["source"] == "directory" for x in w), w
    assert moved_here("h3", "h1") == 1 and moved_here("h1", "h3") == 1
    # A move while etcd is down: the new node's agent moves the record when etcd is back,
    # by the same compare-and-swap, so the move is still told apart from a new connection.
    before = ctl_json("h3", "status")["directory"]["registrations"]
    et.stop_members()
    wait_for("h3 sees etcd gone", lambda: not ctl_json("h3", "status")["directory"]["connected"], timeout=10)
    migrate(cli, "h3")
    for m in MEMBERS:
        et.start_member(m, state="existing")
    wait_for("h3 registered again", lambda: ctl_json("h3", "status")["directory"]["registrations"] > before,
             timeout=30, every=0.2)
    try:
        wait_for("the client's end in etcd on h3 after the outage",
                 lambda: json.loads(etcd_get(key).get(key, "{}")).get("node") == "h3", timeout=20)
    except AssertionError as e:
        said = {n: [x for x in et.agents[n].log().splitlines() if "directory" in x][-8:] for n in ("h1", "h3")}
        raise AssertionError(f"{e}; the record: {etcd_get(key).get(key)}; the agents said: {said}") from None
    assert moved_here("h3", "h1") == 2
    c, s = finished(cli, 60), finished(srv, 15)
    assert_same_stream(c, s)
    print(f"\nvmiet: client migrated h1 -> h3 -> h1: its end's record moved (compare-and-swap) "
          f"{took[0]:.2f} s and {took[1]:.2f} s after vmi-migrate returned; moved again h1 -> h3 with etcd "
          f"down, and the record followed when etcd was back; stream whole")


def test_a_listener_moved_twice_is_found_through_the_directory(et):
    """A server moved h2 -> h3 -> h1 still takes new connections at its first address: h2's
    agent finds where it lives now in the directory (node to node), not through h3."""
    if not Path(CRIU).exists():
        pytest.fail(f"{CRIU} is missing: run scripts/setup.sh (it installs CRIU 4.2)", pytrace=False)
    port = SERVER_PORT + 4
    srv = et.program("h2", [PYTHON, PROGRAMS / "stream.py", "server", "--bind", f"0.0.0.0:{port}", "--count", "1"],
                     "server-moves")
    wait_for("server listening", lambda: in_ns("h2", ["ss", "-tlnH", f"sport = :{port}"]).stdout.strip())
    migrate(srv, "h3")
    migrate(srv, "h1")
    first = f"{ip('h2')}:{port}"
    t0 = time.monotonic()
    cli = et.program("h3", [PYTHON, PROGRAMS / "stream.py", "client", "--connect", first, "--bytes", 1_000_000,
                            "--seed", 11, "--hold", 1], "client-moved")
    conn = wait_for("the new connection virtual on h3", lambda: next(
        (x for x in ctl_json("h3", "status")["connections"] if x["peer"] == first), None))
    made = time.monotonic() - t0
    assert conn["link_peer"].startswith(ip("h1") + ":"), conn
    c, s = finished(cli, 30), finished(srv, 30)
    assert_same_stream(c, s)
    log = et.agents["h2"].log()
    assert f"listener 0.0.0.0:{port} moved on to node h1 (2 node(s) followed" in log, log[-3000:]
    line = [x for x in log.splitlines() if f"listener 0.0.0.0:{port} moved on" in x][-1]
    print(f"\nvmiet: server moved h2 -> h3 -> h1; a new connection to {first} reached it on h1 "
          f"({made:.2f} s to a listed virtual connection); h2's agent: {line.split('directory: ')[-1]}")


def test_a_node_no_longer_cared_about_is_no_longer_watched(et):
    """Once its last connection with a node is gone, an agent drops that node's watch after
    six lease times (24 s here), and hears nothing more of it."""
    t0 = time.monotonic()
    for n in ("h1", "h2", "h3"):
        wait_for(f"{n} watches no node", lambda n=n: (lambda d: d["node_watches"] == 0 and d["nodes_known"] == 0)(
            directory(n)), timeout=6 * LEASE_S + 10, every=0.5)
    print(f"\nvmiet: every agent without connections dropped its node watches within "
          f"{time.monotonic() - t0:.1f} s (six leases: {6 * LEASE_S} s after the last connection)")
    before = node_events("h1", "h3")
    et.kill_agent("h3")
    wait_for("h3 gone from etcd", lambda: f"{prefix_of('h1')}node/h3" not in etcd_get(prefix_of("h1") + "node/"),
             timeout=LEASE_S + 5)
    time.sleep(0.5)
    assert node_events("h1", "h3") == before, node_events("h1", "h3")


def test_bad_directory_values_are_refused(et):
    for bad, says in [("http://10.0.0.1:2379", "not an etcd directory"), ("etcd://10.0.0.1", "HOST:PORT"),
                      ("etcd://10.0.0.1:0", "PORT 1 to 65535"), ("etcd://a b:1", "HOST is a name")]:
        r = run([AGENT_BIN, "--check-config", "--key", et.key, "--directory", bad], env=clean_env())
        assert r.returncode == 2 and says in r.stderr and "etcd://HOST:PORT" in r.stderr, (bad, r)
    cfg = et.tmp / "bad.toml"
    cfg.write_text('directory = "etcd:/oops"\n')
    r = run([AGENT_BIN, "--check-config", "--config", cfg, "--key", et.key], env=clean_env())
    assert r.returncode == 2 and "line 1" in r.stderr and "directory" in r.stderr, r
    r = run([AGENT_BIN, "--check-config", "--key", et.key, "--directory-ttl", "1"], env=clean_env())
    assert r.returncode == 2 and "directory-ttl" in r.stderr, r
    ok = run([AGENT_BIN, "--check-config", "--key", et.key, "--directory", f"etcd://{ENDPOINTS}"], env=clean_env())
    assert ok.returncode == 0 and f'directory = "etcd://{ENDPOINTS}"' in ok.stdout, ok


TLS_PORT = 2389          # the TLS member's client port (e1's namespace; the cluster uses 2379)


def make_pki(d):
    """A CA, etcd's server certificate for e1's address, an agent client certificate (CN
    vmi-agent) signed by the CA, and one signed by another CA (a stranger)."""
    def ssl(*a):
        r = run(["openssl", *map(str, a)], env=clean_env())
        assert r.returncode == 0, r.stderr
    for ca in ("ca", "rogue-ca"):
        ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
            "-subj", f"/CN=vmiet {ca}", "-keyout", d / f"{ca}.key", "-out", d / f"{ca}.pem")
    for name, ca, subj, ext in [("server", "ca", "/CN=etcd", f"subjectAltName=IP:{ip('e1')}"),
                                ("client", "ca", "/CN=vmi-agent", "extendedKeyUsage=clientAuth"),
                                ("stranger", "rogue-ca", "/CN=vmi-agent", "extendedKeyUsage=clientAuth")]:
        ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", subj,
            "-keyout", d / f"{name}.key", "-out", d / f"{name}.csr")
        extfile = d / f"{name}.ext"
        extfile.write_text(ext + "\n")
        ssl("x509", "-req", "-in", d / f"{name}.csr", "-CA", d / f"{ca}.pem", "-CAkey", d / f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-extfile", extfile, "-out", d / f"{name}.pem")
        os.chmod(d / f"{name}.key", 0o600)


def test_the_directory_over_tls_with_client_certificates(et):
    """etcd serving TLS only and asking every client for a certificate of its CA
    (--client-cert-auth): an agent with the CA and a client certificate registers; one whose
    certificate another CA signed, and one that speaks plain TCP, do not, and they say why in
    their status while they go on without the directory; a key file others can read stops the
    agent before it starts."""
    d = et.tmp / "pki"
    d.mkdir()
    make_pki(d)
    url = f"https://{ip('e1')}:{TLS_PORT}"
    argv = ["nsenter", f"--net=/run/netns/{ns('e1')}", "etcd", "--name", "tls", "--data-dir", et.tmp / "etcd-tls",
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", "http://127.0.0.1:2390", "--initial-advertise-peer-urls", "http://127.0.0.1:2390",
            "--initial-cluster", "tls=http://127.0.0.1:2390", "--cert-file", d / "server.pem",
            "--key-file", d / "server.key", "--trusted-ca-file", d / "ca.pem", "--client-cert-auth"]
    member = Group(argv, et.tmp / "etcd-tls.log")
    et.groups.append(member)
    certs = ["--cacert", d / "ca.pem", "--cert", d / "client.pem", "--key", d / "client.key"]

    def ctl(*args, creds=certs):
        return in_ns("h3", ["etcdctl", "--endpoints", url, "--dial-timeout", "2s", "--command-timeout", "3s",
                            *map(str, creds), *args], env=clean_env(ETCDCTL_API="3"), timeout=15)
    wait_for("the TLS member healthy", lambda: ctl("endpoint", "health").returncode == 0, timeout=30, every=0.3)
    assert ctl("get", "x", creds=["--cacert", d / "ca.pem"]).returncode != 0, "etcd answered without a certificate"
    common = ["--config", "/dev/null", "--key", et.key, "--directory", f"etcd://{ip('e1')}:{TLS_PORT}",
              "--directory-ttl", LEASE_S, "--log", "info"]
    tls_agents = []

    def agent(name, port, *extra):
        a = AgentProc(ns("h3"), [*common, "--node", name, "--socket", f"vmiet-{name}", "--port", port, *extra],
                      et.tmp, f"agent-{name}")
        tls_agents.append(a)
        return a

    def status(name):
        r = in_ns("h3", [VMICTL_BIN, "--socket", f"vmiet-{name}", "status", "--json"], env=clean_env(), timeout=20)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["directory"]
    try:
        good = agent("tls-good", 7801, "--directory-ca", d / "ca.pem", "--directory-cert", d / "client.pem",
                     "--directory-key", d / "client.key")
        stranger = agent("tls-stranger", 7803, "--directory-ca", d / "ca.pem", "--directory-cert",
                         d / "stranger.pem", "--directory-key", d / "stranger.key")
        plain = agent("tls-plain", 7805)
        for a in tls_agents:
            a.wait_ready()
        g = wait_for("the agent with a client certificate registered over TLS",
                     lambda: (lambda s: s["connected"] and s)(status("tls-good")))
        assert g["endpoints"] == [url], g
        assert "TLS, servers checked against" in good.log(), good.log()[-2000:]
        p = g["prefix"]
        r = ctl("get", "--prefix", f"{p}node/tls-good", "--keys-only")
        assert r.returncode == 0 and f"{p}node/tls-good" in r.stdout, (r.stdout, r.stderr)
        time.sleep(2 * LEASE_S / 3 + 1)
        for name in ("tls-stranger", "tls-plain"):
            s = status(name)
            assert not s["connected"] and s["registrations"] == 0 and s["last_error"], (name, s)
            assert ctl("get", "--prefix", f"{p}node/{name}", "--keys-only").stdout.strip() == "", name
        assert stranger.proc.poll() is None and plain.proc.poll() is None
        assert "plain TCP" in plain.log(), plain.log()[-2000:]
        # A private key others may read: not started, and the reason said.
        loose = d / "loose.key"
        shutil.copy(d / "client.key", loose)
        os.chmod(loose, 0o644)
        r = in_ns("h3", [AGENT_BIN, *map(str, common), "--node", "tls-loose", "--socket", "vmiet-tls-loose",
                         "--port", 7807, "--directory-ca", d / "ca.pem", "--directory-cert", d / "client.pem",
                         "--directory-key", loose], env=clean_env(), timeout=20)
        assert r.returncode == 2 and "directory-key" in r.stderr and str(loose) in r.stderr, r
    finally:
        for a in tls_agents:
            a.stop()
        member.stop(signal.SIGKILL)
