"""Virtual connections survive link failure.

A layered client in CLIENT (vmit1) talks to a layered server in SERVER (vmit2) at the server's
eth0 address, the network the program chose. Each test breaks that network in one way while
traffic runs (interface down, a silent black hole, flapping, both networks gone for a while,
`vmictl net down`, the client host's agent killed), and checks what the specification
promises:

* the program sees nothing: tests/programs/stream.py moves exact byte counts with equal
  SHA-256 digests both ways, every call succeeds, and getsockname/getpeername, checked every
  0.1 s, answer the original addresses throughout;
* the connection was virtual at both ends (`assert_virtual`, as in test_stream.py);
* after the fault `vmictl status --json` shows both ends on eth1 (`network`, `link_local`,
  `link_peer`) with `failovers` >= 1, while `local`/`peer` still show what the program sees.

Then what happens when no network works: connections wait (both networks down for 5 s), and
fail with ETIMEDOUT once VMI_GRACE has passed. A resume attack by someone who knows the GID
but not the connection's secret fails and leaves the connection alone. iperf3 and
redis-benchmark run across a failover. The last test covers new connections made while the
chosen network is dead (to a listener on a wildcard address), and while heartbeats are lost
but the network works (the connection must still be virtual).

Faults go through the `faults` fixture (helpers.Faults), which undoes every link, bridge and
`vmictl net` change when the test ends, passed or failed; killed agents are restarted by
`agent_control`. The failover stall goal (under 100 ms for a silent failure) is the
benchmark's business: the tests only bound stalls loosely (STALL_SLACK).
"""

import json
import os
import re
import signal
import time

import pytest

from helpers import (AGENT_PORT, AGENT_RELINK_PORTS, BASELINE, DEAD_AFTER_MS, ETH0, ETH1, FAILOVER_TIMEOUT,
                     GRACE_ENV, H1, H1_IP, H1_IP1, H2, H2_IP, H2_IP1, LAYER_LOG, PORTS,
                     Watcher, assert_same_stream, assert_virtual, client_conns,
                     failover_problems, in_netns, ip_cmd, network_entry, paths_on, program_lines,
                     python_prog, vmictl, vmictl_status, wait_conn, wait_status)

pytestmark = pytest.mark.skipif(BASELINE, reason="failover is the layer's and the agents' "
                                "work: on plain TCP there is nothing to test")

MiB = 1 << 20
CLIENT, SERVER = H1, H2
SERVER_IP = H2_IP            # the server's eth0 address: the network the program chose
RATE = 2 * MiB               # bytes/second each way: a stream lasts as long as the test needs
HEADER_BYTES = 24            # stream.py's header, sent by the client on the connection
NAMES_EVERY = 0.1            # stream.py --check-names
HOLD = 1.0                   # seconds a finished stream stays open, for the last snapshots
FLOWING_TIMEOUT = 10.0       # client start until its connection moves bytes both ways
FAULT_AFTER = 1.0            # seconds of healthy traffic before the fault
STALL_SLACK = 5.0            # a stream may take this much longer than its nominal duration
FINISH_SLACK = 25.0          # and must end within its nominal duration plus this


class Stream:
    """One stream.py connection from CLIENT to SERVER_IP:port, both ends under the layer, each
    side sending `seconds * rate` bytes at `rate` bytes/second, so the stream lasts about
    `seconds` and a fault can be made in its middle."""

    def __init__(self, procs, port, seconds, *, rate=RATE, env=None, hold=HOLD):
        self.procs = procs
        self.port = port
        self.addr = f"{SERVER_IP}:{port}"
        self.seconds = seconds
        self.rate = rate
        self.nbytes = int(seconds * rate)
        self.env = env
        self.hold = hold
        self.cli = None
        self.srv = procs.server(SERVER, python_prog(
            "stream.py", "server", "--bind", self.addr, "--count", 1, "--hold", hold,
            "--rate", rate, "--check-names", NAMES_EVERY), port, layer=True, env=env,
            name="stream-server")

    def start(self, *extra):
        self.cli = self.procs.start(CLIENT, python_prog(
            "stream.py", "client", "--connect", self.addr, "--bytes", self.nbytes,
            "--server-bytes", self.nbytes, "--seed", self.port, "--rate", self.rate,
            "--hold", self.hold, "--check-names", NAMES_EVERY, *extra), layer=True,
            env=self.env, name="stream-client")
        return self

    def wait_flowing(self):
        """Waits until CLIENT lists the connection moving bytes both ways; checks that it
        runs on the network the program chose, with no failover yet. Returns its record."""
        c = wait_conn(CLIENT, self.addr,
                      lambda c: c.get("bytes_sent", 0) > 0 and c.get("bytes_received", 0) > 0,
                      FLOWING_TIMEOUT, "the stream's virtual connection moving bytes both ways")
        assert c.get("network") == ETH0 and c.get("failovers") == 0, \
            f"before any fault the connection should run on {ETH0} (the program connected " \
            f"to {SERVER_IP}) with no failover: {c}"
        assert str(c.get("link_peer", "")).startswith(f"{SERVER_IP}:"), c
        return c

    def finish(self, extra=FINISH_SLACK):
        """Waits for both programs; returns their results (client, server)."""
        self.cli.wait(timeout=self.seconds + extra, check=False)
        self.srv.wait(timeout=10 + self.hold, check=False)
        return self.cli.last_json(), self.srv.last_json()

    def check(self, c, s, watcher, *, counts=True, stall=True):
        """Both programs saw a perfect stream, and the connection was virtual."""
        assert_same_stream(c, s)
        assert c["sent_bytes"] == self.nbytes and c["recv_bytes"] == self.nbytes, c
        assert self.cli.returncode == 0, self.cli.failure("the client failed")
        assert self.srv.returncode == 0, self.srv.failure("the server failed")
        assert c["peer"] == self.addr and s["local"] == self.addr, (c, s)
        for r in (c, s):
            assert r.get("names_checked", 0) > 0 and r.get("names_changed") == [], \
                f"the {r['role']} saw its socket's names change (getsockname/getpeername " \
                f"must answer the original addresses throughout): {r.get('names_changed')}"
        if stall:
            assert c["seconds"] <= self.seconds + STALL_SLACK, \
                f"the stream took {c['seconds']} s for a nominal {self.seconds} s: the " \
                f"connection stood still for seconds"
        if counts:
            assert_virtual(watcher, SERVER, self.addr, CLIENT, c2s_bytes=self.nbytes +
                           HEADER_BYTES, s2c_bytes=self.nbytes, exact=True,
                           client_pid=self.cli.pid)
        else:
            assert_virtual(watcher, SERVER, self.addr, CLIENT, client_pid=self.cli.pid)


def status_ok(host):
    """`vmictl status --json` of host, checked for the documented link-failure fields."""
    status = vmictl_status(host)
    problems = failover_problems(status)
    assert not problems, f"{host}: " + "\n".join(problems)
    return status


def wait_moved(addr, before, timeout=FAILOVER_TIMEOUT):
    """Waits until both ends of the connection to addr run on eth1 after at least one
    failover, and checks what vmictl shows then: the physical link on the eth1 addresses,
    the program's addresses unchanged. Returns the client end's record."""
    c = wait_conn(CLIENT, addr,
                  lambda c: c.get("gid") == before["gid"] and c.get("network") == ETH1
                  and isinstance(c.get("failovers"), int) and c["failovers"] >= 1,
                  timeout, f"the client end of {before['gid']} on {ETH1} after a failover")
    assert c["local"] == before["local"] and c["peer"] == before["peer"], \
        f"local/peer must keep showing what the program sees: before {before}, now {c}"
    assert str(c.get("link_local", "")).startswith(f"{H1_IP1}:") \
        and str(c.get("link_peer", "")).startswith(f"{H2_IP1}:"), \
        f"the client end's physical link should be {H1_IP1}:* -> {H2_IP1}:* on {ETH1}: {c}"
    s = wait_conn(SERVER, addr,
                  lambda s: s.get("gid") == before["gid"] and s.get("network") == ETH1
                  and isinstance(s.get("failovers"), int) and s["failovers"] >= 1,
                  timeout, f"the server end of {before['gid']} on {ETH1} after a failover",
                  side="server")
    assert s["local"] == addr, s
    assert str(s.get("link_local", "")).startswith(f"{H2_IP1}:") \
        and str(s.get("link_peer", "")).startswith(f"{H1_IP1}:"), \
        f"the server end's physical link should be {H2_IP1}:* -> {H1_IP1}:* on {ETH1}: {s}"
    status_ok(CLIENT)
    status_ok(SERVER)
    return c


def all_moved(addr, minimum):
    """A wait_status check: at least `minimum` client ends to addr are listed, and all of
    them run on eth1 after at least one failover."""
    def check(status):
        cs = client_conns(status, addr)
        return len(cs) >= minimum and all(
            c.get("network") == ETH1 and isinstance(c.get("failovers"), int)
            and c["failovers"] >= 1 for c in cs)
    return check


def server_conns_seen(watcher, addr):
    """The Watcher's last records of the server ends at addr."""
    return [c for c in watcher.connections(SERVER) if c.get("local") == addr]


def latest_client_end(watcher, addr, gid):
    """The Watcher's last record of the client end of connection gid."""
    ends = [c for c in watcher.connections(CLIENT) if c.get("peer") == addr
            and c.get("gid") == gid]
    assert ends, f"{CLIENT} never listed connection {gid}\n{watcher.summary(CLIENT)}"
    return ends[-1]


# ---------------------------------------------------------------------------------------------
# The status document


def test_status_networks(topology):
    """Every agent lists its node's two networks, in service, with their addresses, and
    `vmictl status --json` has the documented networks/paths/connection fields."""
    for host, addrs in ((CLIENT, (H1_IP, H1_IP1)), (SERVER, (H2_IP, H2_IP1))):
        status = status_ok(host)
        for name, addr in zip((ETH0, ETH1), addrs):
            n = network_entry(status, name)
            assert n is not None, f"{host}: no network {name} in {status.get('networks')}"
            assert n["addr"] == addr and n["admin"] == "up", f"{host}: {n}"


def test_net_by_address_and_unknown(procs, faults):
    """`vmictl net down|up` accepts one of the node's addresses as well as an interface name,
    and refuses a network the node is not on with a non-zero exit status and a message."""
    faults.net_down(CLIENT, H1_IP)
    n = network_entry(status_ok(CLIENT), ETH0)
    assert n is not None and n["admin"] == "down", \
        f"after `vmictl net down {H1_IP}` {ETH0} should be out of service: {n}"
    assert network_entry(status_ok(CLIENT), ETH1)["admin"] == "up"
    faults.net_up(CLIENT, H1_IP)
    n = network_entry(status_ok(CLIENT), ETH0)
    assert n is not None and n["admin"] == "up", \
        f"after `vmictl net up {H1_IP}` {ETH0} should be back in service: {n}"
    for bad in ("eth9", "10.99.0.1"):
        for verb in ("down", "up"):
            r = vmictl(CLIENT, "net", verb, bad)
            assert r.returncode != 0, \
                f"`vmictl net {verb} {bad}` succeeded in {CLIENT}, which has no such network"
            assert (r.stderr + r.stdout).strip(), f"`vmictl net {verb} {bad}` failed silently"
    for name in (ETH0, ETH1):
        assert network_entry(status_ok(CLIENT), name)["admin"] == "up"


# ---------------------------------------------------------------------------------------------
# One network fails; the connection moves to the other without loss


def stream_through_link_down(procs, faults, port, *client_args):
    """A 6 s stream whose client host's eth0 goes down after FAULT_AFTER; waits until the
    connection moved and checks the stream. Returns (stream, watcher, the client end before,
    the client's result)."""
    st = Stream(procs, port, seconds=6)
    with Watcher(CLIENT, SERVER) as w:
        st.start(*client_args)
        before = st.wait_flowing()
        time.sleep(FAULT_AFTER)
        faults.link_down(CLIENT, ETH0)
        wait_moved(st.addr, before)
        c, s = st.finish()
    st.check(c, s, w)
    return st, w, before, c


def test_loud_link_down(procs, faults):
    """eth0 of the client host goes down mid-stream (its routes vanish, sends fail at once):
    the connection moves to eth1 and the program sees nothing."""
    st, w, before, _ = stream_through_link_down(procs, faults, PORTS["failover_loud"])
    end = latest_client_end(w, st.addr, before["gid"])
    assert end.get("network") == ETH1 and end.get("failovers", 0) >= 1, end


def test_link_down_while_the_program_runs_subprocesses(procs, faults):
    """The client runs `true` through Python's subprocess (vfork + exec) every 0.1 s while it
    streams; eth0 goes down mid-stream. The exec in each vfork child must leave the client's
    own control thread alone (the child shares the client's memory): the connection moves to
    eth1 and the program sees nothing."""
    _, _, _, c = stream_through_link_down(procs, faults, PORTS["failover_spawn"], "--spawn", 0.1)
    assert c.get("spawned", 0) > 10 and c.get("spawn_errors") == 0, c


def test_fork_shared_connection(procs, faults):
    """A forking server's child streams over an accepted connection while the parent keeps
    its copy open; the client host's eth0 goes down mid-stream. Whichever of the two server
    processes gets the rebuilt link, the child keeps streaming over it: the client receives
    exactly what the child sent."""
    port = PORTS["failover_fork_shared"]
    addr = f"{SERVER_IP}:{port}"
    srv = procs.server(SERVER, python_prog("fork_stream.py", "server", "--bind", addr, "--seconds", 5),
                       port, layer=True, name="fork-stream-server")
    with Watcher(CLIENT, SERVER):
        cli = procs.start(CLIENT, python_prog("fork_stream.py", "client", "--connect", addr),
                          layer=True, name="fork-stream-client")
        wait_conn(CLIENT, addr, lambda c: c.get("bytes_received", 0) > 0, FLOWING_TIMEOUT,
                  "the forked child's stream")
        time.sleep(FAULT_AFTER)
        faults.link_down(CLIENT, ETH0)
        cli.wait(timeout=40, check=False)
        srv.wait(timeout=20, check=False)
    c, child = cli.last_json(), srv.last_json()
    assert "error" not in c and "error" not in child, (c, child)
    assert c["recv_bytes"] == child["sent_bytes"] > 0, (c, child)
    assert c["recv_sha256"] == child["sent_sha256"], (c, child)


@pytest.mark.parametrize("streamer", ["child", "parent"])
def test_link_fails_after_fork_while_holder_is_idle(procs, faults, streamer):
    """A connection shared by fork, where one process closes its copy at once and the other
    (the streamer) makes no call on it for 3 s. child: the classic forking server, whose
    parent closes the accepted connection right after fork. parent: a child that closes what
    it inherited. The client host's eth0 goes down as soon as the copy is closed, so the
    client's layer rebuilds the link while the only process on the server's node holding the
    connection has not touched it since the fork. That process must still be known to its
    agent as a holder (a forked child says so inside fork; a child closing its copy must not
    speak for its parent), take the rebuilt link, and then stream as usual: the client
    receives exactly what was sent, and nobody sees an error."""
    port = PORTS["failover_fork_idle_holder"] + (streamer == "parent")
    addr = f"{SERVER_IP}:{port}"
    srv = procs.server(SERVER, python_prog("fork_stream.py", "server", "--bind", addr,
                                           "--seconds", 2, "--streamer", streamer,
                                           "--idle-closes", "--streamer-waits", 3),
                       port, layer=True, name="fork-stream-server")
    with Watcher(CLIENT, SERVER):
        cli = procs.start(CLIENT, python_prog("fork_stream.py", "client", "--connect", addr),
                          layer=True, name="fork-stream-client")
        deadline = time.monotonic() + FLOWING_TIMEOUT
        while not any(r.get("event") == "closed" for r in srv.json_lines()):
            assert time.monotonic() < deadline, srv.failure("the idle copy was never closed")
            time.sleep(0.02)
        faults.link_down(CLIENT, ETH0)
        cli.wait(timeout=40, check=False)
        srv.wait(timeout=20, check=False)
    c = cli.last_json()
    sent = [r for r in srv.json_lines() if r.get("role") == streamer and "event" not in r]
    assert sent, srv.failure("the streamer printed nothing")
    assert "error" not in c and "error" not in sent[-1], (c, sent)
    assert c["recv_bytes"] == sent[-1]["sent_bytes"] > 0, (c, sent)
    assert c["recv_sha256"] == sent[-1]["sent_sha256"], (c, sent)
    assert cli.returncode == 0 and srv.returncode == 0, (cli.returncode, srv.returncode)


@pytest.mark.parametrize("spawn", ["fork", "subprocess"])
def test_link_fails_after_exec_with_bytes_in_flight(procs, faults, spawn):
    """A server sends 96 KiB that the client does not read yet (they wait in the kernels'
    buffers, unacknowledged by the client's layer), then hands the connection to a new
    program across exec (fork + exec), which sends 1 MiB more. The client host's eth0 then
    goes down, before the client has read anything, and the old socket's buffers are lost
    with it: the old image's unacknowledged bytes, carried across the exec, are replayed on
    the rebuilt link. The client reads exactly the stream's bytes (SHA-256), and the new
    image's sends all succeed. subprocess: the helper starts through Python's subprocess
    (vfork + exec), and the server closes its copy once the helper runs: the server must then
    no longer count as a holder (a link offered to it would be answered "no such
    connection")."""
    port = PORTS["failover_after_exec" if spawn == "fork" else "failover_after_subprocess"]
    addr = f"{SERVER_IP}:{port}"
    before, after, seed = 96 << 10, MiB, port
    srv = procs.server(SERVER, python_prog("exec_stream.py", "server", "--bind", addr,
                                           "--before", before, "--after", after, "--seed", seed,
                                           "--spawn", spawn),
                       port, layer=True, name="exec-stream-server")
    with Watcher(CLIENT, SERVER):
        cli = procs.start(CLIENT, python_prog("exec_stream.py", "client", "--connect", addr,
                                              "--pause", 4, "--total", before + after,
                                              "--seed", seed),
                          layer=True, name="exec-stream-client")
        deadline = time.monotonic() + FLOWING_TIMEOUT
        while not any(r.get("event") == "started" for r in srv.json_lines()):
            assert time.monotonic() < deadline, srv.failure("the helper never started")
            time.sleep(0.05)
        time.sleep(0.3)
        faults.link_down(CLIENT, ETH0)
        cli.wait(timeout=40, check=False)
        srv.wait(timeout=20, check=False)
    c = cli.last_json()
    lines = srv.json_lines()
    helper = [r for r in lines if r.get("role") == "helper" and "event" not in r]
    server = [r for r in lines if r.get("role") == "server"]
    assert c.get("ok"), f"client: {c}\nserver side: {lines}\n{srv.stderr()[-3000:]}"
    assert helper and helper[-1].get("sent_bytes") == after, (helper, srv.stderr()[-3000:])
    assert server and server[-1]["helper_status"] == 0, server
    assert cli.returncode == 0 and srv.returncode == 0


def test_silent_blackhole(procs, faults):
    """The client host's eth0 veth is taken off its bridge mid-stream: the interface stays up
    and sends succeed, only silence tells. The agents declare the eth0 path dead (after
    --dead-after, 50 ms by default) and the connection moves to eth1 without loss; when the
    veth is back on the bridge, the path is alive again."""
    st = Stream(procs, PORTS["failover_blackhole"], seconds=6)
    with Watcher(CLIENT, SERVER) as w:
        st.start()
        before = st.wait_flowing()
        time.sleep(FAULT_AFTER)
        faults.blackhole(CLIENT, 0)
        path = wait_status(CLIENT, lambda status: next(
            (p for p in paths_on(status, ETH0) if p.get("local") == H1_IP
             and p.get("peer") == H2_IP and p.get("state") == "dead"), None),
            FAILOVER_TIMEOUT, f"the path {H1_IP} -> {H2_IP} dead during the black hole")
        assert isinstance(path.get("silent_ms"), int) and path["silent_ms"] >= DEAD_AFTER_MS, \
            f"a dead path has been silent for at least {DEAD_AFTER_MS} ms: {path}"
        wait_moved(st.addr, before)
        c, s = st.finish()
    st.check(c, s, w)
    faults.unblackhole(CLIENT, 0)
    wait_status(CLIENT, lambda status: next(
        (p for p in paths_on(status, ETH0) if p.get("local") == H1_IP
         and p.get("peer") == H2_IP and p.get("state") == "alive"), None),
        FAILOVER_TIMEOUT, f"the path {H1_IP} -> {H2_IP} alive again after the black hole")


CALM_AFTER = 3.0       # agent/src/paths.rs: nothing but heartbeats this long makes a node calm
CALM_WAKEUPS = 80      # a calm agent's wake-ups per second at most (a busy one: about 250)
BLACKHOLE_AFTER = 15.0  # the calm test's black hole after the echo: several neighbour resolutions


def wakeups(pid):
    """Context switches of every thread of process pid so far."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/status") as f:
            for line in f:
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
    return total


def idle_echo_pair(procs, addr, port):
    """An echo server at addr (server host) and idle_echo.py (client host, idle 120 s after
    its first echo), both layered: (the client, its connection on ETH0 once it is idle)."""
    procs.server(SERVER, python_prog("echo_server.py", "--bind", addr), port, layer=True,
                 name="echo-server")
    cli = procs.start(CLIENT, python_prog("idle_echo.py", "--connect", addr, "--idle", 120),
                      layer=True, name="idle-echo")
    deadline = time.monotonic() + FLOWING_TIMEOUT
    while not any(r.get("event") == "idle" for r in cli.json_lines()):
        assert cli.alive() and time.monotonic() < deadline, cli.failure("no first echo")
        time.sleep(0.05)
    return cli, wait_conn(CLIENT, addr, lambda c: c.get("network") == ETH0, FLOWING_TIMEOUT,
                          f"the client end to {addr} on {ETH0}")


def journal(host):
    """The events of host's journal (`vmictl events --json`)."""
    return [json.loads(x) for x in vmictl(host, "events", "--json").stdout.splitlines()
            if x.strip()]


def test_calm_node_then_silent_failure(procs, faults, topology):
    """When the networks carry nothing but heartbeats for CALM_AFTER, the agents slow their
    heartbeats to one a second, and each heartbeat says how long the next may take, so
    neither side takes the other's slower beat for a dead path: the client host's agent then
    wakes up a few times a second instead of hundreds, and no path dies. A connection idle
    through all that is black-holed on eth0; when the program echoes again, the path is found
    dead (within the calm interval plus the silence limit), the connection moves to eth1 and
    every byte comes back; no path on eth1 ever dies, before, during or after the black hole
    (each agent's heartbeats on eth1 keep their pace while eth0's peer cannot be reached)."""
    port = PORTS["failover_calm"]
    addr = f"{SERVER_IP}:{port}"
    cli, before = idle_echo_pair(procs, addr, port)
    # A new topology's interfaces send IPv6 neighbour discovery for a while (each packet
    # makes the node busy for CALM_AFTER), and a path that died less than a minute ago (an
    # earlier test's agent in the third host) keeps the node at the busy interval
    # (paths.rs, `calm`): look at 2-second windows until one is calm.
    pid = topology["agents"][CLIENT].proc.pid
    deadline = time.monotonic() + CALM_AFTER + 75
    rates = []
    while True:
        w0, t0 = wakeups(pid), time.monotonic()
        time.sleep(2)
        rates.append(round((wakeups(pid) - w0) / (time.monotonic() - t0)))
        if rates[-1] < CALM_WAKEUPS:
            break
        assert time.monotonic() < deadline, \
            f"the client host's agent never calmed down: wake-ups a second {rates}"
    # (Paths toward the two hosts only: an earlier test may have left this agent a path to a
    # node whose agent is gone, dead since.)
    names = {h: vmictl_status(h)["node"] for h in (CLIENT, SERVER)}
    other = {CLIENT: names[SERVER], SERVER: names[CLIENT]}
    wait_status(CLIENT, lambda status: (lambda ps: ps and all(
        p.get("heartbeat_ms", 0) >= 1000 and p.get("peer_heartbeat_ms", 0) >= 1000 for p in ps))(
        [p for p in status.get("paths") or [] if p.get("node") == other[CLIENT]]), 10,
        "every path between the two hosts at one heartbeat a second, both ways")
    for host in (CLIENT, SERVER):
        dead = [p for p in vmictl_status(host).get("paths") or []
                if p.get("node") == other[host] and p.get("state") != "alive"]
        assert not dead, f"{host}: paths not alive on a calm node: {dead}"
    last = {h: max((e.get("seq", 0) for e in journal(h)), default=0) for h in (CLIENT, SERVER)}
    with Watcher(CLIENT, SERVER) as w:
        faults.blackhole(CLIENT, 0)
        os.kill(cli.pid, signal.SIGUSR1)
        cli.wait(timeout=40, check=False)
        # The black hole lasts a few seconds more, with the peers' addresses on eth0 out of
        # the neighbour tables (as the kernel drops them by itself within a minute): each
        # heartbeat to the unreachable peer then waits in the kernel for the address, which
        # it tries to resolve for 3 s, again and again, while eth1's heartbeats go on.
        for host in (CLIENT, SERVER):
            ip_cmd("-n", host, "neigh", "flush", "dev", ETH0)
        time.sleep(BLACKHOLE_AFTER)
    c = cli.last_json()
    assert "error" not in c and c.get("same") is True, c
    assert c.get("echoed") == 64 * 1024 + 4 * MiB, c
    assert cli.returncode == 0, cli.failure("idle_echo.py failed")
    # The program may end between two of the watcher's looks: the client node's journal has
    # every failover of its processes.
    events = {h: [e for e in journal(h) if e.get("seq", 0) > last[h]] for h in (CLIENT, SERVER)}
    seen = [x for x in w.conns[CLIENT].values() if x.get("gid") == before["gid"]]
    moved = [e for e in events[CLIENT] if e.get("kind") == "failover"
             and e.get("gid") == before["gid"] and e.get("local", "").startswith(f"{H1_IP1}:")]
    assert moved or any(x.get("network") == ETH1 and (x.get("failovers") or 0) >= 1
                        for x in seen), \
        f"the connection should have moved to {ETH1} after the black hole: {seen}, " \
        f"{[e for e in events[CLIENT] if e.get('gid') == before['gid']]}"
    flaps = {h: [e for e in events[h] if e.get("kind") == "path" and e.get("network") == ETH1
                 and e.get("node") == other[h]] for h in (CLIENT, SERVER)}
    assert not any(flaps.values()), f"paths on {ETH1} died or came back: {flaps}"


def test_flapping(procs, faults):
    """eth0 of the client host goes down and up every 200 ms for 10 s while the stream runs:
    the connection survives every change without loss."""
    st = Stream(procs, PORTS["failover_flap"], seconds=12)
    with Watcher(CLIENT, SERVER) as w:
        st.start()
        before = st.wait_flowing()
        time.sleep(FAULT_AFTER)
        flapper = faults.flap(CLIENT, ETH0, period=0.2, duration=10.0)
        assert flapper.join(timeout=20), "the flapping did not stop"
        flapper.check()
        assert flapper.toggles >= 20, f"only {flapper.toggles} link changes in 10 s"
        c, s = st.finish()
    st.check(c, s, w, stall=False)
    end = latest_client_end(w, st.addr, before["gid"])
    assert end.get("failovers", 0) >= 1, \
        f"eth0 went down {flapper.toggles // 2} times under the connection but vmictl " \
        f"counts no failover: {end}"


def test_all_networks_down_then_back(procs, faults):
    """Both networks of the client host go down for 5 s, then come back: the connection
    waits (the default grace is 60 s) and the stream completes without loss."""
    st = Stream(procs, PORTS["failover_all_down"], seconds=8)
    with Watcher(CLIENT, SERVER) as w:
        st.start()
        st.wait_flowing()
        time.sleep(FAULT_AFTER)
        faults.link_down(CLIENT, ETH0)
        faults.link_down(CLIENT, ETH1)
        time.sleep(5)
        for prog in (st.cli, st.srv):
            assert prog.alive(), prog.failure("gave up while no network worked, well within "
                                              "the grace period")
        faults.link_up(CLIENT, ETH0)
        faults.link_up(CLIENT, ETH1)
        c, s = st.finish()
    st.check(c, s, w, stall=False)


def test_net_admin_down(procs, faults):
    """`vmictl net down eth0` on the client host takes eth0 out of service mid-stream: status
    shows it down, the connection moves to eth1 without loss; after `vmictl net up eth0` eth0
    is back in service and the connection ends on eth1."""
    st = Stream(procs, PORTS["failover_net_admin"], seconds=8)
    with Watcher(CLIENT, SERVER) as w:
        st.start()
        before = st.wait_flowing()
        time.sleep(FAULT_AFTER)
        faults.net_down(CLIENT, ETH0)
        status = vmictl_status(CLIENT)
        n0, n1 = network_entry(status, ETH0), network_entry(status, ETH1)
        assert n0 is not None and n0["admin"] == "down", \
            f"after `vmictl net down {ETH0}` networks should show it down: {n0}"
        assert n1 is not None and n1["admin"] == "up", n1
        wait_moved(st.addr, before)
        time.sleep(1)
        faults.net_up(CLIENT, ETH0)
        n0 = network_entry(vmictl_status(CLIENT), ETH0)
        assert n0 is not None and n0["admin"] == "up", \
            f"after `vmictl net up {ETH0}` networks should show it up: {n0}"
        c, s = st.finish()
    st.check(c, s, w)
    end = latest_client_end(w, st.addr, before["gid"])
    assert end.get("network") == ETH1 and end.get("failovers", 0) >= 1, \
        f"the connection should end on {ETH1}: {end}"


# ---------------------------------------------------------------------------------------------
# The agent is not on the data path


def test_agent_killed(procs, agent_control):
    """The client host's agent is killed (SIGKILL) mid-stream: the stream completes without
    loss. (The server's agent stops hearing it, so this also checks that a dead agent is
    not taken for a dead network.) The agent is started again for the tests that follow."""
    st = Stream(procs, PORTS["failover_agent_kill"], seconds=6)
    with Watcher(CLIENT, SERVER) as w:
        st.start()
        st.wait_flowing()
        time.sleep(FAULT_AFTER)
        agent_control.kill(CLIENT)
        c, s = st.finish()
    agent_control.restart(CLIENT)
    # vmictl in CLIENT had nothing to say after the kill, so the client end's last counts
    # are from before it: check only the server end's exactly.
    st.check(c, s, w, counts=False, stall=False)
    ends = server_conns_seen(w, st.addr)
    assert sum(e["bytes_received"] for e in ends) == st.nbytes + HEADER_BYTES, ends
    assert sum(e["bytes_sent"] for e in ends) == st.nbytes, ends


# ---------------------------------------------------------------------------------------------
# No network for longer than the grace period

GRACE = 2


def test_grace_expires(procs, faults):
    """With VMI_GRACE=2 and both networks of the client host down for good, the connection
    gives up: the client program's calls fail with ETIMEDOUT after roughly 2 s (2 to 10 s),
    not at once and not never; the server's end fails too."""
    env = {GRACE_ENV: str(GRACE)}
    st = Stream(procs, PORTS["failover_grace"], seconds=40, env=env, hold=0)
    with Watcher(CLIENT, SERVER):
        st.start()
        st.wait_flowing()
        time.sleep(FAULT_AFTER)
        faults.link_down(CLIENT, ETH0)
        faults.link_down(CLIENT, ETH1)
        t0 = time.monotonic()
        while st.cli.alive() and time.monotonic() - t0 < 10 + 5:
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        assert not st.cli.alive(), st.cli.failure(
            f"the client still runs {elapsed:.1f} s after every network went down, with "
            f"{GRACE_ENV}={GRACE}")
        st.srv.wait(timeout=15, check=False)
    c, s = st.cli.last_json(), st.srv.last_json()
    assert GRACE * 0.75 <= elapsed <= 10 + 2, \
        f"the client gave up {elapsed:.1f} s after the networks went down; with " \
        f"{GRACE_ENV}={GRACE} it should take roughly {GRACE} s (at most 10): {c}"
    assert "error" in c and st.cli.returncode == 1, c
    assert "ETIMEDOUT" in c.get("errnos", []), \
        f"the client's calls should fail with ETIMEDOUT once the grace is over: {c}"
    assert "error" in s, f"the server's end should fail as well: {s}"
    assert "ETIMEDOUT" in s.get("errnos", []), \
        f"the server's calls should fail with ETIMEDOUT once the grace is over: {s}"


# ---------------------------------------------------------------------------------------------
# Someone who knows the GID but not the secret


def test_resume_attack(procs):
    """An attacker in the client host (no layer) learns the connection's GID from vmictl and
    dials the server host's agent on both networks: Resume with that GID, then a Proof with a
    random mac, with delivered 0 and mac 0, and with a mac keyed by a guessed secret; and a
    Resume for a GID nobody holds. Every attempt is refused (Error, or the holder closes;
    Error for the unknown GID), the server's layer logs "refused", and the real connection
    keeps running on its link, untouched, to a perfect end."""
    env = {"VMI_LOG": LAYER_LOG if LAYER_LOG in ("warn", "info", "debug", "trace") else "warn"}
    st = Stream(procs, PORTS["failover_resume_attack"], seconds=10, env=env)
    with Watcher(CLIENT, SERVER) as w:
        st.start()
        before = st.wait_flowing()
        gid = before["gid"]
        wait_conn(SERVER, st.addr, lambda s: s.get("gid") == gid, FLOWING_TIMEOUT,
                  f"the server end of {gid}", side="server")
        atk = procs.run(CLIENT, python_prog(
            "resume_attack.py", "--gid", gid, "--target", f"{H2_IP1}:{AGENT_PORT}",
            "--target", f"{H2_IP}:{AGENT_PORT}", "--timeout", 3, "--seed", st.port),
            layer=False, name="resume-attack", timeout=60, check=False)
        during = st.cli.alive()
        after = wait_conn(CLIENT, st.addr, lambda c: c.get("gid") == gid, 2,
                          "the connection after the attack") if during else None
        c, s = st.finish()
    lines = atk.json_lines()
    attempts = [r for r in lines if "case" in r]
    assert len(attempts) == 8 and lines[-1].get("summary"), atk.failure("incomplete attack")
    assert not [r for r in attempts if r["outcome"] == "taken_over"], \
        f"the attacker resumed the connection without its secret: {attempts}"
    for r in attempts:
        if r["case"] == "unknown_gid":
            assert r["resume_reply"] == "Error" and r["outcome"] == "refused", \
                f"a Resume for an unknown GID must be answered with Error: {r}"
        else:
            assert r["resume_reply"] == "Challenge", \
                f"a Resume for the connection's GID should reach its holder and get a " \
                f"Challenge: {r}"
            assert r["outcome"] == "refused" and r["proof_reply"] in ("Error", "closed"), \
                f"a wrong Proof must be answered with Error or a close: {r}"
    assert atk.returncode == 0, atk.failure("resume_attack.py reports a takeover")
    assert during, "the stream ended before the attack did: the test proves nothing"
    assert after.get("network") == ETH0 and after.get("failovers") == 0 \
        and after.get("link_local") == before.get("link_local") \
        and after.get("link_peer") == before.get("link_peer"), \
        f"the attack touched the real connection's link: before {before}, after {after}"
    st.check(c, s, w)
    assert "refused" in st.srv.stderr(), st.srv.failure(
        "the server's layer logged no line containing \"refused\" for the failed resumes")


# ---------------------------------------------------------------------------------------------
# Real programs across a failover


def test_iperf3_failover(procs, faults):
    """iperf3 (client in the client host, -t 6) with the client host's eth0 down from 2 s on:
    iperf3 exits 0, reports no error, and keeps moving data after the failover; all its
    connections end up on eth1."""
    port = PORTS["failover_iperf3"]
    addr = f"{SERVER_IP}:{port}"
    procs.server(SERVER, ["iperf3", "-s", "-B", SERVER_IP, "-p", port], port, layer=True,
                 name="iperf3-server")
    with Watcher(CLIENT, SERVER) as w:
        cli = procs.start(CLIENT, ["iperf3", "-c", SERVER_IP, "-p", port, "-t", "6", "--json"],
                          layer=True, name="iperf3-client")
        t0 = time.monotonic()
        wait_conn(CLIENT, addr, lambda c: c.get("bytes_sent", 0) > 0, FLOWING_TIMEOUT,
                  "iperf3's connections")
        time.sleep(max(0.0, 2.0 - (time.monotonic() - t0)))
        assert cli.alive(), cli.failure("iperf3 ended before the fault")
        faults.link_down(CLIENT, ETH0)
        wait_status(CLIENT, all_moved(addr, 2), FAILOVER_TIMEOUT,
                    f"all iperf3 connections to {addr} on {ETH1}")
        cli.wait(timeout=40, check=False)
    assert cli.returncode == 0, cli.failure("iperf3 failed across the failover")
    res = cli.json()
    assert "error" not in res, f"iperf3 reported an error: {res['error']}"
    sent, received = res["end"]["sum_sent"], res["end"]["sum_received"]
    assert sent["bytes"] > 0 and received["bytes"] > 0, res["end"]
    late = [i["sum"]["bytes"] for i in res["intervals"] if i["sum"]["start"] >= 4.0]
    assert late and sum(late) > 0, \
        f"iperf3 moved nothing in its last seconds, after the failover: {late}"
    assert_virtual(w, SERVER, addr, CLIENT, min_conns=2, c2s_bytes=received["bytes"])


def test_idle_connection_moved_four_times_then_used(procs, faults):
    """A connection makes one echo, then no call at all while the client host's networks fail
    in turn (eth0 down: it moves to eth1; eth0 back and eth1 down: back to eth0; twice), then
    echoes 4 MiB: every move of an idle connection leaves the program's next calls, and the
    waits in them, working on the new link, and every byte comes back."""
    port = PORTS["failover_idle_moves"]
    addr = f"{SERVER_IP}:{port}"
    cli, c = idle_echo_pair(procs, addr, port)
    gid, moves = c["gid"], 0
    for down, up in ((ETH0, ETH1), (ETH1, ETH0), (ETH0, ETH1), (ETH1, ETH0)):
        faults.link_down(CLIENT, down)
        moves += 1
        c = wait_conn(CLIENT, addr, lambda c, up=up, n=moves: c.get("gid") == gid
                      and c.get("network") == up and (c.get("failovers") or 0) >= n,
                      FAILOVER_TIMEOUT * 2, f"move {moves}: the idle connection on {up}")
        faults.link_up(CLIENT, down)
        wait_status(CLIENT, lambda st, d=down: any(
            p.get("state") == "alive" and p.get("network") == d for p in st.get("paths") or []),
            FAILOVER_TIMEOUT * 2, f"a path on {down} alive again")
    os.kill(cli.pid, signal.SIGUSR1)
    cli.wait(timeout=40, check=False)
    r = cli.last_json()
    assert "error" not in r and r.get("same") is True, r
    assert r.get("echoed") == 64 * 1024 + 4 * 1024 * 1024, r
    assert cli.returncode == 0, cli.failure("idle_echo.py failed")


MANY = 400


def test_hundreds_of_connections_in_one_event_loop_fail_over(procs, faults):
    """400 asyncio echo clients (one process, one epoll instance) talk to an asyncio echo
    server (one process, one epoll instance) across hosts, each client sending a message every
    0.2 s; eth0 of the client host goes down while they do. Every connection moves to eth1
    (at both ends each old socket leaves the program's epoll instance and the new one is
    registered with the program's events and data: hundreds of them in a burst), both event
    loops keep being woken for every connection, and every echo comes back whole."""
    port = PORTS["failover_many"]
    addr = f"{SERVER_IP}:{port}"
    procs.server(SERVER, python_prog("echo_server.py", "--bind", addr), port, layer=True,
                 name="echo-many-server")
    cli = procs.start(CLIENT, python_prog("echo_clients.py", "--connect", addr, "--clients", MANY,
                                        "--messages", 40, "--max-size", 4096, "--seed", 5,
                                        "--gap", 0.2),
                      layer=True, name="echo-many-clients")
    wait_status(CLIENT, lambda st: len(client_conns(st, addr)) >= MANY, FLOWING_TIMEOUT,
                f"{MANY} connections to {addr}")
    gids = {c["gid"] for c in client_conns(vmictl_status(CLIENT), addr)}
    time.sleep(2.0)
    assert cli.alive(), cli.failure("the clients ended before the fault")
    faults.link_down(CLIENT, ETH0)
    t0 = time.monotonic()
    wait_status(CLIENT, all_moved(addr, MANY), FAILOVER_TIMEOUT * 4,
                f"all {MANY} connections to {addr} on {ETH1}")
    moved = time.monotonic() - t0
    cli.wait(timeout=60, check=False)
    r = cli.last_json()
    assert cli.returncode == 0, cli.failure("echo clients failed across the failover")
    assert r["mismatches"] == 0 and r["error_count"] == 0, r
    assert r["completed"] == MANY and r["messages"] == MANY * 40, r
    print(f"\nvmit: {MANY} connections of one event loop moved to {ETH1} within {moved:.2f} s; "
          f"{r['messages']} echoes whole")
    # Each rebuilt link went to the relink port its GID picks (vmi-agent --relink-ports), as
    # both ends' failover events say; between them the links used every port.
    used = relink_ports_used((CLIENT, SERVER), gids)
    assert set(used) == gids, f"{len(gids - set(used))} connections without a failover event"
    wrong = {g: p for g, p in used.items() if p != {relink_port(g)}}
    assert not wrong, f"links rebuilt to other ports than their GID picks: {list(wrong.items())[:5]}"
    spread = sorted(p for ps in used.values() for p in ps)
    assert set(spread) == set(range(AGENT_PORT, AGENT_PORT + AGENT_RELINK_PORTS)), spread


def relink_port(gid):
    """The agent port a rebuilt link of connection gid (hex) goes to: agent/src/local.rs,
    relink_ports (the low 64 bits of the GID, modulo the number of ports)."""
    return AGENT_PORT + (int(gid, 16) & ((1 << 64) - 1)) % AGENT_RELINK_PORTS


def relink_ports_used(hosts, gids):
    """{gid: {agent ports its rebuilt links went to}} from the failover events of hosts'
    agents: the peer's port where the process dialed, its own where it was handed the link."""
    out = {}
    for host in hosts:
        r = vmictl(host, "events", "--json", timeout=15)
        assert r.returncode == 0, r.stderr
        for line in r.stdout.splitlines():
            e = json.loads(line)
            if e.get("kind") == "failover" and e.get("gid") in gids:
                at = e["peer"] if e["side"] == "dialer" else e["local"]
                out.setdefault(e["gid"], set()).add(int(at.rsplit(":", 1)[1]))
    return out


REDIS_SECONDS = 5.0     # redis-benchmark is sized to run about this long
REDIS_FAULT_AT = 1.5    # seconds after it starts
REDIS_CLIENTS = 50


def redis_rps(out, test="SET"):
    """Requests per second redis-benchmark -q printed for test (None if it printed none)."""
    m = re.search(rf"^{test}: ([0-9.]+) requests per second", out.replace("\r", "\n"), re.M)
    return float(m.group(1)) if m else None


def test_redis_failover(procs, faults):
    """redis-benchmark (50 clients, SET, keep-alive) against redis-server across hosts, both
    under the layer, with the client host's eth0 down from 1.5 s on: all 50 connections move
    to eth1 and redis-benchmark completes with no error."""
    port = PORTS["failover_redis"]
    addr = f"{SERVER_IP}:{port}"
    procs.server(SERVER, ["redis-server", "--port", port, "--bind", SERVER_IP, "--save", "",
                          "--appendonly", "no", "--protected-mode", "no"],
                 port, layer=True, name="redis-server")
    bench = ["redis-benchmark", "-h", SERVER_IP, "-p", port, "-q", "-t", "set", "-k", "1",
             "-c", REDIS_CLIENTS]
    # How fast this machine is, so that the real run lasts long enough to be hit.
    cal = procs.run(CLIENT, [*bench, "-n", "20000"], layer=True, name="redis-calibrate",
                    timeout=40)
    rps = redis_rps(cal.stdout())
    assert rps, f"redis-benchmark printed no SET figure:\n{cal.stdout()[-2000:]}"
    n = int(min(max(rps * REDIS_SECONDS, 50_000), 2_000_000))
    with Watcher(CLIENT, SERVER) as w:
        run = procs.start(CLIENT, [*bench, "-n", n], layer=True, name="redis-benchmark")
        time.sleep(REDIS_FAULT_AT)
        assert run.alive(), run.failure(f"redis-benchmark -n {n} ended before the fault "
                                        f"({rps:.0f} requests/s when calibrated)")
        faults.link_down(CLIENT, ETH0)
        wait_status(CLIENT, all_moved(addr, REDIS_CLIENTS), FAILOVER_TIMEOUT * 2,
                    f"all {REDIS_CLIENTS} redis connections to {addr} on {ETH1}")
        run.wait(timeout=60, check=False)
    assert run.returncode == 0, run.failure("redis-benchmark failed across the failover")
    out = run.stdout()
    assert redis_rps(out), f"redis-benchmark printed no SET result:\n{out[-2000:]}"
    errors = [line for line in program_lines(out.replace("\r", "\n") + "\n" + run.stderr())
              if re.search(r"error|ERR |Writing to socket|Reading from socket", line, re.I)]
    assert not errors, f"redis-benchmark reported errors: {errors[:10]}"
    assert_virtual(w, SERVER, addr, CLIENT, min_conns=REDIS_CLIENTS)


# ---------------------------------------------------------------------------------------------
# New connections while the chosen network is dead
#
# The client's agent announces the connection to the server node's address on a working
# network and the layer connects there; both programs keep seeing the addresses the client
# asked for (getpeername at the client, getsockname at the server). A listener bound to the
# dead address itself cannot be reached, as natively.


@pytest.mark.parametrize("how", ["admin", "link"])
def test_new_connection_avoids_dead_network(procs, faults, how):
    """With the client host's eth0 out of service (`vmictl net down eth0`) or down
    (`ip link set eth0 down`, where a plain connect to the server's eth0 address would fail
    with ENETUNREACH), a new layered client connecting to the server's eth0 address still
    works: the layer builds the link over eth1, the program's getpeername answers the eth0
    address, and both ends see a perfect stream."""
    port = PORTS[f"failover_new_conn_{how}"]
    addr = f"{SERVER_IP}:{port}"
    # Listening on every address (as most servers do): a connection can then arrive on the
    # server host's other network.
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", f"0.0.0.0:{port}", "--count", 2,
                                           "--hold", HOLD), port, layer=True,
                       name="stream-server")

    def client(name, nbytes):
        return procs.run(CLIENT, python_prog(
            "stream.py", "client", "--connect", addr, "--bytes", nbytes, "--seed", port,
            "--hold", HOLD), layer=True, name=name, timeout=40, check=False)

    # A first connection while everything works, so the agents know each other.
    warm = client("stream-client-warmup", 1024)
    assert warm.returncode == 0, warm.failure("the warm-up stream failed")
    if how == "admin":
        faults.net_down(CLIENT, ETH0)
    else:
        faults.link_down(CLIENT, ETH0)
        wait_status(CLIENT, lambda status: next(
            (p for p in paths_on(status, ETH0) if p.get("peer") == H2_IP
             and p.get("state") == "dead"), None),
            FAILOVER_TIMEOUT, f"the path {H1_IP} -> {H2_IP} dead")
    nbytes = 4 * MiB
    with Watcher(CLIENT, SERVER) as w:
        cli = client("stream-client", nbytes)
        assert cli.returncode == 0, \
            cli.failure(f"a new connection to {addr} failed with {ETH0} {how} down")
        srv.wait(timeout=10 + HOLD, check=False)
    c = cli.last_json()
    # The server printed one line per connection: the warm-up's, then this one's.
    found = [r for r in srv.json_lines() if r.get("recv_bytes") == nbytes or "error" in r]
    assert len(found) == 1, f"the server's results for the new connection: {found}"
    s = found[0]
    assert_same_stream(c, s)
    assert c["sent_bytes"] == nbytes and c["recv_bytes"] == nbytes, c
    assert c["peer"] == addr and s["local"] == addr, \
        f"the programs should see {addr} as the server's address: {c}, {s}"
    assert_virtual(w, SERVER, addr, CLIENT, client_pid=cli.pid)
    ends = [e for e in w.connections(CLIENT) if e.get("peer") == addr
            and e.get("pid") == cli.pid]
    assert ends and all(e.get("network") == ETH1 for e in ends), \
        f"the new connection's link should run on {ETH1}: {ends}"
    assert all(str(e.get("link_peer", "")).startswith(f"{H2_IP1}:") for e in ends), ends
    gids = {e.get("gid") for e in ends}
    srv_ends = [e for e in server_conns_seen(w, addr) if e.get("gid") in gids]
    assert srv_ends and all(e.get("network") == ETH1 for e in srv_ends), \
        f"the server end's link should run on {ETH1}: {srv_ends}"


HEARTBEAT_TABLE = "vmit_noheartbeat"


def test_a_connection_made_while_heartbeats_are_lost_is_still_virtual(procs):
    """Heartbeats from the server's host stop reaching the client's (nftables drops UDP to the
    agents' port there, on every network), so the client's agent calls every path toward the
    server dead, while the networks and the agents' TCP port work. A new connection must
    still be virtual: a path that only looks dead (a busy node misses a few heartbeats) must
    not make connections plain for good, and over a path really dead the program's own
    connect could not get through either."""
    port = PORTS["failover_heartbeats_lost"]
    addr = f"{SERVER_IP}:{port}"
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", 2,
                                           "--hold", HOLD), port, layer=True,
                       name="stream-server")

    def client(name):
        return procs.run(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes",
                                             MiB, "--seed", port, "--hold", HOLD),
                         layer=True, name=name, timeout=40)

    # A first connection while everything works, so the agents watch the paths between them.
    client("stream-client-warmup")
    wait_status(CLIENT, lambda st: any(p.get("peer") == H2_IP and p.get("state") == "alive"
                                       for p in st.get("paths") or []),
                FAILOVER_TIMEOUT, f"the path {H1_IP} -> {H2_IP} alive")
    rules = (f"table inet {HEARTBEAT_TABLE} {{\n chain in {{\n"
             f"  type filter hook input priority 0; policy accept;\n"
             f"  udp dport {AGENT_PORT} drop\n }}\n}}\n")
    try:
        r = in_netns(CLIENT, ["nft", "-f", "-"], input=rules)
        assert r.returncode == 0, r.stderr
        wait_status(CLIENT, lambda st: all(
            any(p.get("peer") == ip and p.get("state") == "dead" for p in st.get("paths") or [])
            for ip in (H2_IP, H2_IP1)), FAILOVER_TIMEOUT,
            f"every path from {CLIENT} to {SERVER} dead")
        with Watcher(CLIENT, SERVER) as w:
            cli = client("stream-client")
            srv.wait(timeout=10 + HOLD)
        c = cli.last_json()
        found = [r for r in srv.json_lines() if r.get("peer") == c["local"]]
        assert len(found) == 1, f"the server's results for the new connection: {found}"
        assert_same_stream(c, found[0])
        assert_virtual(w, SERVER, addr, CLIENT, client_pid=cli.pid)
    finally:
        in_netns(CLIENT, ["nft", "delete", "table", "inet", HEARTBEAT_TABLE])
    wait_status(CLIENT, lambda st: any(p.get("peer") == H2_IP and p.get("state") == "alive"
                                       for p in st.get("paths") or []),
                FAILOVER_TIMEOUT, f"the path {H1_IP} -> {H2_IP} alive again")


END_TABLE = "vmit_lostend"


def test_end_of_stream_lost_with_its_process_still_reaches_the_reader(procs, faults, tmp_path):
    """A writer sends 2 MiB, half-closes and leaves with `_exit` (no exit handlers: nothing of
    the layer's runs after), while what its host sends on the connection's network is lost
    (nftables drops it at the reader's host): the end of stream never arrives, and the
    writer's kernel resets the socket it was in. The reader had every byte before it. Once
    its network is taken down and the link is rebuilt over the other one, no process on the
    writer's node holds the connection; the agent there answers with the stream's length and
    a proof the writer's layer made with the connection's secret when its program ended the
    stream, and the reader gets the end of stream after exactly the bytes sent (not the reset
    it got before)."""
    port = PORTS["failover_exit_after_end"]
    addr = f"{SERVER_IP}:{port}"
    go = tmp_path / "go"
    n = 2 * MiB
    srv = procs.server(SERVER, python_prog("exit_stream.py", "server", "--bind", addr,
                                           "--bytes", n, "--go", go), port, layer=True,
                       name="exit-stream-server")
    rules = (f"table inet {END_TABLE} {{\n chain in {{\n"
             f"  type filter hook input priority 0; policy accept;\n"
             f"  ip saddr {SERVER_IP} tcp sport {port} drop\n }}\n}}\n")
    try:
        with Watcher(CLIENT, SERVER) as w:
            cli = procs.start(CLIENT, python_prog("exit_stream.py", "client", "--connect", addr,
                                                  "--bytes", n), layer=True,
                              name="exit-stream-client")
            deadline = time.monotonic() + FLOWING_TIMEOUT
            while not any("got" in r for r in cli.json_lines()):
                assert time.monotonic() < deadline, cli.failure("the stream never arrived")
                time.sleep(0.02)
            time.sleep(0.5)  # (the writer waits: snapshots of the connection)
        assert_virtual(w, SERVER, addr, CLIENT, client_pid=cli.pid)
        r = in_netns(CLIENT, ["nft", "-f", "-"], input=rules)
        assert r.returncode == 0, r.stderr
        go.write_text("go")
        srv.wait(timeout=10)
        # Now the reader's network goes: its layer rebuilds the link over the other one.
        faults.link_down(CLIENT, ETH0)
        cli.wait(timeout=30, check=False)
    finally:
        in_netns(CLIENT, ["nft", "delete", "table", "inet", END_TABLE])
    c = cli.last_json()
    assert "error" not in c and c.get("end") == "eof", c
    assert c["recv_bytes"] == n, c
    assert cli.returncode == 0, cli.returncode
